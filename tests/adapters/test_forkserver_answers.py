"""The fork server's answers are sent together at the end of a turn of its loop, in order, and at
once when they pile up past a bound: a task's "exited" and "gone" then wake the runner's reader once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from leasecore.process.forkserver import server as forkserver
from leasecore.process.forkserver.frames import FrameBatch, send_frame, take_frames


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    yield ours, theirs
    ours.close()
    theirs.close()


def _received(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return data
        data += chunk


def test_the_fork_servers_answers_wait_for_the_end_of_the_turn_and_go_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    server = forkserver.ForkServer(theirs)
    try:
        server._reply({"op": "exited", "key": "t1", "code": 0})
        server._reply({"op": "gone", "key": "t1"})
        server._reply({"op": "spawned", "id": 7, "key": "t2"})
        assert _received(ours) == b""  # nothing sent before the turn ends
        server._answers.flush()
        buffer = bytearray(_received(ours))
        assert [m["op"] for m in take_frames(buffer)] == ["exited", "gone", "spawned"]
        assert not buffer
        server._answers.flush()  # nothing queued: nothing sent
        assert _received(ours) == b""
    finally:
        server._selector.close()
        for fd in (server._wake_r, server._wake_w):
            os.close(fd)


def test_frames_piling_up_past_the_bound_are_sent_at_once(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    batch = FrameBatch(theirs, max_bytes=200)
    batch.add({"op": "exited", "key": "t1", "pad": "x" * 100})
    assert _received(ours) == b""
    batch.add({"op": "gone", "key": "t1", "pad": "x" * 100})  # past 200 bytes: sent now
    buffer = bytearray(_received(ours))
    assert [m["op"] for m in take_frames(buffer)] == ["exited", "gone"]


def test_a_batch_for_a_closed_socket_is_dropped_quietly(pair: tuple[socket.socket, socket.socket]) -> None:
    ours, theirs = pair
    batch = FrameBatch(theirs)
    batch.add({"op": "gone", "key": "t1"})
    ours.close()  # the runner is gone: EPIPE
    batch.flush()
    theirs.close()
    batch.add({"op": "gone", "key": "t2"})
    batch.flush()  # closed here too: nothing to send to


# A fork server whose tick queues an answer and then fails, in the turn that also answers a request:
# run in its own process (run() makes its process a subreaper and ignores signals), on one end of a
# socket pair.
_FAILING_TURN = """
import socket, sys
from leasecore.process.forkserver import server as forkserver
server = forkserver.ForkServer(socket.socket(fileno=int(sys.argv[1])))
def failing_tick():
    server._reply({"op": "exited", "key": "t1", "code": 0})
    raise RuntimeError("a bug in a turn")
server._killer.tick = failing_tick  # the turn's tick (kills.Killer)
server.run()
"""


def test_answers_of_a_turn_that_fails_are_sent_before_the_fork_server_dies() -> None:
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _FAILING_TURN, str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], stderr=subprocess.PIPE)
        theirs.close()
        ours.settimeout(30)
        send_frame(ours, {"op": "stats", "id": 1})  # wakes it: the turn answers, then its tick fails
        data = bytearray()
        while chunk := ours.recv(1 << 16):  # until EOF: the fork server died
            data += chunk
        assert proc.wait(30) != 0
        assert proc.stderr is not None and b"a bug in a turn" in proc.stderr.read()
        proc.stderr.close()
        assert [m["op"] for m in take_frames(data)] == ["ready", "stats", "exited"]
    finally:
        ours.close()


def test_answers_the_runner_does_not_read_wait_without_blocking_and_go_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    # A stalled runner reads nothing: the fork server must not block in a send (its dead-man's
    # switches would stop firing); what the socket does not take waits, in order, for the next flush.
    ours, theirs = pair
    batch = FrameBatch(theirs, max_bytes=1 << 12)
    sent = 0
    while not batch.waiting:  # until the socket's buffer is full
        batch.add({"op": "exited", "key": f"t{sent}", "pad": "x" * 500})
        batch.flush()
        sent += 1
        assert sent < 100_000
    batch.add({"op": "gone", "key": "last"})
    batch.flush()  # returns at once: still waiting
    assert batch.waiting
    buffer = bytearray()
    ours.setblocking(False)
    messages: list[dict[str, object]] = []
    while not messages or messages[-1].get("key") != "last":
        try:
            buffer += ours.recv(1 << 20)
        except BlockingIOError:
            batch.flush()  # the runner read some: room for more
        messages += take_frames(buffer)
    assert [m["key"] for m in messages] == [f"t{i}" for i in range(sent)] + ["last"]
    assert not batch.waiting
