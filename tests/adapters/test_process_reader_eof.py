"""The output reader with real pipes and a real socket: a child's pipes already at their end when its
start is read are closed without being watched, and nothing it wrote is lost; a pipe still held
open is watched and drained for the drain time only."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from leasecore.clock import SystemClock
from leasecore.process.forkserver.frames import encode_frame
from leasecore.process.spec import ChildExit
from leasecore.process.supervisor.child import Child, ChildLinks
from leasecore.process.supervisor.reader import OutputReader
from leasecore.process.taskfiles import TaskFiles
from tests.support import wait_until

from .process_support import make_task

DRAIN_SECONDS = 0.3


class Harness:
    """An ``OutputReader`` reading messages from a socket pair, as it reads the fork server's:
    ``{"op": "add", "key"}`` hands it a child's pipes (as a ``spawned`` answer does),
    ``{"op": "exit", "key"}`` ends that child."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.reader = OutputReader(DRAIN_SECONDS)
        self.ours, theirs = socket.socketpair()
        self.children: dict[str, tuple[Child, int, int]] = {}
        self.lines: list[tuple[str, str, str]] = []
        self.done: dict[str, ChildExit] = {}
        self.watched: list[int] = []  # fds the reader put under epoll, other than the socket
        watch = self.reader._watch

        def counting_watch(fd: int, whose: Any) -> None:
            if isinstance(whose, Child):
                self.watched.append(fd)
            watch(fd, whose)

        self.reader._watch = counting_watch  # type: ignore[method-assign]
        self.ended = self.reader.watch_server(theirs, self._on_event, lambda: None)
        self._theirs = theirs

    def child(self, key: str) -> tuple[Child, int, int]:
        """A child with its task files and two pipes; returns it and the pipes' write ends."""
        files = TaskFiles.create(make_task(), parent=str(self.tmp_path))
        links = ChildLinks(lambda message: None, self.reader.exited, shutil.rmtree)

        def done(result: ChildExit) -> None:
            self.done[key] = result

        child = Child(links, key, files, lambda stream, line: self.lines.append((key, stream, line)),
                      SystemClock(), on_done=done)  # fmt: skip
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.children[key] = (child, out_r, err_r)
        return child, out_w, err_w

    def send(self, *messages: dict[str, Any]) -> None:
        """The messages in one write: the reader reads them together."""
        self.ours.sendall(b"".join(encode_frame(message) for message in messages))

    def _on_event(self, message: dict[str, Any]) -> None:
        child, out_r, err_r = self.children[message["key"]]
        if message["op"] == "add":
            self.reader.add_here(child, out_r, err_r)
        else:
            child._on_exit(0, None)

    def close(self) -> None:
        self.ours.close()
        assert self.ended.wait(10)
        self.reader.stop()
        self._theirs.close()


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    h = Harness(tmp_path)
    yield h
    h.close()


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_pipes_at_their_end_with_the_exit_in_the_same_read_are_never_watched(harness: Harness) -> None:
    child, out_w, err_w = harness.child("t1")
    os.write(out_w, b"hello\nlast words")  # a whole line and a part one: both delivered
    os.close(out_w)
    os.close(err_w)  # stderr: nothing, at its end
    harness.send({"op": "add", "key": "t1"}, {"op": "exit", "key": "t1"})
    assert wait_until(lambda: "t1" in harness.done, 10)
    result = harness.done["t1"]
    assert result.exit_code == 0
    assert ("t1", "stdout", "hello") in harness.lines
    assert ("t1", "stdout", "last words") in harness.lines
    assert "last words" in result.stdout_tail and result.stderr_tail == ""
    _, out_r, err_r = harness.children["t1"]
    assert harness.watched == [out_r]  # the one with data is read as before; the empty one closed at once
    assert _closed(out_r) and _closed(err_r)
    assert not os.path.exists(child._files.directory)


def test_pipes_at_their_end_before_the_exit_is_read_finish_the_child_at_its_exit(harness: Harness) -> None:
    _, out_w, err_w = harness.child("t1")
    os.close(out_w)
    os.close(err_w)
    harness.send({"op": "add", "key": "t1"})
    _, out_r, err_r = harness.children["t1"]
    assert wait_until(lambda: _closed(out_r) and _closed(err_r), 10)  # closed at once: nothing to read
    assert harness.watched == [] and "t1" not in harness.done
    harness.send({"op": "exit", "key": "t1"})
    assert wait_until(lambda: "t1" in harness.done, 10)  # finished by its exit alone
    assert harness.done["t1"].exit_code == 0


def test_a_pipe_still_held_open_is_watched_and_drained_for_the_drain_time_only(harness: Harness) -> None:
    _, out_w, err_w = harness.child("t1")
    os.close(err_w)
    harness.send({"op": "add", "key": "t1"})  # stdout stays open: as a daemonised grandchild holds it
    _, out_r, err_r = harness.children["t1"]
    assert wait_until(lambda: harness.watched == [out_r], 10)
    os.write(out_w, b"from the grandchild\n")
    assert wait_until(lambda: ("t1", "stdout", "from the grandchild") in harness.lines, 10)
    exited_at = time.monotonic()
    harness.send({"op": "exit", "key": "t1"})
    assert wait_until(lambda: "t1" in harness.done, 10)
    assert time.monotonic() - exited_at >= DRAIN_SECONDS * 0.9  # the drain time, not the pipe's end
    assert _closed(out_r) and _closed(err_r)
    os.close(out_w)


def test_many_children_started_in_one_read_each_get_their_output(harness: Harness) -> None:
    keys = [f"t{n}" for n in range(40)]
    for n, key in enumerate(keys):
        _, out_w, err_w = harness.child(key)
        if n % 2:
            os.write(err_w, f"line {n}\n".encode())
        os.close(out_w)
        os.close(err_w)
    harness.send(*({"op": op, "key": key} for key in keys for op in ("add", "exit")))
    assert wait_until(lambda: len(harness.done) == len(keys), 10)
    for n, key in enumerate(keys):
        assert ((key, "stderr", f"line {n}") in harness.lines) == bool(n % 2)
    assert len(harness.watched) == len(keys) // 2  # only the pipes with something in them


def test_a_bug_watching_one_childs_pipes_does_not_stop_the_reader(harness: Harness) -> None:
    _, out_w, err_w = harness.child("t1")  # both pipes held open: both would be watched
    watch = harness.reader._watch

    def broken(fd: int, whose: Any) -> None:
        if not isinstance(whose, Child):  # (the socket, if not registered yet)
            watch(fd, whose)
            return
        raise RuntimeError("a bug")

    harness.reader._watch = broken  # type: ignore[method-assign]
    harness.send({"op": "add", "key": "t1"}, {"op": "exit", "key": "t1"})
    assert wait_until(lambda: "t1" in harness.done, 10)  # its pipes closed: finished at its exit
    _, out_r, err_r = harness.children["t1"]
    assert _closed(out_r) and _closed(err_r)
    harness.reader._watch = watch  # type: ignore[method-assign]
    _, out_w2, err_w2 = harness.child("t2")
    os.write(out_w2, b"still read\n")
    os.close(out_w2)
    os.close(err_w2)
    harness.send({"op": "add", "key": "t2"}, {"op": "exit", "key": "t2"})
    assert wait_until(lambda: "t2" in harness.done, 10)
    assert ("t2", "stdout", "still read") in harness.lines
    os.close(out_w)
    os.close(err_w)
