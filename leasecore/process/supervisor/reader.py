"""The Supervisor's reader thread ("child-output"): every child's pipes and the fork server's socket.

Owns one selector over the read ends of every running child's stdout and stderr and the fork
server's socket, a wake-up pipe, and the thread. It feeds each child's captures (so ``on_line`` and
``on_lines``), drains a child's pipes for at most ``drain_seconds`` after its exit (which comes from
the fork server, never from pipe EOF) and then finishes it; it hands every fork server message to
the Supervisor's handler and calls a housekeeping hook now and then (expiring unanswered spawns).

Must not touch: the fork server's process or its sends (the link's), the Supervisor's tables (its
handlers do that), or a child's files (``Child._finish`` does). It never blocks on anything but its
selector: the fork server writes whole messages, and what came of one is kept until the rest arrives.

Threads: the "child-output" thread alone touches the selector, the pipes, the captures and the
socket's buffer; other threads only queue work (``watch_server``) and wake it through the pipe, or
``stop`` it. ``add_here`` and ``exited`` are called on the reader thread itself (no wake-up).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from leasecore.process.forkserver.frames import take_frames
from leasecore.process.results.stdio_protocol import StdoutDocument
from leasecore.process.supervisor.child import Child

# one logger for the runner's side of process/
log = logging.getLogger("leasecore.process.supervisor.supervisor")

READ_BYTES = 1 << 20  # the most one read of a child's pipe takes
_HUP_ONLY = select.EPOLLHUP  # a pipe whose writers are all gone and that holds nothing: at its EOF
BIG_PIPE_BYTES = 1 << 20  # a child that fills its 64 KiB pipe gets a 1 MiB one (fewer wake-ups)
_F_SETPIPE_SZ = 1031


class _ServerSocket:
    """The fork server's socket, as the reader thread reads it."""

    __slots__ = ("around", "buffer", "done", "on_eof", "on_event", "sock")

    def __init__(
        self, sock: socket.socket, on_event: Callable[[dict[str, Any]], None], on_eof: Callable[[], None],
        around: tuple[Callable[[], None], Callable[[], None]] | None = None,
    ) -> None:  # fmt: skip
        self.sock = sock
        self.buffer = bytearray()  # bytes of a message not complete yet
        self.on_event = on_event
        self.on_eof = on_eof
        self.around = around  # (before, after) the messages of one read
        self.done = threading.Event()  # set once on_eof has returned


class OutputReader:
    """The reader thread and its selector; see the module docstring."""

    def __init__(self, drain_seconds: float, housekeeping: Callable[[], float] | None = None) -> None:
        """``housekeeping()``: called on the thread now and then; returns the seconds until the next."""
        self._drain_seconds = drain_seconds
        self._housekeeping = housekeeping
        self._next_housekeeping_at = 0.0
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._children: set[Child] = set()  # added and not yet finished
        self._draining: set[Child] = set()  # of those, the exited ones with a drain deadline
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ident: int | None = None  # the reader thread's, once it runs
        # epoll itself, not selectors: its events tell a pipe at EOF (EPOLLHUP without EPOLLIN: its
        # writers gone, nothing left in it) from one with data, so an ended child's pipes are closed
        # without a read each (two system calls a task), and there is no selector key per fd to make.
        self._epoll = select.epoll()
        self._watched: dict[int, Child | _ServerSocket | None] = {}  # fd -> whose (None: the wake-up)
        self._new: list[Child] = []  # added during this read of the fork server's messages, not watched yet
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._watch(self._wake_r, None)

    def add_here(self, child: Child, out_r: int, err_r: int) -> None:
        """Read ``child``'s stdout/stderr pipes from now on (they are closed once it is finished).
        Called on the reader thread itself, when it reads the child's ``spawned`` reply: no wake-up.
        The pipes are watched once the rest of that read's messages are handled (``_watch_new``)."""
        assert threading.get_ident() == self._ident
        self._register(child, out_r, err_r)

    def exited(self, child: Child) -> None:
        """``child`` exited: drain its pipes for at most the drain time, then finish it. Called on the
        reader thread itself (exits come in the fork server's messages, read there): at once."""
        assert threading.get_ident() == self._ident
        self._check_exit(child)

    def watch_server(
        self, sock: socket.socket, on_event: Callable[[dict[str, Any]], None], on_eof: Callable[[], None],
        around: tuple[Callable[[], None], Callable[[], None]] | None = None,
    ) -> threading.Event:  # fmt: skip
        """Read the fork server's messages on this thread from now on: ``on_event(message)`` for each,
        then ``on_eof()`` once, at the socket's end (or an unreadable message). ``around``: (before,
        after), called around the messages of each read (after: even if one failed). Returns an
        Event set once ``on_eof`` has returned."""
        link = _ServerSocket(sock, on_event, on_eof, around)

        def register() -> None:
            self._watch(sock.fileno(), link)

        self._queue(register)
        return link.done

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """End the thread once every child added is finished (bounded wait)."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout_seconds)
        if thread is None or not thread.is_alive():
            self._epoll.close()
            for fd in (self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _queue(self, item: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="child-output", daemon=True)
                self._thread.start()
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        self._ident = threading.get_ident()
        while True:
            with self._lock:
                pending, self._pending = self._pending, []
                done = self._stopping and not self._children and not pending
            if done:
                return
            for work in pending:
                try:
                    work()
                except Exception:  # the one reader thread must outlive a bug in any piece of work
                    log.exception("the output reader's work failed; continuing")
            now = time.monotonic()  # real time on purpose: it bounds a real wait on pipes
            if self._housekeeping is not None and now >= self._next_housekeeping_at:
                try:
                    self._next_housekeeping_at = now + self._housekeeping()
                except Exception:  # as for queued work: the reader must go on
                    log.exception("the output reader's housekeeping failed; continuing")
                    self._next_housekeeping_at = now + 1.0
            deadlines = [c._drain_deadline for c in self._draining if c._drain_deadline is not None]
            if self._housekeeping is not None:
                deadlines.append(self._next_housekeeping_at)
            for child in [
                c for c in self._draining if c._drain_deadline is not None and c._drain_deadline <= now
            ]:
                self._finish(child)  # the child is gone; whoever still holds the pipe does not hold the task
            timeout = -1.0 if not deadlines else max(0.0, min(deadlines) - now)
            for fd, events in self._epoll.poll(timeout, len(self._watched)):
                whose = self._watched.get(fd)
                if whose is None:
                    if fd == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(self._wake_r, 4096)
                    continue  # (an fd closed by an earlier event of this poll)
                if isinstance(whose, _ServerSocket):
                    self._read_server(whose)
                    continue
                child = whose
                try:
                    if events == _HUP_ONLY:  # at EOF, nothing to read (pipe_poll: EPOLLIN iff data)
                        self._close_fd(child, fd)
                        self._check_exit(child)
                    else:
                        self._read(child, fd)
                except Exception:  # never let one child's trouble stop every other child's output
                    log.exception("reading the output of task %s failed", child.key)
                    self._close_fd(child, fd)
                    self._check_exit(child)

    def _watch(self, fd: int, whose: Child | _ServerSocket | None) -> None:
        self._epoll.register(fd, select.EPOLLIN)
        self._watched[fd] = whose

    def _unwatch(self, fd: int) -> None:
        del self._watched[fd]
        self._epoll.unregister(fd)

    def _register(self, child: Child, out_r: int, err_r: int) -> None:
        """Take ``child``'s pipes; ``_watch_new`` watches them (or closes those at EOF already)."""
        stdout, stderr = child._stdout_capture(), child._capture("stderr")
        child._captures = (stdout, stderr)
        child._fds = {out_r: stdout, err_r: stderr}
        self._children.add(child)  # first: whatever fails below, its exit still finishes it
        self._new.append(child)

    def _watch_new(self) -> None:
        """Watch the pipes of the children added since the last call, but for those at EOF already:
        a short command (``true``) has often ended by the time its ``spawned`` reply is read, its
        exit in the same read. One ``poll`` over all of them, and a pipe at its end (POLLHUP without
        POLLIN: writers gone, nothing in it) is closed at once, without the two ``epoll_ctl`` calls
        and the later wake-up a watch costs; its child is finished here once it exited."""
        new, self._new = self._new, []
        polled = select.poll()
        for child in new:
            for fd in child._fds:
                polled.register(fd, select.POLLIN)
        try:
            ended = {fd for fd, events in polled.poll(0) if events == select.POLLHUP}
        except OSError:  # (out of memory for the poll): every pipe is watched, as without it
            ended = set()
        for child in new:
            try:
                self._watch_pipes(child, ended)
            except Exception:  # as for a read: one child's trouble must not stop the reader
                log.exception("reading the output of task %s failed", child.key)
                for fd in list(child._fds):
                    with contextlib.suppress(OSError):
                        self._close_fd(child, fd)
            self._check_exit(child)

    def _watch_pipes(self, child: Child, ended: set[int]) -> None:
        for fd in list(child._fds):
            if fd in ended:
                del child._fds[fd]
                os.close(fd)
                continue
            try:
                self._watch(fd, child)
            except (OSError, ValueError, KeyError) as exc:  # e.g. no epoll watch left: the stream is lost
                log.error("task %s: cannot read its output (%s): it is dropped", child.key, exc)
                del child._fds[fd]
                os.close(fd)

    def _read_server(self, link: _ServerSocket) -> None:
        try:
            data = link.sock.recv(1 << 16)
            link.buffer += data
            messages = take_frames(link.buffer) if data else []
        except (OSError, ValueError) as exc:
            log.debug("the fork server's socket failed: %s", exc)
            data, messages = b"", []
        if messages:
            try:
                self._handle(link, messages)
            finally:  # (after the read's ``around``: a child finished here is reported after it, as before)
                if self._new:
                    self._watch_new()
        if data:
            return
        self._unwatch(link.sock.fileno())
        try:
            link.on_eof()
        except Exception:  # e.g. the state record unwritable: the reader must go on for the next server
            log.exception("handling the fork server's end failed")
        finally:
            link.done.set()

    def _handle(self, link: _ServerSocket, messages: list[dict[str, Any]]) -> None:
        if link.around is not None:
            link.around[0]()
        try:
            for message in messages:
                try:
                    link.on_event(message)
                except Exception:  # a bug handling one message must not stop every child's output
                    log.exception("handling a fork server message failed: %r", message)
        finally:
            if link.around is not None:
                try:
                    link.around[1]()
                except Exception:  # as for a message: the reader must go on
                    log.exception("handling a fork server message failed (after its read)")

    def _read(self, child: Child, fd: int) -> None:
        data = os.read(fd, READ_BYTES)
        if not data:
            self._close_fd(child, fd)
            self._check_exit(child)
            return
        child._fds[fd].feed(data)
        if len(data) >= 65536 and fd not in child._grown:  # a chatty child: a bigger pipe
            child._grown.add(fd)
            with contextlib.suppress(OSError):  # over the user's pipe quota: keep 64 KiB
                fcntl.fcntl(fd, _F_SETPIPE_SZ, BIG_PIPE_BYTES)

    def _close_fd(self, child: Child, fd: int) -> None:
        if child._fds.pop(fd, None) is not None:
            if self._watched.get(fd) is child:  # (not yet, for a child added in the read under way)
                self._unwatch(fd)
            os.close(fd)

    def _check_exit(self, child: Child) -> None:
        """Finish ``child`` once it exited and its pipes are at EOF; start its drain time at the exit."""
        if child not in self._children or not child._exited.is_set():
            return
        if not child._fds:
            self._finish(child)
        elif child._drain_deadline is None:
            child._drain_deadline = time.monotonic() + self._drain_seconds
            self._draining.add(child)

    def _finish(self, child: Child) -> None:
        for fd in list(child._fds):
            self._close_fd(child, fd)
        self._children.discard(child)
        self._draining.discard(child)
        assert child._captures is not None
        stdout, stderr = child._captures
        stdout.close()
        stderr.close()
        try:
            document = stdout.document() if isinstance(stdout, StdoutDocument) else None
            child._finish(stdout.tail(), stderr.tail(), document,
                          stdout.total_bytes if document is not None else None)
        except Exception:  # the task's files: log it; the child is done either way
            log.exception("finishing task %s failed", child.key)

