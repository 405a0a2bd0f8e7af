"""``conductor-run worker stdio`` at the command line, before any server is contacted: conductor-cli's
flags are all accepted, its profile files' problems are clear errors (exit 3, the file named, no
traceback), and the exit codes of its shutdown habit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli import exitcodes
from cli.workerstdio import worker_exit_code
from leasecore.config.loader import load_config
from leasecore.runner.ports import RunOutcome


def worker(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    return subprocess.run([sys.executable, "-m", "cli", "worker", "stdio", *args], cwd=tmp_path,
                          env=base | {"HOME": str(tmp_path)} | (env or {}), capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def test_bad_yaml_in_a_profile_is_exit_3_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / ".conductor-cli").mkdir()
    bad = tmp_path / ".conductor-cli" / "config-prod.yaml"
    bad.write_text("server: http://x:1\nauth-key: [oops\n")
    done = worker(tmp_path, "--type", "t", "--profile", "prod", "true")
    assert done.returncode == exitcodes.CONFIG, done.stderr
    assert done.stderr.startswith(f"conductor-run: configuration error: conductor-cli config file {bad} "
                                  "is not valid YAML at line 3, column 1")  # fmt: skip
    assert "Traceback" not in done.stderr


def test_a_missing_profile_is_exit_3_naming_the_expected_file(tmp_path: Path) -> None:
    done = worker(tmp_path, "--type", "t", "true", env={"CONDUCTOR_PROFILE": "staging"})
    assert done.returncode == exitcodes.CONFIG
    assert done.stderr == (
        "conductor-run: configuration error: profile 'staging' (from $CONDUCTOR_PROFILE) doesn't exist "
        f"(expected file: {tmp_path}/.conductor-cli/config-staging.yaml)\n"
    )


def test_every_conductor_cli_flag_is_accepted(tmp_path: Path) -> None:
    """All of them at once, then a server that is not there: the answer is exit 4 (unreachable), not a
    usage error (2) - every flag parsed, with its value."""
    (tmp_path / "cli.yaml").write_text("server-type: OSS\n")
    done = worker(
        tmp_path, "--type", "t", "--count", "2", "--poll-timeout", "100", "--timeout", "100",
        "--exec-timeout", "5", "--worker-id", "w", "--domain", "d", "--verbose", "-v",
        "--server", "http://127.0.0.1:9/api", "--auth-key", "k", "--auth-secret", "s", "--server-type", "OSS",
        "--config", "cli.yaml", "-y", "--yes", "--state-dir", str(tmp_path / "state"), "--",
        sys.executable, "-c", "pass",
    )  # fmt: skip
    assert done.returncode == exitcodes.UNREACHABLE, done.stderr
    assert "server unreachable at http://127.0.0.1:9/api" in done.stderr
    assert "--auth-secret was on the command line, where other users could read it" in done.stderr
    assert "usage" not in done.stderr.lower()


def test_flags_after_the_commands_words_are_read_as_cobra_reads_them(tmp_path: Path) -> None:
    done = worker(tmp_path, "--type", "t", "python3", "worker.py", "--count", "0")
    assert done.returncode == exitcodes.CONFIG  # --count 0 reached the merge: it was read as a flag
    assert "invalid concurrency = 0 (from flag --count)" in done.stderr  # named as it was typed
    done = worker(tmp_path, "--type", "t", "python3", "-u", "worker.py")
    assert done.returncode == exitcodes.USAGE and "No such option: -u" in done.stderr  # as cobra: use --


def test_the_options_become_a_stdio_run_with_a_drain(tmp_path: Path) -> None:
    from cli.workerstdio import merge_environ, resolve_cli

    cli = resolve_cli({"server": "http://127.0.0.1:9"}, profile=None, config_file=None,
                      environ={"HOME": str(tmp_path)}, cwd=str(tmp_path))  # fmt: skip
    overrides = {"command": ["w"], "task_type": "t", "protocol": "stdio", "drain": True, "concurrency": 4,
                 "poll_timeout": 100}  # fmt: skip
    resolved = load_config(overrides, merge_environ({"PATH": "/bin"}, cli), str(tmp_path), hostname="h")
    (task,) = resolved.tasks
    assert (task.protocol, task.concurrency, task.poll_timeout) == ("stdio", 4, 100)
    assert resolved.runner.drain and resolved.runner.drain_timeout == 60.0
    assert resolved.server.url == "http://127.0.0.1:9/api"


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (RunOutcome(signum=signal.SIGTERM), exitcodes.OK),  # the drain a first signal began
        (RunOutcome(signum=signal.SIGINT), exitcodes.OK),
        (RunOutcome(signum=signal.SIGTERM, forced=True), 130),  # a second signal ended the tasks
        (RunOutcome(poller_failed=True), exitcodes.UNEXPECTED),
    ],
)
def test_exit_codes_of_the_shutdown_habit(tmp_path: Path, outcome: RunOutcome, expected: int) -> None:
    resolved = load_config({"command": ["w"], "task_type": "t"}, {}, str(tmp_path), hostname="h")
    assert worker_exit_code(outcome, resolved) == expected


def test_credential_flags_are_cut_from_the_re_executed_command_line() -> None:
    from cli.workerstdio import _without_credential_flags

    argv = ["py", "-m", "cli", "worker", "stdio", "--type", "t", "--auth-key", "k", "--auth-secret=s",
            "python3", "w.py", "--auth-token", "tok", "--count", "2", "--", "x", "--auth-secret", "kept"]
    assert _without_credential_flags(argv) == ["py", "-m", "cli", "worker", "stdio", "--type", "t", "python3",
                                               "w.py", "--count", "2", "--", "x", "--auth-secret", "kept"]


def test_a_profile_file_holding_a_secret_open_to_others_is_warned_about(tmp_path: Path) -> None:
    (tmp_path / ".conductor-cli").mkdir()
    profile = tmp_path / ".conductor-cli" / "config-open.yaml"
    profile.write_text("server: http://127.0.0.1:9/api\nauth-key: k\nauth-secret: s-4711\n")
    profile.chmod(0o644)
    done = worker(tmp_path, "--type", "t", "--profile", "open", "--state-dir", str(tmp_path / "s"), "true")
    assert done.returncode == exitcodes.UNREACHABLE, done.stderr  # warned, then went on to the server
    wanted = f"config file {profile} holds auth_secret and is open to group or others (mode 0644)"
    assert wanted in done.stderr
    assert "s-4711" not in done.stderr
    profile.chmod(0o600)
    again = worker(tmp_path, "--type", "t", "--profile", "open", "true")
    assert "open to group or others" not in again.stderr
