"""``Child``: the runner's record of one task command, from its start request to its tree's end.

Owns one child's state: its pid once the fork server answers, its exit (code, signal, resources),
its tree's group, the events callers wait on (``wait``, ``wait_gone``) and the fields the output
reader keeps for it (open pipe ends, captures, drain deadline). It builds the ``ChildExit`` and
calls ``on_done``; it asks for signals through its Supervisor (``terminate_tree``, ``kill_tree``).
``PendingStart`` is what a spawn holds until the fork server answers it (pipes, tree record).

Must not touch: the fork server's socket (it sends through ``Supervisor._request``), the selector
(the reader registers and closes its pipes), other children, or the Supervisor's tables (the
Supervisor adds and removes children; a child only reports to it).

Threads: created on ``start``/``spawn``'s caller; ``wait``/``terminate_tree``/``kill_tree`` from any
thread; ``_on_exit``, ``_on_gone``, the captures and ``_finish`` (so ``on_line``, ``on_lines`` and
``on_done``) on the Supervisor's reader thread ("child-output"), ``_start_failed`` on the thread
that gives the start up. The attributes marked "the output thread" are that thread's alone.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from leasecore.clock import Clock
from leasecore.errors import ProcessError
from leasecore.masking import Masker
from leasecore.process.checkpoint import EMPTY as CHECKPOINT_EMPTY
from leasecore.process.checkpoint import NAME as CHECKPOINT_NAME
from leasecore.process.checkpoint import CheckpointRead, read_checkpoint_file
from leasecore.process.linux import cgroupfs, leftovers, procfs
from leasecore.process.results.stdio_protocol import StdoutDocument
from leasecore.process.spec import ChildExit
from leasecore.process.supervisor.output import StreamCapture
from leasecore.process.taskfiles import TaskFiles, plainly_empty

# one logger for the runner's side of process/
log = logging.getLogger("leasecore.process.supervisor.supervisor")

LineSink = Callable[[str, str], None]
LinesSink = Callable[[str, list[str]], None]  # (stream, the complete lines of one read)
DoneSink = Callable[[ChildExit], None]
StartedSink = Callable[["Child"], None]
_NUMBER = (int, float)  # (a tuple: ``int | float`` makes a union object at each isinstance, a task's cost)


@dataclass(frozen=True, eq=False)
class ChildLinks:
    """What a child needs of its Supervisor, handed in so that this module never imports it: send a
    request to the fork server, tell the reader thread the child exited, remove a directory off the
    reader thread."""

    request: Callable[[dict[str, Any]], None]
    exited: Callable[[Child], None]
    rmtree: Callable[[str], None]


class Latch:
    """A flag that is set once and never cleared, waited on as a ``threading.Event``; its lock and
    condition are made only when a thread waits before it is set. A child has four of these and
    the runner never waits on most of them: four Events cost ~10 µs per task to make.

    No lost wake-up, with or without a GIL: ``set`` writes the flag, then reads the event under the
    class lock; ``wait`` makes the event and reads the flag again under the same lock. Whichever of
    the two takes the lock second sees what the first wrote (a lock orders memory; two plain writes
    and reads would not, on a free-threaded Python). The lock is uncontended but for a first waiter."""

    __slots__ = ("_event", "_flag")
    _making = threading.Lock()  # one Event per latch; orders set's flag against wait's event

    def __init__(self) -> None:
        self._flag = False
        self._event: threading.Event | None = None

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        with Latch._making:
            event = self._event
        if event is not None:
            event.set()

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag or (timeout is not None and timeout <= 0):  # a look, not a wait: no Event made
            return self._flag  # (the runner asks wait_gone(0) of every exited task's tree)
        with Latch._making:
            if self._event is None:
                self._event = threading.Event()
            event = self._event
            if self.is_set():  # set meanwhile, before the event existed: nobody will set the event
                return True
        return event.wait(timeout)


class Child:
    """One task command: running, or, from ``Supervisor.start``, being started (``pid`` 0 until the
    fork server's answer; a kill sent meanwhile reaches the tree all the same). Created by
    ``Supervisor.spawn`` or ``Supervisor.start``."""

    def __init__(
        self,
        links: ChildLinks,
        key: str,
        files: TaskFiles,
        on_line: LineSink | None,
        clock: Clock,
        on_lines: LinesSink | None = None,
        on_done: DoneSink | None = None,
        masker: Masker | None = None,
    ) -> None:
        self.key = key
        self._masker = masker if masker else None  # secret values masked in the output (masking.py)
        self.pid = 0
        self.started_at = clock.monotonic()  # monotonic seconds (the Supervisor's clock)
        self._links = links
        self._files = files
        self._on_line = on_line
        self._on_lines = on_lines
        self._on_done = on_done
        self._clock = clock
        self._exit_info: tuple[int | None, int | None, float] | None = None
        self.cgroup: cgroupfs.Group | None = None  # the tree's group, from spawn until it is gone
        self.memory_limit_by: str | None = None  # "cgroup" | "rlimit" | None: what enforces memory_max
        self._usage: tuple[dict[str, float], int] = ({}, 0)  # resources and OOM kills, at the exit
        # Its fork server's dead-man's switch ended it, the runner being stalled (from the exit event).
        self.ended_by_switch = False
        self.switch_late_seconds: float | None = None  # how late after its point the switch acted
        self._exited = Latch()
        self._done = Latch()
        self._gone = Latch()
        self._settled = Latch()  # the fork server answered the spawn (or it was given up)
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
    def checkpoint_path(self) -> str:
        """The task's CONDUCTOR_CHECKPOINT_FILE (the runner watches it while the child runs)."""
        return self._files.checkpoint_path

    @property
    def exited(self) -> bool:
        return self._exited.is_set()

    def terminate_tree(self, grace_seconds: float | None = None, *, since: float | None = None) -> None:
        """TERM the whole tree; the fork server KILLs what is left after the grace (default: the spec's),
        counted from ``since`` (a ``time.monotonic()`` value: when the caller decided to stop the
        tree; the same clock in every process on Linux) or else from when it gets the request."""
        self._links.request(
            {"op": "signal", "key": self.key, "sig": signal.SIGTERM, "grace": grace_seconds, "since": since,
             "at": time.monotonic()}  # (sent at: a runner that signals in time was not stalled)
        )

    def kill_tree(self) -> None:
        """KILL the whole tree now (the group and every escapee)."""
        self._links.request({"op": "signal", "key": self.key, "sig": signal.SIGKILL, "at": time.monotonic()})

    # called on the reader thread, for the fork server's messages -----------------------------------

    def memory_bytes(self) -> int | None:
        """The tree's memory use now: from its group where it has one with memory accounting, else
        the direct child's resident set (None once it is gone)."""
        group = self.cgroup
        used = None if group is None else cgroupfs.memory_current(group)
        if used is None and self.pid and not self.exited:
            used = procfs.rss_bytes(self.pid)
        return used

    def _on_exit(self, code: int | None, sig: int | None, event: Mapping[str, Any] | None = None) -> None:
        if event is not None:
            raw = event.get("resources")
            usage = {}
            if isinstance(raw, dict):
                usage = {k: round(float(v), 3) for k, v in raw.items() if isinstance(v, _NUMBER)}
            if "max_rss_bytes" in usage:
                usage["max_rss_bytes"] = int(usage["max_rss_bytes"])
            self._usage = (usage, int(event.get("oom_kills") or 0))
            self.ended_by_switch = bool(event.get("switch"))
            late = event.get("switch_late")
            self.switch_late_seconds = float(late) if isinstance(late, _NUMBER) else None
        if self._exit_info is None:
            self._exit_info = (code, sig, self._clock.monotonic())
            self._exited.set()
            self._links.exited(self)

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
        mask = self._masker.stream() if self._masker is not None else None
        if batch is None:
            return StreamCapture(self._emitter(stream), mask=mask)

        def emit_lines(lines: list[str]) -> None:
            try:
                batch(stream, lines)
            except Exception:  # a broken sink must not stop the reader (the child would block)
                log.exception("on_lines sink failed for task %s", self.key)

        return StreamCapture(emit_lines=emit_lines, mask=mask)

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

    def _finish(
        self, stdout_tail: str, stderr_tail: str, stdout_document: bytes | None = None,
        stdout_bytes: int | None = None,
    ) -> None:
        assert self._exit_info is not None
        code, sig, ended_at = self._exit_info
        checkpoint: CheckpointRead | None = None
        try:
            try:
                output, output_error = self._files.read_output()
            except Exception as exc:  # a bug: the task still ends (FAILED), never left unfinished for ever
                log.exception("task %s: reading its output file failed", self.key)
                output = None
                why = type(exc).__name__
                output_error = f"CONDUCTOR_OUTPUT_FILE could not be read (internal error: {why})"
            if self._files.checkpoint_path:  # read before the directory goes (the runner keeps it)
                try:
                    path = self._files.checkpoint_path  # empty (most tasks): one lstat, no open
                    checkpoint = CHECKPOINT_EMPTY if plainly_empty(path) else read_checkpoint_file(path)
                except Exception as exc:  # a bug: the task still ends, with the checkpoint seen last
                    log.exception("task %s: reading its checkpoint file failed", self.key)
                    why = type(exc).__name__
                    checkpoint = CheckpointRead(error=f"{CHECKPOINT_NAME} could not be read ({why})")
        finally:  # a directory the child filled is removed off this (the reader) thread
            self._files.remove(self._links.rmtree)
        self._result = ChildExit(
            exit_code=code,
            signal=sig,
            duration_seconds=max(0.0, ended_at - self.started_at),
            stdout_tail=stdout_tail,
            stderr_tail=stderr_tail,
            output=output,
            output_error=output_error,
            stdout_document=stdout_document,
            stdout_bytes=stdout_bytes,
            resources=self._usage[0],
            oom_kills=self._usage[1],
            memory_limit_by=self.memory_limit_by,
            checkpoint=checkpoint,
        )
        self._done.set()
        if self._on_done is not None:
            try:
                self._on_done(self._result)
            except Exception:  # the sink's bug must not be lost silently
                log.exception("on_done sink failed for task %s", self.key)


class PendingStart:
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
