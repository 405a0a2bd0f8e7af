"""deploy/kubernetes/: each manifest parsed, and checked against the conductor.toml in the ConfigMap."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import requests
import yaml

from leasecore.config.loader import ResolvedConfig, resolve
from leasecore.config.tomlfile import parse_toml
from leasecore.server import EmbeddedServer
from tests.deploy.stopbudget import MARGIN_SECONDS, stop_budget_seconds

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"


def manifest(name: str) -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all((K8S / name).read_text()))
    assert isinstance(doc, dict)
    return doc


def configmap() -> dict[str, Any]:
    doc = manifest("configmap.yaml")
    assert (doc["apiVersion"], doc["kind"]) == ("v1", "ConfigMap")
    return doc


def worker_config() -> ResolvedConfig:
    """The ConfigMap's conductor.toml, resolved as `conductor-run run --config` would (no environment)."""
    loaded = parse_toml(configmap()["data"]["conductor.toml"], "configmap.yaml:conductor.toml")
    return resolve(loaded, {}, {}, cwd="/home/conductor-run", hostname="pod", require_task=False)


def container() -> dict[str, Any]:
    (c,) = manifest("deployment.yaml")["spec"]["template"]["spec"]["containers"]
    assert isinstance(c, dict)
    return c


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_the_configmap_is_a_valid_config_with_drain_on() -> None:
    config = worker_config()
    assert config.runner.drain is True
    assert [task.type for task in config.tasks] == ["encode_video"]
    assert config.server.auth_key is None and config.server.auth_secret is None  # no secret in the file


def test_the_deployment_waits_longer_than_the_runner_takes_to_stop() -> None:
    deployment = manifest("deployment.yaml")
    assert (deployment["apiVersion"], deployment["kind"]) == ("apps/v1", "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    config = worker_config()
    assert pod["terminationGracePeriodSeconds"] > config.runner.drain_timeout + max(
        t.kill_grace for t in config.tasks)
    assert pod["terminationGracePeriodSeconds"] >= stop_budget_seconds(config) + MARGIN_SECONDS
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_the_prestop_hook_drains_within_the_grace_period() -> None:
    """The preStop hook is `conductor-run drain` (it returns once the runner has exited 0); the grace
    period, which counts from the hook's start, covers its timeout, the kill grace and the reports."""
    c = container()
    command = c["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["conductor-run", "drain"]
    timeout = float(flag(command, "--timeout"))
    config = worker_config()
    assert timeout == config.runner.drain_timeout  # the hook and a SIGTERM'd runner drain alike
    drained = dataclasses.replace(config, runner=dataclasses.replace(config.runner, drain=True,
                                                                     drain_timeout=timeout))
    pod = manifest("deployment.yaml")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= stop_budget_seconds(drained) + MARGIN_SECONDS
    # The hook finds the runner's control socket where the runner publishes: no --state-dir of its own.
    assert "--state-dir" not in command
    assert "CONDUCTOR_RUN_STATE_DIR" in {e["name"] for e in c["env"]}


def test_the_config_comes_from_the_configmap_mounted_where_run_reads_it() -> None:
    c = container()
    pod = manifest("deployment.yaml")["spec"]["template"]["spec"]
    args = c["args"]
    assert args[0] == "run"  # the image's ENTRYPOINT is conductor-run
    config_path = Path(flag(args, "--config"))
    (volume,) = [v for v in pod["volumes"] if v.get("configMap")]
    assert volume["configMap"]["name"] == configmap()["metadata"]["name"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
    assert Path(mount["mountPath"]) / "conductor.toml" == config_path and mount["readOnly"] is True
    state = Path({e["name"]: e.get("value") for e in c["env"]}["CONDUCTOR_RUN_STATE_DIR"])
    (state_mount,) = [m for m in c["volumeMounts"] if Path(m["mountPath"]) in state.parents]
    (state_volume,) = [v for v in pod["volumes"] if v["name"] == state_mount["name"]]
    assert "emptyDir" in state_volume  # the pod's own, never shared
    # Not the volume's root: an emptyDir is world-writable, and check_state_dir refuses that; a
    # missing subdirectory is created 0700 by the runner.
    assert state != Path(state_mount["mountPath"])


def test_probes_reach_the_metrics_endpoints_on_the_pod_address() -> None:
    c = container()
    args = c["args"]
    assert flag(args, "--metrics-host") == "0.0.0.0"
    port = int(flag(args, "--metrics-port"))
    (named,) = [p for p in c["ports"] if p["name"] == "metrics"]
    assert named["containerPort"] == port
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}


def test_credentials_come_from_a_secret_and_the_pod_runs_as_the_images_user() -> None:
    c = container()
    env = {e["name"]: e for e in c["env"]}
    for name in ("CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET"):
        assert "value" not in env[name]
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "conductor-run-credentials" and ref["key"]
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["resources"]["limits"]["memory"]
    security = manifest("deployment.yaml")["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True
    user = re.search(r"^USER (\d+):(\d+)$", (ROOT / "deploy" / "Containerfile").read_text(), re.MULTILINE)
    assert user is not None
    assert (security["runAsUser"], security["runAsGroup"]) == (int(user.group(1)), int(user.group(2)))
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_keda_scales_the_deployment_on_the_task_types_queue_size() -> None:
    scaled = manifest("scaledobject.yaml")
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == manifest("deployment.yaml")["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "metrics-api"
    meta = trigger["metadata"]
    assert (meta["format"], meta["valueLocation"]) == ("json", "@this")
    assert float(meta["targetValue"]) > 0
    url = urlsplit(meta["url"])
    config = worker_config()
    assert f"{url.scheme}://{url.netloc}/api" == config.server.url
    assert url.path == "/api/tasks/queue/size"
    assert parse_qs(url.query) == {"taskType": [t.type for t in config.tasks]}


def test_the_trigger_url_answers_a_bare_number_that_at_this_selects() -> None:
    # GJSON's "@this" is the whole document; KEDA accepts it when it is a JSON number (checked with
    # gjson v1.18.0: "7" -> Number 7). The same path on the embedded server (conformance covers the
    # real one):
    url = urlsplit(manifest("scaledobject.yaml")["spec"]["triggers"][0]["metadata"]["url"])
    with EmbeddedServer() as server:
        local = server.url.removesuffix("/api") + url.path + "?" + url.query
        r = requests.get(local, timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    value = json.loads(r.text)
    assert isinstance(value, int) and not isinstance(value, bool) and value == 0
