"""The runner's side of process supervision: ``Supervisor`` (owns the fork server) and ``Child``.

Threads: one reader thread per Supervisor ("child-output") reads, with one selector, the fork
server's messages (spawn replies, exits, "tree gone") and every child's stdout and stderr: it feeds
the bounded captures, calls ``on_line``/``on_lines``, and on exit builds the ``ChildExit``, removes
the task's temporary files and calls ``on_done``. Exit comes from the fork server's ``waitid``, never
from pipe EOF: after the exit, the reader drains the child's pipes for at most
``output_drain_seconds`` and then closes them, so a grandchild holding stdout cannot keep a finished
task open. (One thread for all children, not one per child: a thread, an epoll fd and a wake-up pipe
per task cost more than running ``true`` itself; and one for the fork server too, since a second
one cost two GIL-contended thread switches per task.) The reader never waits on anything but its
selector: a task directory the child put more files in is removed, and a command whose start was
given up is killed, on a "supervisor-chores" thread (``_Chores``, started at the first chore).

If the fork server dies, its trees are killed (``_on_forkserver_lost``) and the next ``spawn``
starts a new one: a lost fork server costs the tasks it held, not every task after them.

The runner holds the server credentials in its memory (``run`` re-executes itself without them in
its environment, ``cli/reexec.py``, so ``/proc/<pid>/environ`` does not show them even to root; the
fork server starts with an empty environment). Children run as the same user unless the spec says
``run_as``, so by default the Supervisor makes the runner process non-dumpable (PR_SET_DUMPABLE 0): a
same-user child can then neither read the runner's ``/proc/<pid>/mem`` nor ptrace it (root still
can: ``run_as`` is the isolation from children that would run as root). The flag resets at exec, so
children themselves are unaffected. The cost: no core dumps of the runner, and debuggers or
profilers need root (CAP_SYS_PTRACE). A spec with ``run_as`` (#24) gets task files owned by that
user and is started by the fork server through ``forkexec.py`` (fork, setgroups/setgid/setuid, exec).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import itertools
import logging
import os
import secrets
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import leasecore
from leasecore.clock import Clock, SystemClock
from leasecore.errors import ProcessError, SpawnError
from leasecore.limits import rlimits_for
from leasecore.models import Task
from leasecore.process import _cgroupfs, _procfs, cgroups, leftovers
from leasecore.process.forkserver import recv_frame, send_frame, take_frames
from leasecore.process.output import StreamCapture
from leasecore.process.spec import ChildExit, CommandSpec, build_child_env, inherited_env
from leasecore.process.stdio_protocol import STDIO, StdoutDocument, task_json
from leasecore.process.taskfiles import TaskFiles

log = logging.getLogger(__name__)

LineSink = Callable[[str, str], None]
LinesSink = Callable[[str, list[str]], None]  # (stream, the complete lines of one read)
DoneSink = Callable[[ChildExit], None]
StartedSink = Callable[["Child"], None]
TreeMeta = Callable[[Task, str], dict[str, Any] | None]  # (task, worker_id) -> a tree record's meta
_READ_BYTES = 1 << 20
_BIG_PIPE_BYTES = 1 << 20  # a child that fills its 64 KiB pipe gets a 1 MiB one (fewer wake-ups)
_F_SETPIPE_SZ = 1031
# Boots the fork server from the source tree at argv[1] *without* running leasecore/__init__.py and
# leasecore/process/__init__.py (bare package stubs stand in): those import the runner's side
# (models, subprocess, threading, logging), doubling the fork server's memory for nothing.
_BOOT = (
    "import sys, types\n"
    "for name in ('leasecore', 'leasecore.process'):\n"
    "    stub = types.ModuleType(name)\n"
    "    stub.__path__ = [sys.argv[1] + '/' + name.replace('.', '/')]\n"
    "    sys.modules[name] = stub\n"
    "from leasecore.process.forkserver import main\n"
    "main(sys.argv[2:])\n"
)
_REPLY_TIMEOUT_SECONDS = 30.0
_MAX_STARTING = 32  # spawns sent to the fork server and not answered yet; start() waits beyond that
_PR_SET_DUMPABLE = 4
_warned_not_linux = False


def protect_from_children() -> bool:
    """Make this process non-dumpable: same-user children cannot read its environment or memory.

    Returns whether it took effect (False elsewhere than Linux).
    """
    if not _procfs.IS_LINUX:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) == 0)


_PATH_CACHE_SECONDS = 5.0  # how long a command found on PATH is not looked up again
_CACHE_SIZE = 64  # entries kept by each of the per-spawn caches below


def _resolve_executable(argv0: str, path_var: str, cwd: str) -> str:
    if "/" in argv0:
        return os.path.join(cwd, argv0)
    for directory in path_var.split(os.pathsep):
        candidate = os.path.join(cwd, directory or ".", argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise SpawnError(f"command not found: {argv0!r} is not in the child's PATH")


class Child:
    """One task command: running, or, from ``Supervisor.start``, being started (``pid`` 0 until the
    fork server's answer; a kill sent meanwhile reaches the tree all the same). Created by
    ``Supervisor.spawn`` or ``Supervisor.start``."""

    def __init__(
        self,
        supervisor: Supervisor,
        key: str,
        files: TaskFiles,
        on_line: LineSink | None,
        clock: Clock,
        on_lines: LinesSink | None = None,
        on_done: DoneSink | None = None,
    ) -> None:
        self.key = key
        self.pid = 0
        self.started_at = clock.monotonic()  # monotonic seconds (the Supervisor's clock)
        self._supervisor = supervisor
        self._files = files
        self._on_line = on_line
        self._on_lines = on_lines
        self._on_done = on_done
        self._clock = clock
        self._exit_info: tuple[int | None, int | None, float] | None = None
        self.cgroup: _cgroupfs.Group | None = None  # the tree's group, from spawn until it is gone
        self.memory_limit_by: str | None = None  # "cgroup" | "rlimit" | None: what enforces memory_max
        self._usage: tuple[dict[str, float], int] = ({}, 0)  # resources and OOM kills, at the exit
        self._exited = threading.Event()
        self._done = threading.Event()
        self._gone = threading.Event()
        self._settled = threading.Event()  # the fork server answered the spawn (or it was given up)
        self._start_error: ProcessError | None = None  # why the command never ran
        self._result: ChildExit | None = None
        # Owned by the output thread once the child is added to it:
        self._fds: dict[int, StreamCapture | StdoutDocument] = {}  # open pipe read ends
        self._captures: tuple[StreamCapture | StdoutDocument, StreamCapture] | None = None  # stdout, stderr
        self._stdout_is_document = False  # stdio protocol: stdout is kept whole, not streamed as lines
        self._grown: set[int] = set()
        self._drain_deadline: float | None = None

    def wait(self, timeout: float | None = None) -> ChildExit | None:
        """The child's exit (tails and output file included), or None if ``timeout`` passed first."""
        self._done.wait(timeout)
        return self._result

    def wait_gone(self, timeout: float | None = None) -> bool:
        """Wait until every process of the task's tree is dead and reaped."""
        return self._gone.wait(timeout)

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def terminate_tree(self, grace_seconds: float | None = None, *, since: float | None = None) -> None:
        """TERM the whole tree; the fork server KILLs what is left after the grace (default: the spec's),
        counted from ``since`` (a ``time.monotonic()`` value: when the caller decided to stop the
        tree; the same clock in every process on Linux) or else from when it gets the request."""
        self._supervisor._request(
            {"op": "signal", "key": self.key, "sig": signal.SIGTERM, "grace": grace_seconds, "since": since}
        )

    def kill_tree(self) -> None:
        """KILL the whole tree now (the group and every escapee)."""
        self._supervisor._request({"op": "signal", "key": self.key, "sig": signal.SIGKILL})

    # called on the reader thread, for the fork server's messages -----------------------------------

    def memory_bytes(self) -> int | None:
        """The tree's memory use now: from its group where it has one with memory accounting, else
        the direct child's resident set (None once it is gone)."""
        group = self.cgroup
        used = None if group is None else _cgroupfs.memory_current(group)
        if used is None and self.pid and not self.exited:
            used = _procfs.rss_bytes(self.pid)
        return used

    def _on_exit(self, code: int | None, sig: int | None, event: Mapping[str, Any] | None = None) -> None:
        if event is not None:
            raw = event.get("resources")
            usage = {}
            if isinstance(raw, dict):
                usage = {k: round(float(v), 3) for k, v in raw.items() if isinstance(v, int | float)}
            if "max_rss_bytes" in usage:
                usage["max_rss_bytes"] = int(usage["max_rss_bytes"])
            self._usage = (usage, int(event.get("oom_kills") or 0))
        if self._exit_info is None:
            self._exit_info = (code, sig, self._clock.monotonic())
            self._exited.set()
            self._supervisor._output.exited(self)

    def _on_gone(self) -> None:
        self.cgroup = None  # removed by the fork server
        self._gone.set()

    def _start_failed(self, error: ProcessError, notify: bool) -> None:
        """The command never ran: the child is done (and gone) with ``start_error``; ``on_done`` hears
        of it only for ``Supervisor.start`` (``spawn`` raises the error instead)."""
        self._start_error = error
        self._result = ChildExit(exit_code=None, signal=None, duration_seconds=0.0, start_error=str(error))
        self._exited.set()
        self._done.set()
        self._gone.set()
        self._settled.set()
        if notify and self._on_done is not None:
            try:
                self._on_done(self._result)
            except Exception:  # the sink's bug must not be lost silently
                log.exception("on_done sink failed for task %s", self.key)

    # the output thread -------------------------------------------------------------------------

    def _stdout_capture(self) -> StreamCapture | StdoutDocument:
        return StdoutDocument() if self._stdout_is_document else self._capture("stdout")

    def _capture(self, stream: str) -> StreamCapture:
        batch = self._on_lines
        if batch is None:
            return StreamCapture(self._emitter(stream))

        def emit_lines(lines: list[str]) -> None:
            try:
                batch(stream, lines)
            except Exception:  # a broken sink must not stop the reader (the child would block)
                log.exception("on_lines sink failed for task %s", self.key)

        return StreamCapture(emit_lines=emit_lines)

    def _emitter(self, stream: str) -> Callable[[str], None]:
        sink = self._on_line

        def emit(line: str) -> None:
            if sink is None:
                return
            try:
                sink(stream, line)
            except Exception:  # a broken sink must not stop the reader (the child would block)
                log.exception("on_line sink failed for task %s", self.key)

        return emit

    def _finish(self, stdout_tail: str, stderr_tail: str, stdout_document: bytes | None = None) -> None:
        assert self._exit_info is not None
        code, sig, ended_at = self._exit_info
        try:
            output, output_error = self._files.read_output()
        except Exception as exc:  # a bug: the task still ends (FAILED), never left unfinished for ever
            log.exception("task %s: reading its output file failed", self.key)
            output = None
            output_error = f"CONDUCTOR_OUTPUT_FILE could not be read (internal error: {type(exc).__name__})"
        finally:  # a directory the child filled is removed off this (the reader) thread
            self._files.remove(self._supervisor._chores.rmtree)
        self._result = ChildExit(
            exit_code=code,
            signal=sig,
            duration_seconds=max(0.0, ended_at - self.started_at),
            stdout_tail=stdout_tail,
            stderr_tail=stderr_tail,
            output=output,
            output_error=output_error,
            stdout_document=stdout_document,
            resources=self._usage[0],
            oom_kills=self._usage[1],
            memory_limit_by=self.memory_limit_by,
        )
        self._done.set()
        if self._on_done is not None:
            try:
                self._on_done(self._result)
            except Exception:  # the sink's bug must not be lost silently
                log.exception("on_done sink failed for task %s", self.key)


class _Start:
    """A spawn asked of the fork server and not answered yet."""

    __slots__ = ("argv0", "child", "notify", "on_started", "pipes", "record", "request_id", "sent_at")

    def __init__(
        self,
        child: Child,
        request_id: int,
        pipes: tuple[int, int],
        argv0: str,
        sent_at: float,
        notify: bool,
        on_started: StartedSink | None,
        record: leftovers.TreeRecord,
    ) -> None:
        self.child = child
        self.request_id = request_id
        self.pipes = pipes  # the read ends of stdout and stderr: the reader's once it runs
        self.argv0 = argv0
        self.sent_at = sent_at  # time.monotonic()
        self.notify = notify  # Supervisor.start: a failure goes to on_done (spawn raises it)
        self.on_started = on_started
        self.record = record  # by token only until the answer gives the pid


class _Chores:
    """A thread of the Supervisor's (started at the first chore) for what the reader thread must not
    wait for: removing a task directory the child filled (``shutil.rmtree`` of a million files takes
    as long as it takes) and killing a command whose start was given up (a send to the fork server,
    which blocks while its socket is full: were the reader waiting there, the fork server, itself
    blocked on its answers to us, would never drain it). ``urgent`` chores (the kills) go before any
    rmtree still waiting. Once closed, or while no thread can be started, a chore runs on the caller's
    thread (for a kill on the reader thread, that risk is taken: it needs the thread start to fail)."""

    def __init__(self) -> None:
        self._chores: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def rmtree(self, path: str) -> None:
        self.submit(lambda: shutil.rmtree(path, ignore_errors=True))

    def submit(self, chore: Callable[[], None], *, urgent: bool = False) -> None:
        with self._cond:
            inline = self._closed
            if not inline and self._thread is None:
                thread = threading.Thread(target=self._run, name="supervisor-chores", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # no thread to be had now: do it here (tried again next time)
                    inline = True
            if not inline:
                if urgent:
                    self._chores.appendleft(chore)
                else:
                    self._chores.append(chore)
                self._cond.notify()
        if inline:
            self._do(chore)

    def close(self, timeout_seconds: float) -> None:
        """Finish the chores handed over (bounded wait); later ones run on their caller's thread."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(timeout_seconds)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._chores and not self._closed:
                    self._cond.wait()
                if not self._chores:
                    return
                chore = self._chores.popleft()
            self._do(chore)

    @staticmethod
    def _do(chore: Callable[[], None]) -> None:
        try:
            chore()
        except Exception:  # a chore's failure must not end the thread that runs the next one
            log.exception("a supervisor chore failed")


class _ServerLink:
    """The fork server's socket, as the reader thread reads it."""

    __slots__ = ("buffer", "done", "on_eof", "on_event", "sock")

    def __init__(
        self, sock: socket.socket, on_event: Callable[[dict[str, Any]], None], on_eof: Callable[[], None]
    ) -> None:
        self.sock = sock
        self.buffer = bytearray()  # bytes of a message not complete yet
        self.on_event = on_event
        self.on_eof = on_eof
        self.done = threading.Event()  # set once on_eof has returned


class _OutputReader:
    """The one thread that reads every child's pipes and the fork server's messages (one selector),
    and finishes each child.

    One thread for both: a task's exit comes from the fork server and its end of output from its
    pipes, and its own thread for each made two thread switches (and a hand-off through a pipe) per
    task in a process where every switch contends for the GIL. Other threads only queue work for it
    (``watch_server``) and wake it through a pipe; a child's pipes are taken over here when
    its ``spawned`` reply is read (``add_here``: no wake-up per spawn). A child's pipes, captures and
    drain deadline, and the fork server's socket, are touched by this thread alone. It never blocks
    on anything but its selector: the fork server writes whole messages, and what has come of one is
    kept until the rest arrives.
    """

    def __init__(self, drain_seconds: float, housekeeping: Callable[[], float] | None = None) -> None:
        """``housekeeping()``: called on the thread now and then; returns the seconds until the next."""
        self._drain_seconds = drain_seconds
        self._housekeeping = housekeeping
        self._next_housekeeping = 0.0
        self._lock = threading.Lock()
        self._pending: list[Callable[[], None]] = []
        self._children: set[Child] = set()  # added and not yet finished
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ident: int | None = None  # the reader thread's, once it runs
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._selector.register(self._wake_r, selectors.EVENT_READ)

    def add_here(self, child: Child, out_r: int, err_r: int) -> None:
        """Read ``child``'s stdout/stderr pipes from now on (they are closed once it is finished).
        Called on the reader thread itself, when it reads the child's ``spawned`` reply: no wake-up."""
        assert threading.get_ident() == self._ident
        self._register(child, out_r, err_r)
        self._check_exit(child)

    def exited(self, child: Child) -> None:
        """``child`` exited: drain its pipes for at most the drain time, then finish it. Called on the
        reader thread itself (exits come in the fork server's messages, read there): at once."""
        assert threading.get_ident() == self._ident
        self._check_exit(child)

    def watch_server(
        self, sock: socket.socket, on_event: Callable[[dict[str, Any]], None], on_eof: Callable[[], None]
    ) -> threading.Event:
        """Read the fork server's messages on this thread from now on: ``on_event(message)`` for each,
        then ``on_eof()`` once, at the socket's end (or an unreadable message). Returns an Event set
        once ``on_eof`` has returned."""
        link = _ServerLink(sock, on_event, on_eof)

        def register() -> None:
            self._selector.register(sock.fileno(), selectors.EVENT_READ, link)

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
            self._selector.close()
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
            if self._housekeeping is not None and now >= self._next_housekeeping:
                try:
                    self._next_housekeeping = now + self._housekeeping()
                except Exception:  # as for queued work: the reader must go on
                    log.exception("the output reader's housekeeping failed; continuing")
                    self._next_housekeeping = now + 1.0
            deadlines = [c._drain_deadline for c in self._children if c._drain_deadline is not None]
            if self._housekeeping is not None:
                deadlines.append(self._next_housekeeping)
            for child in [
                c for c in self._children if c._drain_deadline is not None and c._drain_deadline <= now
            ]:
                self._finish(child)  # the child is gone; whoever still holds the pipe does not hold the task
            timeout = None if not deadlines else max(0.0, min(deadlines) - now)
            for key, _ in self._selector.select(timeout):
                if key.fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                if isinstance(key.data, _ServerLink):
                    self._read_server(key.data)
                    continue
                child = key.data
                try:
                    self._read(child, key.fd)
                except Exception:  # never let one child's trouble stop every other child's output
                    log.exception("reading the output of task %s failed", child.key)
                    self._close_fd(child, key.fd)
                    self._check_exit(child)

    def _register(self, child: Child, out_r: int, err_r: int) -> None:
        stdout, stderr = child._stdout_capture(), child._capture("stderr")
        child._captures = (stdout, stderr)
        child._fds = {}
        self._children.add(child)  # first: whatever fails below, its exit still finishes it
        for fd, capture in ((out_r, stdout), (err_r, stderr)):
            try:
                self._selector.register(fd, selectors.EVENT_READ, child)
                child._fds[fd] = capture
            except (OSError, ValueError, KeyError) as exc:  # e.g. out of epoll watches: that stream is lost
                log.error("task %s: cannot read its output (%s): it is dropped", child.key, exc)
                os.close(fd)

    def _read_server(self, link: _ServerLink) -> None:
        try:
            data = link.sock.recv(1 << 16)
            link.buffer += data
            messages = take_frames(link.buffer) if data else []
        except (OSError, ValueError) as exc:
            log.debug("the fork server's socket failed: %s", exc)
            data, messages = b"", []
        for message in messages:
            try:
                link.on_event(message)
            except Exception:  # a bug handling one message must not stop every child's output
                log.exception("handling a fork server message failed: %r", message)
        if data:
            return
        self._selector.unregister(link.sock.fileno())
        try:
            link.on_eof()
        except Exception:  # e.g. the state record unwritable: the reader must go on for the next server
            log.exception("handling the fork server's end failed")
        finally:
            link.done.set()

    def _read(self, child: Child, fd: int) -> None:
        data = os.read(fd, _READ_BYTES)
        if not data:
            self._close_fd(child, fd)
            self._check_exit(child)
            return
        child._fds[fd].feed(data)
        if len(data) >= 65536 and fd not in child._grown:  # a chatty child: a bigger pipe
            child._grown.add(fd)
            with contextlib.suppress(OSError):  # over the user's pipe quota: keep 64 KiB
                fcntl.fcntl(fd, _F_SETPIPE_SZ, _BIG_PIPE_BYTES)

    def _close_fd(self, child: Child, fd: int) -> None:
        if child._fds.pop(fd, None) is not None:
            self._selector.unregister(fd)
            os.close(fd)

    def _check_exit(self, child: Child) -> None:
        """Finish ``child`` once it exited and its pipes are at EOF; start its drain time at the exit."""
        if child not in self._children or not child._exited.is_set():
            return
        if not child._fds:
            self._finish(child)
        elif child._drain_deadline is None:
            child._drain_deadline = time.monotonic() + self._drain_seconds

    def _finish(self, child: Child) -> None:
        for fd in list(child._fds):
            self._close_fd(child, fd)
        self._children.discard(child)
        assert child._captures is not None
        stdout, stderr = child._captures
        stdout.close()
        stderr.close()
        try:
            document = stdout.document() if isinstance(stdout, StdoutDocument) else None
            child._finish(stdout.tail(), stderr.tail(), document)
        except Exception:  # the task's files: log it; the child is done either way
            log.exception("finishing task %s failed", child.key)


class Supervisor:
    """Starts the fork server and runs task commands through it.

    >>> with Supervisor(state_dir) as supervisor:          # doctest: +SKIP
    ...     supervisor.sweep_leftovers()
    ...     child = supervisor.spawn(task, CommandSpec(argv=("sample_tasks/sleeper.sh",)), worker_id="w1")
    ...     exit = child.wait()
    """

    def __init__(
        self,
        state_dir: Path | None = None,
        *,
        clock: Clock | None = None,
        environ: Mapping[str, str] | None = None,
        output_drain_seconds: float = 1.0,
        tmp_dir: str | None = None,
        protect_runner: bool = True,
        tree_meta: TreeMeta | None = None,
        cgroup_setup: cgroups.CgroupSetup | None = None,
    ) -> None:
        """``tree_meta(task, worker_id)``: a JSON object kept with each tree's record in the state
        directory (in the same one append per spawn), handed back by a later ``sweep_leftovers``
        if this runner dies holding the tree. Called on ``spawn``'s thread; must be cheap."""
        self._clock: Clock = clock or SystemClock()
        self._environ = dict(os.environ if environ is None else environ)
        self._state_dir = state_dir
        self._drain_seconds = output_drain_seconds
        self._tmp_dir = tmp_dir
        self._tree_meta = tree_meta
        # None: no cgroups (posix_spawn; limits as rlimits); else each tree gets a group of its own
        self._cgroups = cgroup_setup if cgroup_setup is not None else cgroups.CgroupSetup()
        self._children: dict[str, Child] = {}
        self._replies: dict[int, dict[str, Any]] = {}  # answers to _call, by request id
        self._calls: set[int] = set()  # request ids a _call waits for
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._paths: dict[tuple[str, str, str], tuple[str, float]] = {}  # see _executable
        self._inherited: dict[int, tuple[CommandSpec, dict[str, str]]] = {}  # see _inherited_env
        self._starting: dict[int, _Start] = {}  # spawns asked of the fork server, by request id
        # Spawns given up unanswered (the task failed): still queued at the fork server, so they count
        # against _MAX_STARTING, and a fork server lost before answering kills them by token too.
        self._given_up: dict[int, leftovers.TreeRecord] = {}
        self._late: dict[str, leftovers.TreeRecord] = {}  # given up, started late, killed: until gone
        self._closing = False
        self._lost = False
        self._start_lock = threading.Lock()
        _warn_if_not_linux()
        if protect_runner:
            protect_from_children()
        self._chores = _Chores()
        self._output = _OutputReader(output_drain_seconds, housekeeping=self._expire_starts)
        self._sock, self._process = self._start_forkserver()
        self._record = leftovers.StateRecord(state_dir, self._process.pid)
        self._server_done = self._output.watch_server(self._sock, self._dispatch, self._on_forkserver_lost)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def forkserver_pid(self) -> int:
        return self._process.pid

    @property
    def forkserver_up(self) -> bool:
        """The fork server runs (False once it died, until the next start makes a new one; a plain
        read, for the readiness probe)."""
        return not self._lost and not self._closing

    def forkserver_stats(self) -> dict[str, int]:
        """Counters of the fork server (diagnostics): ``walks`` of /proc so far, ``walked`` processes
        they read in all, ``waitids`` (exit checks), ``trees`` held now."""
        reply = self._call({"op": "stats"}, [])
        if reply.get("op") != "stats":
            raise ProcessError("the fork server is gone")
        return {key: int(reply[key]) for key in ("walks", "walked", "waitids", "trees")}

    def sweep_leftovers(self, on_orphans: leftovers.OrphanSink | None = None) -> set[int]:
        """Kill the trees recorded in the state directory by runners that died; return their pids.

        ``on_orphans(runner_pid, trees)``: each dead runner's ``TreeRecord``s (``meta`` as its
        ``tree_meta`` made them), once those trees are dead and before the record is deleted.
        """
        return set() if self._state_dir is None else leftovers.sweep(self._state_dir, on_orphans)

    def _inherited_env(self, spec: CommandSpec) -> dict[str, str]:
        """``inherited_env`` of our environment and ``spec``, kept per spec (a runner has one per task
        type): filtering every variable of the environment was a good part of a spawn's Python work."""
        known = self._inherited.get(id(spec))
        if known is not None and known[0] is spec:  # the same object, not one that took its id
            return known[1]
        env = inherited_env(self._environ, spec)
        if len(self._inherited) >= _CACHE_SIZE:
            self._inherited.clear()
        self._inherited[id(spec)] = (spec, env)
        return env

    def _executable(self, argv0: str, path_var: str, cwd: str) -> str:
        """``argv0`` resolved on ``path_var``, like a shell's hash: a PATH search is a stat per directory
        (a dozen for a typical PATH, per task), so a command found is reused for a few seconds, as long
        as it is still executable (one check). A command installed meanwhile in an earlier directory of
        PATH is picked up once that time is over."""
        if "/" in argv0:
            return _resolve_executable(argv0, path_var, cwd)
        key = (argv0, path_var, cwd)
        now = time.monotonic()  # real time: it bounds how stale a real directory listing may be
        known = self._paths.get(key)
        if known is not None and now - known[1] < _PATH_CACHE_SECONDS and os.access(known[0], os.X_OK):
            return known[0]
        path = _resolve_executable(argv0, path_var, cwd)
        if len(self._paths) >= _CACHE_SIZE:
            self._paths.clear()
        self._paths[key] = (path, now)
        return path

    def start(
        self,
        task: Task,
        spec: CommandSpec,
        *,
        worker_id: str,
        on_line: LineSink | None = None,
        on_lines: LinesSink | None = None,
        on_done: DoneSink | None = None,
        on_started: StartedSink | None = None,
    ) -> Child:
        """Ask the fork server to start ``spec``'s command for ``task``, and return without waiting
        for the exec: the caller's thread is free for the next task while the fork server starts
        this one (a spawn takes a few milliseconds, most of them in the exec; waiting for each made
        the runner's main thread the bottleneck of short tasks).

        SpawnError for what is known before asking (no such command on PATH, a missing working
        directory, no temp space or fds left). ``on_started(child)`` once the command runs, with
        ``child.pid`` set. A command that then cannot be exec'd, a spawn the fork server leaves
        unanswered for 30 s, or a fork server that dies first: ``on_done`` gets a ``ChildExit`` with
        ``start_error`` saying why (and ``on_started`` is never called). The child can be signalled
        at once: the fork server takes requests in order, so a signal sent now reaches the tree it
        is about to start. Callbacks run on the reader thread, as for ``spawn``.
        """
        return self._start(task, spec, worker_id, on_line, on_lines, on_done, on_started, notify=True)

    def spawn(
        self,
        task: Task,
        spec: CommandSpec,
        *,
        worker_id: str,
        on_line: LineSink | None = None,
        on_lines: LinesSink | None = None,
        on_done: DoneSink | None = None,
    ) -> Child:
        """Start ``spec``'s command for ``task``; SpawnError if it cannot be started.

        Returns once the child has exec'd its command (the fork server's posix_spawn returns then): an
        exec that fails (not executable, no ``#!``, a failed ``chdir``...) is a SpawnError saying why.
        (``start`` is the same without the wait.)

        ``on_line(stream, line)`` gets every stdout/stderr line ("stdout" | "stderr"), from the
        Supervisor's output thread (shared by every child): it must return quickly (queue the line),
        or every child blocks on a full pipe. Lines longer than 64 KiB arrive in pieces.
        ``on_lines(stream, lines)`` (instead) gets the complete lines of each read as one list: far
        cheaper for a chatty child. ``on_done(exit)`` is
        called once, from the output thread, when ``wait`` would return the exit: the caller needs no
        thread of its own per child to learn of it. None of them (nor ``start``'s ``on_started``) may
        call ``spawn`` or ``start``: that thread also reads the fork server's answers, which they may
        wait for.
        """
        child = self._start(task, spec, worker_id, on_line, on_lines, on_done, None, notify=False)
        if not child._settled.wait(_REPLY_TIMEOUT_SECONDS):
            self._give_up_starts(lambda pending: pending.child is child)
            child._settled.wait(_REPLY_TIMEOUT_SECONDS)  # given up above, or its answer is being handled
        if child._start_error is not None:
            raise child._start_error
        if not child._settled.is_set():  # the reader thread is stuck: never seen, but never a hang
            raise ProcessError("the fork server's answer to a spawn request was not handled")
        return child

    def _start(
        self,
        task: Task,
        spec: CommandSpec,
        worker_id: str,
        on_line: LineSink | None,
        on_lines: LinesSink | None,
        on_done: DoneSink | None,
        on_started: StartedSink | None,
        *,
        notify: bool,
    ) -> Child:
        argv = spec.command_argv()
        if any("\0" in arg for arg in argv):
            raise SpawnError("the command holds a NUL byte, which no argument can carry")
        self._ensure_forkserver()
        with self._cond:  # a bound on spawns queued at the fork server: claims follow the starts
            if not self._cond.wait_for(self._room_locked, timeout=_REPLY_TIMEOUT_SECONDS):
                behind = f"the fork server has not answered its last {_MAX_STARTING} spawn requests"
                raise ProcessError(behind)
        cwd = spec.cwd or os.getcwd()
        if not os.path.isabs(cwd):  # the fork server chdirs to it, from wherever it is (not normalised:
            cwd = os.path.join(os.getcwd(), cwd)  # "link/.." must mean what a chdir makes of it)
        if not os.path.isdir(cwd):
            raise SpawnError(f"working directory {cwd!r} does not exist")
        meta = None if self._tree_meta is None else self._tree_meta(task, worker_id)  # before any file
        token = secrets.token_hex(16)
        try:
            whole_task = task_json(task) if spec.protocol == STDIO else None  # conductor-cli's stdin
            owner = (spec.run_as.uid, spec.run_as.gid) if spec.run_as is not None else None
            files = TaskFiles.create(task, parent=self._tmp_dir, unique=token, stdin=whole_task,
                                     owner=owner)  # fmt: skip
        except OSError as exc:  # a full or unwritable temp dir fails this task, not the runner
            raise SpawnError(f"cannot make the task's files: {exc.strerror or exc}") from exc
        env = build_child_env(
            self._environ, spec, task, worker_id=worker_id, input_file=files.input_path,
            output_file=files.output_path, tree_token=token, inherited=self._inherited_env(spec),
        )  # fmt: skip
        try:
            path = self._executable(argv[0], env.get("PATH", os.defpath), cwd)
        except SpawnError:
            files.remove()
            raise
        key = f"t{next(self._ids)}"
        child = Child(self, key, files, on_line, self._clock, on_lines, on_done)
        child._stdout_is_document = spec.protocol == STDIO
        pipes: list[int] = []
        try:
            pipes.extend(os.pipe())
            pipes.extend(os.pipe())
        except OSError as exc:  # out of file descriptors: this task fails, the runner goes on
            for fd in pipes:
                os.close(fd)
            files.remove()
            raise SpawnError(f"cannot make the command's output pipes: {exc.strerror or exc}") from exc
        out_r, out_w, err_r, err_w = pipes
        try:
            group, rlimits = self._group_for(spec, token)
        except SpawnError:
            for fd in pipes:
                os.close(fd)
            files.remove()
            raise
        child.cgroup = group
        if spec.limits.memory_max is not None:
            child.memory_limit_by = "cgroup" if group and "memory" in self._cgroups.limits else "rlimit"
        request_id = next(self._ids)
        # Until its record is written, the tree is known by its marker token only: should the fork
        # server die right after the spawn (no parent-death signal any more), it is killed by that.
        # The pipes' read ends are ours until the reader thread takes them with the `spawned` answer.
        pending = _Start(child, request_id, (out_r, err_r), argv[0], time.monotonic(), notify, on_started,
                         leftovers.TreeRecord(key, 0, 0, token, files.directory, meta, group))  # fmt: skip
        with self._cond:
            self._children[key] = child
            self._starting[request_id] = pending
        request = {"op": "spawn", "id": request_id, "key": key, "path": path, "argv": argv, "env": env,
                   "cwd": cwd, "token": token, "grace": spec.kill_grace_seconds,
                   "dir": files.directory, "cgroup": group, "rlimits": rlimits}  # fmt: skip
        if group is not None and cgroups.spawns_inside(self._cgroups, spec.limits, self._process.pid):
            request["inside"] = True  # posix_spawn from inside the group (_cgroupfs.spawn_inside)
        if spec.run_as is not None:  # the fork server starts it as that user (forkexec.py)
            request["run_as"] = spec.run_as.wire()
        try:
            try:
                stdin = files.open_stdin()
            except OSError as exc:  # no fd left: this task fails, the runner goes on
                raise SpawnError(f"cannot open the task's input: {exc.strerror or exc}") from exc
            try:
                self._request(request, [stdin, out_w, err_w])  # the fork server holds its own copies now
            finally:
                os.close(stdin)
        except ProcessError:
            if self._drop_start(pending):
                raise
            # A lost fork server's handler took it first: it ends the child with start_error (and
            # on_done) just as an answer would; raising too would end the task twice.
        except BaseException:  # a bug (or MemoryError): nothing of this spawn may stay registered
            self._drop_start(pending)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return child

    def _group_for(
        self, spec: CommandSpec, token: str
    ) -> tuple[_cgroupfs.Group | None, list[tuple[str, int]]]:
        """The task's new group (None without cgroups) and the rlimits its command gets."""
        group = None
        if self._cgroups.active:
            group = cgroups.create_group(self._cgroups, token, spec.limits)  # SpawnError
        by_group = self._cgroups.limits if group is not None else frozenset()
        return group, rlimits_for(spec.limits, by_group)

    def _drop_start(self, pending: _Start) -> bool:
        """Undo a spawn whose request was never sent; False if someone else has ended it already."""
        with self._cond:
            if self._starting.pop(pending.request_id, None) is None:
                # Given up (or lost) while the send was under way: ended already. A request that
                # failed to go out will get no answer, so it holds no room either.
                if self._given_up.pop(pending.request_id, None) is not None:
                    self._cond.notify_all()
                return False
            self._cond.notify_all()  # room for a start waiting on _MAX_STARTING
        self._release(pending)
        return True

    def _fail_start(self, pending: _Start, error: ProcessError) -> None:
        """End a spawn taken out of ``_starting`` (by its caller, under the lock) that never ran."""
        try:
            self._release(pending)
        finally:
            pending.child._start_failed(error, pending.notify)

    def _release(self, pending: _Start) -> None:
        """What a spawn that never ran holds: its place among the children, its pipes' read ends
        (never taken by the reader) and the task's directory."""
        with self._cond:
            self._children.pop(pending.child.key, None)
        for fd in pending.pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        pending.child._files.remove(self._chores.rmtree)
        group, pending.child.cgroup = pending.child.cgroup, None
        if group is not None:  # a start given up may still run late: its group dies with it
            cgroups.remove_group(group, spare=self._process.pid)  # the fork server may be inside

    def _give_up_starts(self, which: Callable[[_Start], bool]) -> None:
        """Fail the spawns still unanswered that ``which`` picks; an answer that comes later kills it."""
        with self._cond:
            given_up = [pending for pending in self._starting.values() if which(pending)]
            for pending in given_up:
                del self._starting[pending.request_id]
                self._given_up[pending.request_id] = pending.record
        for pending in given_up:
            self._fail_start(pending, ProcessError("the fork server did not answer a spawn request"))

    def _expire_starts(self) -> float:
        """The reader thread's periodic check: spawns unanswered for too long fail (a hung fork
        server must not hold a task for ever). Returns when to be called again, in seconds."""
        limit = _REPLY_TIMEOUT_SECONDS
        now = time.monotonic()
        self._give_up_starts(lambda pending: now - pending.sent_at >= limit)
        with self._cond:  # idle: rarely (a start sent meanwhile is checked that much later)
            return min(1.0 if self._starting else 10.0, limit / 3)

    def _room_locked(self) -> bool:
        return len(self._starting) + len(self._given_up) < _MAX_STARTING or self._lost

    def close(self, grace_seconds: float = 0.0) -> None:
        """Kill every tree still held (TERM, KILL after ``grace_seconds``), stop the fork server."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        with contextlib.suppress(ProcessError):
            self._request({"op": "shutdown", "grace": grace_seconds})
        try:
            self._process.wait(timeout=grace_seconds + 15.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
            leftovers.kill_trees(self._record.trees(), leaders_just_died=True)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._server_done.wait(timeout=10.0)
        self._sock.close()
        for child in list(self._children.values()):
            child.wait(timeout=self._drain_seconds + 5.0)
        self._output.stop()
        self._chores.close(timeout_seconds=30.0)
        self._record.delete()

    # fork server plumbing -----------------------------------------------------------------------

    def _ensure_forkserver(self) -> None:
        """Start a new fork server if the last one died (its trees were killed already)."""
        with self._start_lock:
            with self._cond:
                if not self._lost:
                    return
                if self._closing:
                    raise ProcessError("the supervisor is closed")
            self._server_done.wait(timeout=30.0)  # what the old server held is killed once it is set
            with contextlib.suppress(OSError):
                self._process.kill()
            self._process.wait()
            sock, process = self._start_forkserver()
            with self._send_lock, self._cond:
                old, self._sock, self._process = self._sock, sock, process
                self._lost = False
                self._replies.clear()
            old.close()
            with self._cond:
                self._record.set_forkserver(process.pid)
            self._server_done = self._output.watch_server(sock, self._dispatch, self._on_forkserver_lost)
            log.warning("started a new fork server (pid %d) after the last one died", process.pid)

    def _start_forkserver(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(leasecore.__file__).resolve().parent.parent)
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, root, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                # Its own process group: a SIGKILL of the runner's group (kill -9 -PGID) leaves it to see
                # the runner die and kill every tree, instead of taking it along and leaving them all.
                process_group=0,
                env={},  # the fork server needs nothing from the runner's environment (credentials!)
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise ProcessError(f"could not start the fork server: {exc.strerror}") from exc
        finally:
            theirs.close()
        ours.settimeout(_REPLY_TIMEOUT_SECONDS)
        try:
            frame = recv_frame(ours)
        except (OSError, EOFError, ValueError) as exc:
            frame = None
            log.debug("fork server handshake failed: %s", exc)
        if frame is None or frame[0].get("op") != "ready":
            process.kill()
            process.wait()
            ours.close()
            raise ProcessError("the fork server did not start (see its error output above)")
        ours.settimeout(None)
        return ours, process

    def _request(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        try:
            with self._send_lock:
                send_frame(self._sock, message, fds)
        except OSError as exc:
            raise ProcessError("the fork server is gone") from exc

    def _call(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """A request whose answer the caller waits for (``stats``; the runner's spawns are answered
        through ``_on_answer`` without a wait)."""
        request_id = next(self._ids)
        message["id"] = request_id
        with self._cond:
            self._calls.add(request_id)
        try:
            self._request(message, fds)
            with self._cond:
                if not self._cond.wait_for(
                    lambda: request_id in self._replies or self._lost, timeout=_REPLY_TIMEOUT_SECONDS
                ):
                    raise ProcessError(f"the fork server did not answer a {message['op']} request")
                return self._replies.pop(request_id, {"op": "lost"})
        finally:
            with self._cond:
                self._calls.discard(request_id)

    def _dispatch(self, event: dict[str, Any]) -> None:
        op = event.get("op")
        if op in ("spawned", "spawn_failed", "stats"):
            self._on_answer(op, event)
            return
        with self._cond:
            child = self._children.get(str(event.get("key")))
            if child is None:
                if op == "gone":  # a late-started tree, killed: accounted for now
                    self._late.pop(str(event.get("key")), None)
                return
            if op == "gone":  # the record first: once wait_gone returns, the tree is accounted for
                self._children.pop(child.key, None)
                try:
                    self._record.remove(child.key)
                finally:  # an unwritable record must not leave wait_gone waiting for ever
                    child._on_gone()
        if op == "exited":  # outside the lock: on this (the reader) thread it may finish the child now
            child._on_exit(event.get("code"), event.get("signal"), event)

    def _on_answer(self, op: str, event: dict[str, Any]) -> None:
        """An answer, on the reader thread: to a ``_call``, or to a spawn, whose child now runs (its
        record is written, its pipes are read from now on) or never will."""
        key = str(event.get("key"))  # `spawned` only
        request_id = int(event.get("id") or 0)
        with self._cond:
            # None: given up already (the task was failed), and a command that started must not run
            pending = self._starting.pop(request_id, None)
            late = None if pending is not None else self._given_up.pop(request_id, None)
            if late is not None and op == "spawned":  # known by pid too now, until its tree is gone
                self._late[key] = dataclasses.replace(late, pid=int(event["pid"]),
                                                      start_time=int(event.get("start") or 0))  # fmt: skip
            if pending is not None or late is not None:
                self._cond.notify_all()  # room for a start waiting on _MAX_STARTING
            elif request_id in self._calls:
                self._replies[request_id] = event
                self._cond.notify_all()
                return
            if op == "stats":
                return
            if pending is not None and op == "spawned":
                child = pending.child
                child.pid = int(event["pid"])
                start_time = int(event.get("start") or 0)  # read by the fork server, which holds the pid
                record = dataclasses.replace(pending.record, pid=child.pid, start_time=start_time)
                try:
                    self._record.add(record)
                except OSError as exc:  # the tree runs on unrecorded: only a crash of ours would lose it
                    log.error("task %s: could not record its tree in the state directory: %s", child.key, exc)
        if pending is None:
            if op == "spawned":  # not from this thread: the send may block (see _Chores)
                log.warning("a task's command started after its spawn had been given up: killing it")
                self._chores.submit(lambda: self._kill_quietly(key), urgent=True)
            return
        if op != "spawned":
            self._fail_start(pending, SpawnError(_spawn_failure(pending.argv0, event)))
            return
        self._output.add_here(pending.child, *pending.pipes)
        pending.child._settled.set()
        if pending.on_started is not None:
            try:
                pending.on_started(pending.child)
            except Exception:  # the sink's bug must not be lost silently
                log.exception("on_started sink failed for task %s", pending.child.key)

    def _kill_quietly(self, key: str) -> None:
        with contextlib.suppress(ProcessError):
            self._request({"op": "signal", "key": key, "sig": signal.SIGKILL})

    def _on_forkserver_lost(self) -> None:
        # EOF: either close() ended it, or it died. Each tree is found by its leader (pid and start time:
        # re-parented, or just dead), session/group id and marker token, exactly as a sweep would.
        with self._cond:
            self._lost = True
            self._cond.notify_all()
            starting = list(self._starting.values())
            self._starting.clear()
            # The latter two by token only: maybe started, never answered.
            records = (self._record.trees() + [p.record for p in starting] + list(self._given_up.values())
                       + list(self._late.values()))  # fmt: skip
            self._given_up.clear()
            self._late.clear()
        if not self._closing:
            log.error("the fork server died; killing every task tree it held")
        # A leader that died a moment ago (its own exit) still names our processes by session/group id.
        leftovers.kill_trees(records, leaders_just_died=True)
        for pending in starting:  # maybe started, never answered: failed (killed by token above)
            lost = {"errno": 0, "what": "fork server lost"}
            self._fail_start(pending, SpawnError(_spawn_failure(pending.argv0, lost)))
        with self._cond:
            children = list(self._children.values())
            for child in children:
                child._on_exit(None, signal.SIGKILL)
                child._on_gone()
                self._record.remove(child.key)
            self._children.clear()

def _spawn_failure(argv0: str, reply: dict[str, Any]) -> str:
    errno_value = int(reply.get("errno") or 0)
    why = os.strerror(errno_value) if errno_value else "unknown error"
    if errno_value == errno.ENOEXEC:
        why += "; a script needs a #! line"
    what = {"cgroup": "joining its cgroup", "rlimit": "setting its rlimits"}.get(
        str(reply.get("what")), reply.get("what", "?"))
    return f"cannot start {argv0!r}: {why} (while doing {what})"


def _warn_if_not_linux() -> None:
    global _warned_not_linux
    if not _procfs.IS_LINUX and not _warned_not_linux:
        _warned_not_linux = True
        log.warning(
            "not Linux: task trees are killed by process group only; descendants that leave the group "
            "and children of a killed runner may survive"
        )
