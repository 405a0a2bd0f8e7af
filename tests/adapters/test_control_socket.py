"""The control socket (``leasecore.state.control``) on real unix sockets: requests, bad input, bounds,
peer checks and stale sockets. The runner's side of each command is tested end to end in
``tests/integration/test_operate_e2e.py``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from leasecore.state.control import (
    MAX_REQUEST_BYTES,
    ControlError,
    ControlServer,
    RunnerSocket,
    control_sockets,
    parse_request,
    remove_stale,
    send_request,
    socket_path,
)


class Recorder:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def __call__(self, request: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            self.requests.append(request)
        return {"ok": True, "changed": request["task_types"]}


@pytest.fixture
def state(tmp_path: Path) -> Path:
    directory = tmp_path / "state"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def served(state: Path) -> Iterator[tuple[ControlServer, Recorder]]:
    recorder = Recorder()
    server = ControlServer(state, recorder)
    server.start()
    try:
        yield server, recorder
    finally:
        server.close()


def raw_exchange(path: Path, payload: bytes, *, shut: bool = True) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(payload)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_a_request_reaches_the_handler_and_its_answer_comes_back(
    served: tuple[ControlServer, Recorder],
) -> None:
    server, recorder = served
    assert server.path == socket_path(server.path.parent, os.getpid())
    assert server.path.stat().st_mode & 0o777 == 0o600
    reply = send_request(server.path, {"command": "pause", "task_types": ["a", "b"]})
    assert reply == {"ok": True, "changed": ["a", "b"]}
    assert recorder.requests == [{"command": "pause", "task_types": ["a", "b"], "timeout_seconds": None}]
    assert control_sockets(server.path.parent) == [RunnerSocket(os.getpid(), server.path)]


@pytest.mark.parametrize(("payload", "why"), [
    (b"not json\n", "one line of JSON"),
    (b"[1, 2]\n", "a JSON object"),
    (b'{"command": "rm -rf"}\n', "unknown command"),
    (b'{"command": "pause", "task_types": "a"}\n', "task_types must be a list"),
    (b'{"command": "pause", "task_types": [1]}\n', "task_types must be a list"),
    (b'{"command": "drain", "timeout_seconds": -1}\n', "timeout_seconds"),
    (b'{"command": "drain", "timeout_seconds": true}\n', "timeout_seconds"),
    (b"\xff\xfe\n", "one line of JSON"),
])
def test_a_bad_request_is_answered_with_its_reason_and_the_socket_serves_on(
    served: tuple[ControlServer, Recorder], payload: bytes, why: str,
) -> None:
    server, recorder = served
    reply = json.loads(raw_exchange(server.path, payload))
    assert reply["ok"] is False and why in reply["error"]
    assert recorder.requests == []
    assert send_request(server.path, {"command": "reload"})["ok"] is True  # still serving


def test_an_oversized_request_is_refused_without_reading_it_all(
    served: tuple[ControlServer, Recorder],
) -> None:
    server, recorder = served
    try:
        answer = raw_exchange(server.path, b"x" * (4 * MAX_REQUEST_BYTES))
    except (BrokenPipeError, ConnectionResetError):
        answer = b""  # the runner may close before the client has written it all
    if answer:
        assert b"longer than" in answer
    assert recorder.requests == []
    assert send_request(server.path, {"command": "resume"})["ok"] is True


def test_a_client_that_sends_nothing_is_dropped_and_does_not_block_the_next(
    served: tuple[ControlServer, Recorder],
) -> None:
    server, _ = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(server.path))  # says nothing: dropped after the request timeout
        reply = send_request(server.path, {"command": "resume"}, timeout_seconds=10)
    assert reply["ok"] is True


def test_a_peer_of_another_uid_is_refused_and_logged(
    served: tuple[ControlServer, Recorder], caplog: pytest.LogCaptureFixture,
) -> None:
    server, recorder = served
    server._allowed = {os.geteuid() + 4242}  # as if this process were another user (e2e: setpriv)
    caplog.set_level("WARNING")
    reply = send_request(server.path, {"command": "pause", "task_types": []})
    assert reply["ok"] is False and "may not control this runner" in reply["error"]
    assert recorder.requests == []
    assert f"refused a request from uid {os.geteuid()}" in caplog.text


def test_a_stale_socket_is_reported_stale_and_removed(state: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = socket_path(state, child.pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
        leftover.bind(str(dead))  # bound, never listened on, then closed: what a killed runner leaves
    with pytest.raises(ControlError) as caught:
        send_request(dead, {"command": "reload"})
    assert caught.value.stale
    assert remove_stale(RunnerSocket(child.pid, dead))
    assert not dead.exists()


def test_a_new_runner_removes_the_sockets_of_dead_ones(state: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    dead = socket_path(state, child.pid)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
        leftover.bind(str(dead))
    server = ControlServer(state, Recorder())
    server.start()
    try:
        assert not dead.exists()
        assert remove_stale(RunnerSocket(os.getpid(), server.path)) is False  # a live one stays
    finally:
        server.close()
    assert not server.path.exists()  # closing removes its own


def test_a_state_dir_too_long_for_a_socket_address_still_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True, mode=0o700)
    server = ControlServer(deep, Recorder())
    server.start()
    try:
        assert len(str(server.path)) > 108
        assert send_request(server.path, {"command": "pause", "task_types": ["x"]})["changed"] == ["x"]
    finally:
        server.close()


def test_parse_request_fills_the_defaults() -> None:
    assert parse_request(b'{"command": "drain", "timeout_seconds": 5}') == {
        "command": "drain", "task_types": [], "timeout_seconds": 5.0}
