"""The fork server's answers are sent together at the end of a turn of its loop, in order, and at
once when they pile up past a bound: a task's "exited" and "gone" then wake the runner's reader once."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from leasecore.process import forkserver
from leasecore.process.frames import FrameBatch, take_frames


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
