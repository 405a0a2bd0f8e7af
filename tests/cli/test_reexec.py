"""cli/reexec.py in-process (#24): which variables are handed over, and the receiving end."""

from __future__ import annotations

import json
import os

import pytest

from cli import reexec
from leasecore.errors import ConductorRunError


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
    with pytest.raises(ConductorRunError, match="not a file descriptor"):
        reexec.receive({reexec.HANDOFF_ENV: "x"})


def test_in_process_runs_never_re_execute(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reexec, "_allowed", False)
    monkeypatch.setenv("CONDUCTOR_AUTH_SECRET", "s")
    reexec.hand_off()  # returns: a CliRunner test must never have its process replaced
