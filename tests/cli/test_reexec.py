"""cli/reexec.py in-process (secrets out of the children's reach): which variables are handed over,
and the receiving end."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import exitcodes, reexec
from cli.main import _register, app
from leasecore.errors import ConductorRunError, ConfigError


def test_secret_names_cover_credentials_sensitive_keys_and_declared_secrets() -> None:
    environ = {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET": "s", "conductor.auth.token": "t",
               "MY_TOKEN": "x", "PATH": "/bin", "CONDUCTOR_SERVER_URL": "http://h/api"}
    assert reexec.secret_names(environ, ["MY_*"]) == [
        "CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET", "MY_TOKEN", "conductor.auth.token"]
    assert {"CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET"} <= reexec.sensitive_env_names()


def test_receive_reads_closes_and_forgets_the_hand_off() -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, json.dumps({"CONDUCTOR_AUTH_SECRET": "s3"}).encode())
    os.close(write_fd)
    environ = {"PATH": "/bin", reexec.HANDOFF_ENV: str(read_fd)}
    merged = reexec.receive(environ)
    assert merged == {"PATH": "/bin", "CONDUCTOR_AUTH_SECRET": "s3"}
    assert environ == {"PATH": "/bin"}  # the marker is gone: nothing later inherits it
    with pytest.raises(OSError):
        os.fstat(read_fd)  # closed


def test_receive_without_a_hand_off_is_the_environment() -> None:
    assert reexec.receive({"A": "1"}) == {"A": "1"}


def test_a_bad_hand_off_is_an_error_not_a_traceback() -> None:
    read_fd, write_fd = os.pipe()
    os.write(write_fd, b"[1, 2]")
    os.close(write_fd)
    with pytest.raises(ConductorRunError, match="not readable"):
        reexec.receive({reexec.HANDOFF_ENV: str(read_fd)})
    with pytest.raises(ConfigError, match="not a file descriptor"):
        reexec.receive({reexec.HANDOFF_ENV: "x"})


@pytest.mark.parametrize(("marker", "why"), [
    ("abc", "not a file descriptor number"), ("-4", "not a file descriptor number"),
    ("0", "stdin, stdout or stderr, never a hand-off"), ("77", "fd 77 is not open"),
    # Past a C int fstat raised OverflowError: a traceback, not this exit 3.
    ("2147483648", "not a file descriptor number"), ("99999999999999999999", "not a file descriptor number"),
])  # fmt: skip
def test_a_stray_marker_is_a_config_error_naming_the_variable(marker: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        reexec.receive({reexec.HANDOFF_ENV: marker})
    assert str(info.value) == (f"{reexec.HANDOFF_ENV}={marker!r} is not a secrets hand-off ({why}): only "
                               "conductor-run's own re-exec sets it; unset it")  # fmt: skip


def test_a_marker_naming_a_file_is_neither_read_nor_closed(tmp_path: Path) -> None:
    path = tmp_path / "not-a-pipe"
    path.write_text('{"CONDUCTOR_AUTH_SECRET": "s"}')
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ConfigError, match=f"fd {fd} is not a pipe"):
            reexec.receive({reexec.HANDOFF_ENV: str(fd)})
        assert os.lseek(fd, 0, os.SEEK_CUR) == 0  # still open, and nothing read from it
    finally:
        os.close(fd)


@pytest.mark.parametrize("marker", ["abc", "77", "0"])
def test_run_with_a_stray_marker_exits_3_in_one_line(marker: str) -> None:
    _register()
    env = {reexec.HANDOFF_ENV: marker, "COLUMNS": "200"}
    result = CliRunner().invoke(app, ["run", "--task-type", "t", "--", "/bin/true"], env=env)
    assert result.exit_code == exitcodes.CONFIG, result.output
    assert result.stderr.startswith(f"conductor-run: configuration error: {reexec.HANDOFF_ENV}=")
    assert result.stderr.count("\n") == 1


def test_in_process_runs_never_re_execute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reexec, "_allowed", False)
    monkeypatch.setenv("CONDUCTOR_AUTH_SECRET", "s")
    reexec.hand_off()  # returns: a CliRunner test must never have its process replaced
