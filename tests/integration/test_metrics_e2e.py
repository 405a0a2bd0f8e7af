"""Metrics end to end: the real ``conductor-run run`` with ``--metrics-port 0``, real children, the
embedded server, ``/metrics`` parsed with prometheus-client's own parser; and a real Prometheus
server scraping the runner on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli import exitcodes
from tests.integration.helpers import ROOT, World
from tests.support import wait_until

_LISTENING = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")


def metrics_port(world: World, proc: subprocess.Popen[str]) -> int:
    found = wait_until(lambda: _LISTENING.search(world.stderr(proc)) or proc.poll() is not None,
                       what="the metrics endpoint to listen")
    assert isinstance(found, re.Match), world.stderr(proc)
    return int(found.group(1))


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample of /metrics: (name, labels) -> value, through prometheus-client's parser."""
    status, text = get(port, "/metrics")
    assert status == 200, text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum over the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def test_metrics_count_known_work_exactly(world: World) -> None:
    """Three tasks: two complete, one is fenced by its exec timeout and ends FAILED; every task beats
    at least once (R = 2 s: a beat every 1.6 s; each child runs longer). The counts are the runner's
    own, checked against what it did; the heartbeats and ownership checks (their number depends on
    the spread of the first attempt) against the HTTP requests the client counted for them."""
    world.define(response_timeout=2)
    for seconds in (2.5, 2.5, 60):
        world.start_workflow(seconds=seconds)
    proc = world.run("--concurrency", "3", "--exec-timeout", "4", "--kill-grace", "1", "--metrics-port", "0")
    port = metrics_port(world, proc)
    tt = world.task_type

    def settled() -> Samples | None:
        samples = scrape(port)
        return samples if value(samples, "conductor_run_task_results_total", taskType=tt) >= 3 else None

    samples = wait_until(settled, timeout_seconds=60, what="three results", interval_seconds=0.2)
    assert value(samples, "task_execution_started_total", taskType=tt) == 3
    assert value(samples, "conductor_run_task_results_total", taskType=tt, status="COMPLETED") == 2
    assert value(samples, "conductor_run_task_results_total", taskType=tt, status="FAILED") == 1
    assert value(samples, "conductor_run_task_results_total", taskType=tt) == 3
    assert value(samples, "conductor_run_fences_total", taskType=tt, reason="exec_timeout") == 1
    assert value(samples, "conductor_run_fences_total", taskType=tt) == 1
    assert value(samples, "task_execute_error_total", taskType=tt, exception="Fenced") == 1
    assert value(samples, "task_execute_error_total", taskType=tt) == 1
    assert value(samples, "task_execute_time_seconds_count", taskType=tt, status="SUCCESS") == 2
    assert value(samples, "task_execute_time_seconds_count", taskType=tt, status="FAILURE") == 1
    assert value(samples, "task_update_time_seconds_count", taskType=tt, status="SUCCESS") == 3
    assert value(samples, "task_update_error_total", taskType=tt) == 0
    assert value(samples, "task_result_size_bytes_count", taskType=tt) == 3
    # Polls go on while the scrape is read: one may be between its request's hook and the poller's.
    polls = value(samples, "task_poll_total", taskType=tt)
    assert polls >= 1
    assert 0 <= polls - value(samples, "task_poll_time_seconds_count", taskType=tt) <= 1
    requests = value(samples, "http_api_client_request_seconds_count", method="GET",
                     uri="/tasks/poll/batch/{taskType}")
    assert 0 <= requests - polls <= 1
    # Heartbeats: each task at least one, all acknowledged; one lateness sample per beat sent; every
    # POST /tasks is a beat, and the three results went out as update-v2 (each may claim the next
    # task; the exec timeout's FAILED too, its lease being sound).
    beats = value(samples, "conductor_run_heartbeats_total", taskType=tt, result="ok")
    assert beats >= 3
    assert value(samples, "conductor_run_heartbeats_total", taskType=tt, result="failed") == 0
    assert value(samples, "conductor_run_heartbeat_lateness_seconds_count") == beats
    assert value(samples, "http_api_client_request_seconds_count", method="POST", uri="/tasks") == beats
    assert value(samples, "http_api_client_request_seconds_count", method="POST",
                 uri="/tasks/update-v2") == 3
    checks = value(samples, "conductor_run_ownership_checks_total", taskType=tt)
    assert checks == value(samples, "conductor_run_ownership_checks_total", taskType=tt, result="ok")
    assert checks == value(samples, "http_api_client_request_seconds_count", method="GET",
                           uri="/tasks/{taskId}")
    # Nothing runs now; every slot is free; nothing waits in the outbox; no lease is left.
    assert value(samples, "active_workers", taskType=tt) == 0
    assert value(samples, "conductor_run_tasks_running", taskType=tt) == 0
    assert value(samples, "conductor_run_slots_free", taskType=tt) == 3
    assert value(samples, "conductor_run_outbox_results") == 0
    assert not any(n == "conductor_run_lease_remaining_seconds" for n, _ in samples)
    assert get(port, "/healthz") == (200, "ok: serving\n")
    assert get(port, "/readyz") == (200, "ok: ready\n")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def test_readyz_is_503_while_draining_and_healthz_stays_200(world: World) -> None:
    world.define(response_timeout=10)
    wf = world.start_workflow()
    proc = world.run("--drain", "--metrics-port", "0", command=world.gated_command())
    port = metrics_port(world, proc)
    wait_until(world.child_pids, what="the child to start")
    samples = wait_until(lambda: (s := scrape(port)) and value(s, "conductor_run_tasks_running") == 1 and s,
                         what="the running task counted")
    assert value(samples, "active_workers", taskType=world.task_type) == 1
    assert value(samples, "conductor_run_slots_free", taskType=world.task_type) == 0
    left = value(samples, "conductor_run_lease_remaining_seconds")
    assert 0 < left <= 10
    assert wait_until(lambda: get(port, "/readyz") == (200, "ok: ready\n"), what="ready")
    proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "letting 1 task(s) finish" in world.stderr(proc), what="the drain to begin")
    assert get(port, "/readyz") == (503, "unavailable: stopping: no new work is taken\n")
    assert get(port, "/healthz") == (200, "ok: stopping\n")
    world.gate.touch()
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert world.workflow_status(wf) == "COMPLETED"
    with pytest.raises(OSError):  # the endpoint is gone with the runner
        get(port, "/healthz")


def test_readyz_is_503_while_the_server_does_not_answer_and_200_once_it_does(world: World) -> None:
    """The poll window here: max(0.5 s poll + 1 s pause, the 5 s ownership-check interval) + the 10 s
    HTTP timeout = 15 s. Liveness stays 200: a restart would not bring the server back."""
    world.define(response_timeout=10)
    tt = world.task_type
    with world.proxy() as proxy:
        proc = world.run("--metrics-port", "0", url=proxy.url_for("/api"))
        port = metrics_port(world, proc)
        wait_until(lambda: get(port, "/readyz") == (200, "ok: ready\n"), what="ready")
        proxy.set_mode("reset")  # every connection cut, new ones too
        _, body = wait_until(lambda: (reply := get(port, "/readyz"))[0] == 503 and reply,
                             timeout_seconds=60, what="not ready", interval_seconds=0.25)
        assert body.startswith("unavailable: no answer from the Conductor server for "), body
        assert body.endswith(" s (poll window 15 s)\n"), body
        assert get(port, "/healthz") == (200, "ok: serving\n")
        samples = scrape(port)
        assert value(samples, "task_poll_error_total", taskType=tt, exception="ConductorUnavailable") >= 1
        assert value(samples, "task_poll_time_seconds_count", taskType=tt, status="FAILURE") >= 1
        assert value(samples, "http_api_client_request_seconds_count", uri="/tasks/poll/batch/{taskType}",
                     status="error") >= 1
        proxy.set_mode("pass")
        wait_until(lambda: get(port, "/readyz") == (200, "ok: ready\n"), timeout_seconds=60,
                   what="ready again", interval_seconds=0.25)
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


# ------------------------------------------------------------------------------- a real Prometheus


def _prometheus() -> tuple[str, str]:
    """The Debian package's binaries; in CI their absence fails the test (scripts/test installs them)."""
    found = {name: shutil.which(name) for name in ("prometheus", "promtool")}
    missing = sorted(name for name, path in found.items() if path is None)
    if missing:
        why = f"{' and '.join(missing)} not found (the Debian package 'prometheus' installs both)"
        if os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"):
            pytest.fail(f"{why}; scripts/test installs it in CI")
        pytest.skip(why)
    return str(found["prometheus"]), str(found["promtool"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def prometheus_for(tmp_path: Path) -> Iterator[Any]:
    """``start(target_port) -> query``: a real Prometheus scraping 127.0.0.1:target_port every second."""
    binary, _ = _prometheus()
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: int) -> Any:
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
            "scrape_configs:\n  - job_name: conductor-run\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{target}']\n"
        )
        web = _free_port()
        with (tmp_path / "prometheus.log").open("wb") as log:  # the child keeps its own copy of the fd
            procs.append(subprocess.Popen(
                [binary, f"--config.file={config}", f"--web.listen-address=127.0.0.1:{web}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            ))

        def query(expr: str) -> list[dict[str, Any]]:
            url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    body = json.loads(reply.read())
            except OSError:  # not listening yet
                return []
            assert body["status"] == "success", body
            return list(body["data"]["result"])

        return query

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_a_real_prometheus_scrapes_the_runner_and_promtool_accepts_the_output(
    world: World, prometheus_for: Any
) -> None:
    _, promtool = _prometheus()
    world.define(response_timeout=10)
    world.start_workflow(seconds=0)
    proc = world.run("--metrics-port", "0")
    port = metrics_port(world, proc)
    query = prometheus_for(port)

    def started_once() -> list[dict[str, Any]]:
        found = query(f'task_execution_started_total{{taskType="{world.task_type}"}}')
        return found if found and found[0]["value"][1] == "1" else []

    (series,) = wait_until(started_once, timeout_seconds=90, what="Prometheus to have scraped the task",
                           interval_seconds=0.5)
    assert series["metric"]["job"] == "conductor-run"
    assert series["metric"]["instance"] == f"127.0.0.1:{port}"
    (up,) = query("up")
    assert up["value"][1] == "1"

    # Every query of the Grafana dashboard is valid PromQL to this Prometheus, and the throughput
    # panel's sees the task.
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "conductor-run.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    for expr in exprs:
        query(expr.replace("$__rate_interval", "1m").replace("$taskType", ".*"))  # asserts "success"
    started = 'sum(increase(task_execution_started_total[1m]))'
    assert wait_until(lambda: query(started), what="the increase to be seen")

    status, text = get(port, "/metrics")
    assert status == 200
    code, lines = _promtool_check(promtool, text)
    # With the default label name (the SDKs' taskType, for their dashboards: docs/metrics.md),
    # promtool's one complaint is its camelCase: every line it prints is that lint, for a metric that
    # has the taskType label; nothing else. (metrics_task_type_label = "task_type": none, below.)
    camel = re.compile(r"^(\S+) label names should be written in 'snake_case' not 'camelCase'$")
    with_task_type = {family.name for family in text_string_to_metric_families(text)
                      if any("taskType" in s.labels for s in family.samples)}
    assert code == 3 and lines, (code, lines)  # 3: lint findings only (1 would be a parse error)
    for line in lines:
        found = camel.match(line)
        assert found is not None, f"promtool: {line}"
        assert found.group(1).removesuffix("_total") in with_task_type, line
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def _promtool_check(promtool: str, text: str) -> tuple[int, list[str]]:
    """``promtool check metrics`` on ``text``: its exit code and every non-empty line it printed."""
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]


def test_with_the_snake_case_label_promtool_finds_nothing_at_all(world: World) -> None:
    """``metrics_task_type_label = "task_type"`` (here from its env variable): every family that
    carries the task type has ``task_type``, none ``taskType``, and promtool exits 0 silent."""
    _, promtool = _prometheus()
    world.define(response_timeout=10)
    world.start_workflow(seconds=0)
    proc = world.run("--metrics-port", "0", env={"CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL": "task_type"})
    port = metrics_port(world, proc)
    tt = world.task_type
    samples = wait_until(lambda: (s := scrape(port)) and value(
        s, "conductor_run_task_results_total", task_type=tt, status="COMPLETED") == 1 and s,
        what="the task counted")
    assert value(samples, "task_execution_started_total", task_type=tt) == 1
    assert value(samples, "conductor_run_slots_free", task_type=tt) == 1
    assert not any("taskType" in dict(labels) for _, labels in samples)
    status, text = get(port, "/metrics")
    assert status == 200
    assert _promtool_check(promtool, text) == (0, [])
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
