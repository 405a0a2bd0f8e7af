"""``Supervisor``: runs task commands through the fork server and owns what is under way.

Owns the children and their tree records (``running.RunningTrees``), the spawns asked of the fork
server and not answered yet (``inflight.StartsInFlight``: bounded by ``max_starting``; given up after
``reply_timeout_seconds``), what every spawn is prepared with (``prepare.SpawnPreparer``), and the
wiring of its parts: the fork server link (``forkserver_link.py``), the reader thread
(``reader.py``), the chores thread (``background.py``) and this process's hardening. It turns the
fork server's events into each ``Child``'s start, exit and end; if the fork server dies, its trees
are killed (``_on_forkserver_lost``) and the next start makes a new one.

Must not touch: pipes, captures, socket reads (the reader's), a tree's fate (the fork server's).

Threads: ``start``/``spawn`` on the caller's thread (the runner's main thread), ``close`` on the
closing one; ``_dispatch``, ``_on_answer``, ``_on_forkserver_lost`` and ``_expire_starts`` on the
reader thread; ``_kill_quietly`` on the chores thread. ``_cond`` guards the tables.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ProcessError, SpawnError
from leasecore.models import Task
from leasecore.process.linux import cgroups, leftovers
from leasecore.process.linux.hardening import protect_from_children, warn_if_not_linux
from leasecore.process.spec import STDIO, CommandSpec
from leasecore.process.supervisor import forkserver_link
from leasecore.process.supervisor.background import Chores
from leasecore.process.supervisor.caches import PATH_CACHE_SECONDS
from leasecore.process.supervisor.child import (
    Child,
    ChildLinks,
    DoneSink,
    LineSink,
    LinesSink,
    PendingStart,
    StartedSink,
)
from leasecore.process.supervisor.inflight import Answer, StartsInFlight, answer_meaning
from leasecore.process.supervisor.killby import KillByTimes
from leasecore.process.supervisor.prepare import SpawnPreparer, TreeMeta
from leasecore.process.supervisor.reader import OutputReader
from leasecore.process.supervisor.running import RunningTrees
from leasecore.process.taskfiles import TaskDirs

__all__ = ["Child", "DoneSink", "LineSink", "LinesSink", "StartedSink", "Supervisor", "TreeMeta"]

log = logging.getLogger(__name__)

MAX_STARTING = 32  # spawns sent to the fork server and not answered yet; start() waits beyond that


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
        reply_timeout_seconds: float = forkserver_link.REPLY_TIMEOUT_SECONDS,
        max_starting: int = MAX_STARTING,
        path_cache_seconds: float = PATH_CACHE_SECONDS,
        forkserver_boot: str = forkserver_link.FORKSERVER_BOOT,
    ) -> None:
        """``tree_meta(task, worker_id)``: a JSON object kept with each tree's record in the state
        directory (in the same one append per spawn), handed back by a later ``sweep_leftovers``
        if this runner dies holding the tree. Called on ``spawn``'s thread; must be cheap.

        ``reply_timeout_seconds``: how long the fork server may leave a handshake, a spawn or a
        ``stats`` call unanswered; ``max_starting``: how many spawns may wait for their answer before
        ``start`` waits; ``path_cache_seconds``: how long a command found on PATH is reused;
        ``forkserver_boot``: the Python source the fork server runs (tests prepend to it)."""
        self._clock: Clock = clock or SystemClock()
        environ = dict(os.environ if environ is None else environ)
        self._state_dir = state_dir
        self._drain_seconds = output_drain_seconds
        # None: no cgroups (posix_spawn; limits as rlimits); else each tree gets a group of its own
        self._cgroups = cgroup_setup if cgroup_setup is not None else cgroups.CgroupSetup()
        self._spawns = SpawnPreparer(environ, task_dirs=TaskDirs.pick(tmp_dir, environ),  # a tmpfs if usable
                                     cgroup_setup=self._cgroups, tree_meta=tree_meta,
                                     path_cache_seconds=path_cache_seconds)  # fmt: skip
        self._cond = threading.Condition()
        self._ids = itertools.count(1)
        self._reply_timeout_seconds = reply_timeout_seconds
        self._inflight = StartsInFlight(self._cond, max_starting)  # spawns asked, not answered yet
        self._closing = False
        self._lost = False
        self._start_lock = threading.Lock()
        warn_if_not_linux()
        if protect_runner:
            protect_from_children()
        self._chores = Chores()
        self._output = OutputReader(output_drain_seconds, housekeeping=self._expire_starts)
        self._child_links = ChildLinks(self._request, self._output.exited, self._chores.rmtree)
        self._link = forkserver_link.ForkServerLink(forkserver_boot, reply_timeout_seconds)
        self.kill_by = KillByTimes(self._request)  # each task's kill-by times, for its tree's switch
        self._trees = RunningTrees(self._cond, leftovers.StateRecord(state_dir, self._link.pid), self.kill_by)
        self._server_done = self._output.watch_server(self._link.sock, self._dispatch,
                                                      self._on_forkserver_lost, self._trees.batch)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def task_dirs(self) -> TaskDirs:
        """Where the tasks' private directories are made (``taskfiles.TaskDirs``)."""
        return self._spawns.task_dirs

    @property
    def forkserver_pid(self) -> int:
        return self._link.pid

    @property
    def forkserver_up(self) -> bool:
        """The fork server runs (False once it died, until the next start makes a new one; a plain
        read, for the readiness probe)."""
        return not self._lost and not self._closing

    def forkserver_stats(self) -> dict[str, int]:
        """The fork server's counters (diagnostics): ``walks`` of /proc, ``walked`` processes, ``waitids``,
        ``trees`` held now; its v1 groups (GroupPool): ``groups_made``, ``groups_reused``, ``groups_free``."""
        reply = self._call({"op": "stats"}, [])
        if reply.get("op") != "stats":
            raise ProcessError("the fork server is gone")
        return {key: int(value) for key, value in reply.items() if key not in ("op", "id")}

    def sweep_leftovers(self, on_orphans: leftovers.OrphanSink | None = None) -> set[int]:
        """Kill the trees recorded in the state directory by runners that died; return their pids.

        ``on_orphans(runner_pid, trees)``: each dead runner's ``TreeRecord``s (``meta`` as its
        ``tree_meta`` made them), once those trees are dead and before the record is deleted."""
        killed = set() if self._state_dir is None else leftovers.sweep(self._state_dir, on_orphans)
        cgroups.remove_empty_groups(self._cgroups, own=False)  # a dead runner's free groups (GroupPool)
        return killed

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
        deadline: float | None = None,
    ) -> Child:
        """Ask the fork server to start ``spec``'s command for ``task``, and return without waiting
        for the exec: the caller's thread is free for the next task while the fork server starts
        this one (a spawn takes a few milliseconds, most of them in the exec).

        SpawnError for what is known before asking (no such command on PATH, a missing working
        directory, no temp space or fds left). ``on_started(child)`` once the command runs, with
        ``child.pid`` set. A command that then cannot be exec'd, a spawn the fork server leaves
        unanswered for ``reply_timeout_seconds``, or a fork server that dies first: ``on_done`` gets
        a ``ChildExit`` with ``start_error`` saying why (and ``on_started`` is never called). The child
        can be signalled at once: the fork server takes requests in order, so a signal sent now
        reaches the tree it is about to start. Callbacks run on the reader thread, as for ``spawn``.
        ``deadline``: the child's CONDUCTOR_DEADLINE (epoch seconds; None: not set).
        """
        return self._start(task, spec, worker_id, on_line, on_lines, on_done, on_started, deadline,
                           notify=True)

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
        cheaper for a chatty child. ``on_done(exit)`` is called once, from the output thread, when
        ``wait`` would return the exit: the caller needs no thread of its own per child to learn of it.
        None of them (nor ``start``'s ``on_started``) may call ``spawn`` or ``start``: that thread
        also reads the fork server's answers, which they may wait for.
        """
        child = self._start(task, spec, worker_id, on_line, on_lines, on_done, None, None, notify=False)
        if not child._settled.wait(self._reply_timeout_seconds):
            self._give_up_starts(lambda pending: pending.child is child)
            child._settled.wait(self._reply_timeout_seconds)  # given up above, or its answer is being handled
        if child._start_error is not None:
            raise child._start_error
        if not child._settled.is_set():  # the reader thread is stuck: never seen, but never a hang
            raise ProcessError("the fork server's answer to a spawn request was not handled")
        return child

    def _start(
        self, task: Task, spec: CommandSpec, worker_id: str, on_line: LineSink | None,
        on_lines: LinesSink | None, on_done: DoneSink | None, on_started: StartedSink | None,
        deadline: float | None, *, notify: bool,
    ) -> Child:  # fmt: skip
        argv = spec.command_argv()
        if any("\0" in arg for arg in argv):
            raise SpawnError("the command holds a NUL byte, which no argument can carry")
        self._ensure_forkserver()
        with self._cond:  # a bound on spawns queued at the fork server: claims follow the starts
            if not self._cond.wait_for(self._room_locked, timeout=self._reply_timeout_seconds):
                behind = self._inflight.max_starting
                raise ProcessError(f"the fork server has not answered its last {behind} spawn requests")
        ready = self._spawns.prepare(task, spec, argv, worker_id=worker_id, deadline=deadline)
        files, group, (out_r, out_w, err_r, err_w) = ready.files, ready.group, ready.pipes
        key = f"t{next(self._ids)}"
        child = Child(self._child_links, key, files, on_line, self._clock, on_lines, on_done, spec.masker)
        child._stdout_is_document = spec.protocol == STDIO
        child.cgroup = group
        if spec.limits.memory_max is not None:
            child.memory_limit_by = "cgroup" if group and "memory" in self._cgroups.limits else "rlimit"
        request_id = next(self._ids)
        # Until its record is written, the tree is known by its marker token only: should the fork
        # server die right after the spawn (no parent-death signal any more), it is killed by that.
        # The pipes' read ends are ours until the reader thread takes them with the `spawned` answer.
        record = leftovers.TreeRecord(key, 0, 0, ready.token, files.directory, ready.meta, group)
        pending = PendingStart(child, request_id, (out_r, err_r), argv[0], time.monotonic(), notify,
                               on_started, record)  # fmt: skip
        with self._cond:
            self._trees.add(child)
            self._inflight.add(pending)
        request = ready.message(request_id, key, argv, spec)
        request["kill_by"] = sent_kill_by = self.kill_by.spawning(task.task_id)  # its dead-man's switch
        if group is not None and cgroups.spawns_inside(self._cgroups, spec.limits, self._link.pid):
            request["inside"] = True  # posix_spawn from inside the group (cgroupfs.spawn_inside)
        try:
            try:
                stdin = files.open_stdin()
            except OSError as exc:  # no fd left: this task fails, the runner goes on
                raise SpawnError(f"cannot open the task's input: {exc.strerror or exc}") from exc
            try:
                self._request(request, [stdin, out_w, err_w], base=ready.base)  # (it has its own fds now)
            finally:
                os.close(stdin)
            self.kill_by.attach(task.task_id, key, sent_kill_by)
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

    def _drop_start(self, pending: PendingStart) -> bool:
        """Undo a spawn whose request was never sent; False if someone else has ended it already."""
        if not self._inflight.drop(pending):  # given up (or lost) while the send was under way
            return False
        self._release(pending)
        return True

    def _fail_start(self, pending: PendingStart, error: ProcessError) -> None:
        """End a spawn taken out of ``_starting`` (by its caller, under the lock) that never ran."""
        try:
            self._release(pending)
        finally:
            pending.child._start_failed(error, pending.notify)

    def _release(self, pending: PendingStart) -> None:
        """What a spawn that never ran holds: its place among the children, its pipes' read ends
        (never taken by the reader) and the task's directory."""
        self._trees.discard(pending.child.key)
        for fd in pending.pipes:
            with contextlib.suppress(OSError):
                os.close(fd)
        pending.child._files.remove(self._chores.rmtree)
        group, pending.child.cgroup = pending.child.cgroup, None
        if group is not None:  # a start given up may still run late: its group dies with it
            cgroups.remove_group(group, spare=self._link.pid)  # the fork server may be inside

    def _give_up_starts(self, which: Callable[[PendingStart], bool]) -> None:
        """Fail the unanswered spawns ``which`` picks; an answer that comes later kills the tree."""
        for pending in self._inflight.give_up(which):
            self._fail_start(pending, ProcessError("the fork server did not answer a spawn request"))

    def _expire_starts(self) -> float:
        """The reader's periodic check: spawns unanswered too long fail; returns when to call again."""
        limit = self._reply_timeout_seconds
        now = time.monotonic()
        self._give_up_starts(lambda pending: now - pending.sent_at >= limit)
        # idle: rarely (a start sent meanwhile is checked that much later)
        return min(1.0 if len(self._inflight) else 10.0, limit / 3)

    def _room_locked(self) -> bool:
        return self._lost or self._inflight.has_room()

    def close(self, grace_seconds: float = 0.0) -> None:
        """Kill every tree still held (TERM, KILL after ``grace_seconds``), stop the fork server."""
        with self._cond:
            if self._closing:
                return
            self._closing = True
        self.kill_by.close()
        with contextlib.suppress(ProcessError):
            self._request({"op": "shutdown", "grace": grace_seconds})
        if not self._link.wait_exit(grace_seconds + 15.0):
            leftovers.kill_trees(self._trees.trees(), leaders_just_died=True)
        self._link.shutdown()
        self._server_done.wait(timeout=10.0)
        self._link.close()
        for child in self._trees.children():
            child.wait(timeout=self._drain_seconds + 5.0)
        self._output.stop()
        self._chores.close(timeout_seconds=30.0)
        self._trees.record.delete()

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
            self._link.restart(on_swap=self._forkserver_back)
            with self._cond:
                self._trees.record.set_forkserver(self._link.pid)
            self._server_done = self._output.watch_server(self._link.sock, self._dispatch,
                                                          self._on_forkserver_lost, self._trees.batch)
            log.warning("started a new fork server (pid %d) after the last one died", self._link.pid)

    def _forkserver_back(self) -> None:
        """A new fork server took the lost one's place (called with the link's send lock held)."""
        with self._cond:
            self._lost = False

    def _request(self, message: dict[str, Any], fds: list[int] | None = None, *,
                 base: dict[str, str] | None = None) -> None:  # base: a spawn's (link.send_spawn)
        self._link.send(message, fds) if base is None else self._link.send_spawn(message, fds or [], base)

    def _call(self, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """A request whose answer the caller waits for (``stats``; the runner's spawns are answered
        through ``_on_answer`` without a wait)."""
        return self._link.call(next(self._ids), message, fds, self._reply_timeout_seconds)

    def _dispatch(self, event: dict[str, Any]) -> None:
        op = event.get("op")
        if op in ("spawned", "spawn_failed", "stats"):
            self._on_answer(op, event)
            return
        with self._cond:
            child = self._trees.get(str(event.get("key")))
            if child is None:
                if op == "gone":  # a late-started tree, killed: accounted for now
                    self._inflight.gone(str(event.get("key")))
                return
            if op == "gone":  # the record first: once wait_gone returns, the tree is accounted for
                self._trees.gone(child)
        if op == "exited":  # outside the lock: on this (the reader) thread it may finish the child now
            child._on_exit(event.get("code"), event.get("signal"), event)

    def _on_answer(self, op: str, event: dict[str, Any]) -> None:
        """An answer, on the reader thread: to a ``_call``, or to a spawn, whose child now runs (its
        record is written, its pipes are read from now on) or never will."""
        key = str(event.get("key"))  # `spawned` only
        request_id = int(event.get("id") or 0)
        with self._cond:
            # None: given up already (the task was failed), and a command that started must not run
            pending, given_up = self._inflight.answered(request_id, op, event)
            call = pending is None and not given_up and self._link.answered(request_id, event)
            meaning = answer_meaning(op, in_flight=pending is not None, given_up=given_up, call_answer=call)
            if meaning is Answer.STARTED and pending is not None:
                self._trees.started(pending, event)  # its record written, under the same lock
        if meaning is Answer.KILL_LATE:  # not from this thread: the send may block (see background.py)
            log.warning("a task's command started after its spawn had been given up: killing it")
            self._chores.submit(lambda: self._kill_quietly(key), urgent=True)
        elif meaning is Answer.FAILED and pending is not None:
            self._fail_start(pending, SpawnError(forkserver_link.spawn_failure(pending.argv0, event)))
        elif meaning is Answer.STARTED and pending is not None:
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
            self._link.lost()
            self._cond.notify_all()
            starting, unseen = self._inflight.take_all()  # by token only: maybe started, never answered
            records = self._trees.trees() + unseen
        if not self._closing:
            log.error("the fork server died; killing every task tree it held")
        # A leader that died a moment ago (its own exit) still names our processes by session/group id.
        leftovers.kill_trees(records, leaders_just_died=True)
        if not self._closing:  # its free groups (GroupPool), before a new fork server makes any
            cgroups.remove_empty_groups(self._cgroups, own=True)
        for pending in starting:  # maybe started, never answered: failed (killed by token above)
            lost = {"errno": 0, "what": "fork server lost"}
            self._fail_start(pending, SpawnError(forkserver_link.spawn_failure(pending.argv0, lost)))
        self._trees.all_killed()
