"""``run --log-format json``: the fatal message that ends a run is a JSON line too, like every log line.

A log collector that parses stderr line by line must not meet one plain-text line at the very moment
something went wrong. Configuration errors come before the configuration exists: the log format is
taken from where the user asked for it (flag, else environment, else the file's ``[worker]``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import exitcodes
from cli.main import _register, app
from leasecore.server import EmbeddedServer

LOG_KEYS = {"time", "level", "logger", "message"}


@pytest.fixture(scope="module", autouse=True)
def _commands() -> None:
    _register()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def json_lines(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line parsed as one JSON object with the log lines' keys (fails on any other line)."""
    assert stderr.strip(), "nothing on stderr"
    records = []
    for line in stderr.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"not a JSON line: {line!r}")
        assert isinstance(record, dict) and set(record) >= LOG_KEYS, line
        records.append(record)
    return records


def fatal(stderr: str) -> dict[str, Any]:
    """The one error record among the JSON lines (warnings may come before it)."""
    (error,) = [record for record in json_lines(stderr) if record["level"] == "error"]
    return error


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stdout, result.stderr


def _closed_port_url() -> str:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/api"


def run_process(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``conductor-run run ARGS -- python -c pass`` in its own process (it reaches run_worker)."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    argv = [sys.executable, "-m", "cli", "run", "--task-type", "t", "--state-dir", str(tmp_path / "state"),
            *args, "--", sys.executable, "-c", "pass"]
    done = subprocess.run(argv, cwd=tmp_path, env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr


# --- errors of the run itself: the resolved log format applies ----------------------------------------


def test_an_unreachable_server_is_a_json_error_line(tmp_path: Path) -> None:
    # Before: exit 4 with the plain line "conductor-run: server unreachable at ...".
    url = _closed_port_url()
    code, err = run_process(tmp_path, "--log-format", "json", "--server", url)
    assert code == exitcodes.UNREACHABLE, err
    error = fatal(err)
    assert error["message"].startswith(f"server unreachable at {url}: ")
    assert error["logger"] == "conductor_run"


def test_refused_credentials_are_a_json_error_line_without_the_secret(tmp_path: Path) -> None:
    wrong = "wrong-secret-never-printed"
    with EmbeddedServer(auth_key="key-id", auth_secret="right-secret") as server:
        code, err = run_process(
            tmp_path, "--server", server.url,
            env={"CONDUCTOR_RUN_LOG_FORMAT": "json", "CONDUCTOR_AUTH_KEY": "key-id",
                 "CONDUCTOR_AUTH_SECRET": wrong},
        )
    assert code == exitcodes.UNREACHABLE, err
    assert "refused our credentials" in fatal(err)["message"]
    assert wrong not in err and "right-secret" not in err


def test_an_unusable_state_dir_found_by_the_worker_is_a_json_error_line(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    code, err = run_process(tmp_path, "--log-format", "json", "--server", _closed_port_url(),
                            "--state-dir", str(a_file))
    assert code == exitcodes.CONFIG, err
    assert fatal(err)["message"].startswith("configuration error: ")
    assert "state directory" in fatal(err)["message"]


# --- configuration errors: the log format the user asked for ------------------------------------------


BAD_GRACE = ("run", "--kill-grace", "-1", "--task-type", "x", "--", "true")


def _bad_grace(tmp_path: Path, args: tuple[str, ...], env: dict[str, str], file: str | None) -> str:
    """``run`` with an invalid --kill-grace, plus ``args``, ``env`` and a conductor.toml: its stderr."""
    if file is not None:
        (tmp_path / "conductor.toml").write_text(file, encoding="utf-8")
    code, _, err = invoke(*BAD_GRACE[:1], *args, *BAD_GRACE[1:], env=env)
    assert code == exitcodes.CONFIG, err
    return err


@pytest.mark.parametrize(
    ("args", "env", "file"),
    [
        (("--log-format", "json"), {}, None),
        ((), {"CONDUCTOR_RUN_LOG_FORMAT": "json"}, None),
        ((), {}, '[worker]\nlog_format = "json"\n'),
        (("--log-format", "json"), {"CONDUCTOR_RUN_LOG_FORMAT": "text"}, None),  # the flag wins
        ((), {"CONDUCTOR_RUN_LOG_FORMAT": "json"}, '[worker]\nlog_format = "text"\n'),  # env over file
    ],
    ids=["flag", "env", "file", "flag-over-env", "env-over-file"],
)
def test_a_configuration_error_is_json_when_json_was_asked_for(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], file: str | None
) -> None:
    (error,) = json_lines(_bad_grace(tmp_path, args, env, file))
    assert error["level"] == "error"
    expected = "configuration error: invalid kill_grace = -1.0 (from flag --kill-grace)"
    assert error["message"].startswith(expected)


@pytest.mark.parametrize(
    ("args", "env", "file"),
    [
        ((), {}, None),
        (("--log-format", "text"), {"CONDUCTOR_RUN_LOG_FORMAT": "json"}, None),  # the flag wins
        ((), {"CONDUCTOR_RUN_LOG_FORMAT": "text"}, '[worker]\nlog_format = "json"\n'),  # env over file
    ],
    ids=["nothing-asked", "flag-over-env", "env-over-file"],
)
def test_a_configuration_error_stays_plain_text_otherwise(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], file: str | None
) -> None:
    err = _bad_grace(tmp_path, args, env, file)
    assert err.startswith("conductor-run: configuration error: invalid kill_grace") and err.count("\n") == 1


def test_an_invalid_log_format_is_named_in_plain_text() -> None:
    # The one case left in plain text: the log format itself is what is wrong.
    code, _, err = invoke("run", "--log-format", "xml", "--task-type", "x", "--", "true",
                          env={"CONDUCTOR_RUN_LOG_FORMAT": "json"})
    assert code == exitcodes.CONFIG, err
    assert err.startswith("conductor-run: configuration error: invalid log_format = 'xml' (from flag")


def test_a_file_that_cannot_be_read_is_a_plain_error_unless_json_was_asked_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "conductor.toml").write_text('[worker]\nlog_format = "json"\nkill_grace = \n', "utf-8")
    code, _, err = invoke("run", "--task-type", "x", "--", "true")
    assert code == exitcodes.CONFIG and err.startswith("conductor-run: configuration error: "), err
    code, _, err = invoke("run", "--task-type", "x", "--", "true", env={"CONDUCTOR_RUN_LOG_FORMAT": "json"})
    assert code == exitcodes.CONFIG
    assert "not valid TOML" in fatal(err)["message"]
