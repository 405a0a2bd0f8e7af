"""``conductor-run server``: a real process on a free port, driven over HTTP, stopped by signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests
from typer.testing import CliRunner

from cli import exitcodes
from cli.main import _register, app


def _start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "server", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def proc_factory() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _url(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()  # printed once listening; bounded by the test timeout
    assert line.startswith("http://127.0.0.1:") and line.endswith("/api"), line
    return line


@pytest.mark.parametrize(
    ("sig", "code"),
    [
        (signal.SIGTERM, exitcodes.SIGTERM),
        (signal.SIGINT, exitcodes.SIGINT),
        (signal.SIGHUP, exitcodes.SIGHUP),
    ],
)
def test_serves_until_a_signal_then_exits_with_its_code(
    proc_factory: list[subprocess.Popen[str]], sig: signal.Signals, code: int
) -> None:
    proc = _start()
    proc_factory.append(proc)
    url = _url(proc)
    assert requests.get(url + "/health", timeout=10).status_code == 200
    assert requests.get(url + "/tasks/poll/batch/x", params={"timeout": 0}, timeout=10).json() == []
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    assert proc.stderr is not None
    assert "Traceback" not in proc.stderr.read()


def test_auth_flags_turn_token_auth_on(proc_factory: list[subprocess.Popen[str]]) -> None:
    proc = _start("--auth-key", "k", "--auth-secret", "s", "--token-ttl", "60", "--sweep-mode", "coarse")
    proc_factory.append(proc)
    url = _url(proc)
    assert requests.get(url + "/tasks/x", timeout=10).status_code == 401
    token = requests.post(url + "/token", json={"keyId": "k", "keySecret": "s"}, timeout=10).json()["token"]
    assert requests.get(url + "/tasks/x", headers={"X-Authorization": token}, timeout=10).status_code == 404
    proc.terminate()
    assert proc.wait(timeout=30) == exitcodes.SIGTERM


def test_auth_credentials_can_come_from_the_environment(proc_factory: list[subprocess.Popen[str]]) -> None:
    """So the secret need not appear on the command line (visible to every user in ps)."""
    env = {**os.environ, "CONDUCTOR_RUN_SERVER_AUTH_KEY": "k", "CONDUCTOR_RUN_SERVER_AUTH_SECRET": "s"}
    proc = _start(env=env)
    proc_factory.append(proc)
    url = _url(proc)
    assert requests.get(url + "/tasks/x", timeout=10).status_code == 401
    assert requests.post(url + "/token", json={"keyId": "k", "keySecret": "s"}, timeout=10).ok
    assert "s" not in proc.args


def test_help_explains_the_flags_and_the_timing_modes() -> None:
    _register()
    result = CliRunner().invoke(app, ["server", "--help"], terminal_width=120)
    assert result.exit_code == 0
    for text in (
        "--host",
        "--port",
        "--auth-key",
        "--auth-secret",
        "--token-ttl",
        "--sweep-mode",
        "NOT for production",
    ):
        assert text in result.output


@pytest.mark.parametrize(
    "args",
    [["--auth-key", "k"], ["--sweep-mode", "sometimes"], ["--host", ""], ["--host", "  "]],
    ids=["key-without-secret", "bad-sweep-mode", "empty-host", "blank-host"],
)
def test_bad_flag_combinations_are_usage_errors(args: list[str]) -> None:
    _register()
    result = CliRunner().invoke(app, ["server", "--port", "0", *args])
    assert result.exit_code == exitcodes.USAGE
    assert "Traceback" not in result.output


def test_a_busy_port_is_a_config_error(proc_factory: list[subprocess.Popen[str]]) -> None:
    first = _start()
    proc_factory.append(first)
    port = _url(first).rsplit(":", 1)[1].split("/")[0]
    second = subprocess.run(
        [sys.executable, "-m", "cli", "server", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert second.returncode == exitcodes.CONFIG
    assert "cannot listen" in second.stderr
    assert "Traceback" not in second.stderr


def test_every_interface_is_said_with_a_warning(proc_factory: list[subprocess.Popen[str]]) -> None:
    """Bound to 0.0.0.0 the URL printed is still loopback (this host's way in), so the log says what
    else reaches it: an embedded server has no auth unless asked, and is never for production."""
    proc = _start("--host", "0.0.0.0")
    proc_factory.append(proc)
    _url(proc)
    assert proc.stderr is not None
    listening = proc.stderr.readline()
    assert "listening on http://127.0.0.1:" in listening
    warning = proc.stderr.readline().strip()
    assert warning == ("warning: bound to 0.0.0.0, every interface: not only this host, and without auth "
                       "anyone who can reach this host may use it")
    quiet = _start()  # loopback, the default: no warning
    proc_factory.append(quiet)
    _url(quiet)
    assert quiet.stderr is not None
    quiet.stderr.readline()
    quiet.send_signal(signal.SIGTERM)
    assert quiet.wait(timeout=30) == exitcodes.SIGTERM
    assert quiet.stderr.read() == ""
