"""What a child is told about the server: CONDUCTOR_SERVER_URL always; credentials only on request.

From the merged configuration through ``plan_for`` to a real child's environment (``Supervisor``):
without ``pass_credentials`` no credential reaches the child, whatever the runner's environment
holds (the filter of ``spec.CREDENTIAL_PATTERNS`` stays exactly as it was); with it, both spellings.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from leasecore.config.loader import load_config
from leasecore.process import Supervisor
from leasecore.runner.childenv import credential_values, warning_for
from leasecore.runner.plans import plan_for

from .process_support import make_task

PRINT_ENV = "import json, os; print(json.dumps(dict(os.environ)))"
KEY, SECRET, TOKEN = "key-id-4242", "key-secret-9191", "token-7373"
CREDENTIAL_NAMES = ("CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET", "CONDUCTOR_AUTH_TOKEN",
                    "CONDUCTOR_ACCESS_KEY_ID", "CONDUCTOR_ACCESS_KEY_SECRET")  # fmt: skip


def child_env(
    tmp_path: Path, runner_env: dict[str, str], overrides: dict[str, Any]
) -> tuple[dict[str, str], str]:
    command = [sys.executable, "-c", PRINT_ENV]
    resolved = load_config({"task_type": "t", "command": command, **overrides}, runner_env, str(tmp_path),
                           hostname="h")  # fmt: skip
    (task,) = resolved.tasks
    plan = plan_for(task, server=resolved.server)
    with Supervisor(None, environ=runner_env) as supervisor:
        child = supervisor.spawn(make_task(), plan.spec, worker_id="w")
        exit_ = child.wait(30)
    assert exit_ is not None and exit_.exit_code == 0, exit_
    return json.loads(exit_.stdout_tail), exit_.stdout_tail


BASE = {"PATH": "/usr/bin:/bin", "HOME": "/h"}


def test_without_the_flag_the_child_gets_the_url_from_a_flag_and_no_credential(tmp_path: Path) -> None:
    runner_env = {
        **BASE,
        "CONDUCTOR_AUTH_KEY": KEY,
        "CONDUCTOR_AUTH_SECRET": SECRET,
        "CONDUCTOR_ACCESS_KEY_ID": "inherited-id",
        "CONDUCTOR_SERVER_URL": "http://from-env:1/api",
    }
    env, raw = child_env(tmp_path, runner_env, {"server": "http://127.0.0.1:9/api"})
    assert env["CONDUCTOR_SERVER_URL"] == "http://127.0.0.1:9/api"  # the runner's, not the inherited one
    for name in CREDENTIAL_NAMES:
        assert name not in env, name
    for value in (KEY, SECRET, "inherited-id"):
        assert value not in raw


def test_without_the_flag_a_password_in_the_url_is_cut(tmp_path: Path) -> None:
    env, raw = child_env(tmp_path, dict(BASE), {"server": "http://user:pw-5151@127.0.0.1:9/api"})
    assert env["CONDUCTOR_SERVER_URL"] == "http://127.0.0.1:9/api"
    assert "pw-5151" not in raw


def test_with_the_flag_key_and_secret_arrive_in_both_spellings(tmp_path: Path) -> None:
    runner_env = {**BASE, "CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET}
    env, _ = child_env(tmp_path, runner_env, {"server": "http://127.0.0.1:9/api", "pass_credentials": True})
    assert env["CONDUCTOR_SERVER_URL"] == "http://127.0.0.1:9/api"
    assert (env["CONDUCTOR_AUTH_KEY"], env["CONDUCTOR_AUTH_SECRET"]) == (KEY, SECRET)
    assert (env["CONDUCTOR_ACCESS_KEY_ID"], env["CONDUCTOR_ACCESS_KEY_SECRET"]) == (KEY, SECRET)
    assert "CONDUCTOR_AUTH_TOKEN" not in env


def test_with_the_config_key_a_token_arrives(tmp_path: Path) -> None:
    (tmp_path / "conductor.toml").write_text("[server]\npass_credentials = true\n")
    env, _ = child_env(tmp_path, {**BASE, "CONDUCTOR_AUTH_TOKEN": TOKEN}, {})
    assert env["CONDUCTOR_AUTH_TOKEN"] == TOKEN
    assert env["CONDUCTOR_SERVER_URL"] == "http://localhost:8080/api"  # the default, said all the same
    for name in ("CONDUCTOR_AUTH_KEY", "CONDUCTOR_ACCESS_KEY_ID"):
        assert name not in env


@pytest.mark.parametrize("passing", [False, True])
def test_the_masking_hook_and_the_warning_follow_the_flag(tmp_path: Path, passing: bool) -> None:
    runner_env = {**BASE, "CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET}
    resolved = load_config({"task_type": "t", "command": ["true"], "pass_credentials": passing or None},
                           runner_env, str(tmp_path), hostname="h")  # fmt: skip
    assert set(credential_values(resolved.server)) == ({KEY, SECRET} if passing else set())
    warning = warning_for(resolved.server)
    assert (warning is not None and "credentials" in warning) if passing else warning is None
