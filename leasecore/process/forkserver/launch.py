"""How the fork server starts a task's tree: on its own thread or on a spawner thread (``spawners.py``).

Owns ``Launcher``, handed the fork server's tree table and what a held tree needs (its exit watched,
``exits.Exits``; its dead-man's switch armed, ``switches.Switches``), from a ``spawn`` request to a held
tree: ``spawn`` (answer it; the request's fds closed before the answer), ``_start_tree`` (a pooled
v1 group, ``GroupPool``), ``_exec_tree`` (``posix_spawn``, from inside the group when it has no
limits, ``cgroupfs.spawn_inside``, a v1 group joined by this thread alone through its ``tasks`` files;
else ``forkexec.py`` for a cgroup, rlimits or ``run_as``), ``_hold`` (the ``Tree`` held and its exit
watched), and the starts on spawner threads.

Why spawner threads: glibc's ``posix_spawn`` returns once its vfork child has reached the exec, and
``os.posix_spawn`` keeps the GIL meanwhile; beside a busy process that child waited 2.8 ms on average
for a core, and every slot's start, exit and kill queued behind it (docs/benchmarks.md). While that
wait on the main thread, smoothed over ~20 starts (``_exec_wait``; while the threads are on, every
16th start is made on the main thread to measure it again), is above ``_THREADS_ABOVE_SECONDS``
(1 ms; 0.1-0.5 ms on an idle host, where the threads' hand-offs would cost more than they save),
``to_spawner`` hands a request to a spawner thread when one can take it (glibc, /proc ``children``
files, no rlimits, no ``run_as``; no group, or a v1 group that the spawner thread alone joins through
the v1 ``tasks`` files), with its pooled group already taken. The thread's job (``_spawn_on_thread``)
makes only the start's system calls, without ``turn``: the joins, libc's ``posix_spawn`` (the GIL
released by ctypes), the moves back; then it holds and answers the tree itself if the loop is asleep
(``turn`` free), or leaves it in ``_done`` for the loop (``collect``), which it wakes. Until its tree
is held the start is in the table's ``inflight``: a signal asked for it waits in ``_early``
(``keep_early``) and applies the moment the tree is held (``_held``), as does a close begun
meanwhile, and the fork server does not end while a start is in flight.

Must not touch: anything of the fork server without ``turn`` held (a spawner thread's job touches only
its ``_Start`` until it holds ``turn``); signals (``kills.py``). Threads: the fork server's main one
and its spawners.
"""

from __future__ import annotations

import _thread
import collections
import errno
import os
import signal
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leasecore.process.forkserver.trees import Tree, TreeTable
from leasecore.process.linux import cgroupfs, procfs

if TYPE_CHECKING:
    from leasecore.process.forkserver.exits import Exits
    from leasecore.process.forkserver.frames import FrameBatch
    from leasecore.process.forkserver.grouppool import GroupPool
    from leasecore.process.forkserver.spawners import Attributes, Spawners
    from leasecore.process.forkserver.switches import Switches

_SPAWNER_THREADS = 4  # starts waiting for their exec at once; more queue for a free thread
_EARLY_SIGNALS_MAX = 16  # signal requests kept for one start still on its thread
# Starts go to spawner threads while posix_spawn's wait for the exec averages more than this: on an
# idle host it is 0.1-0.5 ms, and there the threads' hand-offs cost CPU (~0.5 ms a task, ours and the
# runner's) and saved no time; beside a busy process it was 2-3 ms. (Smoothed over ~20 starts.)
_THREADS_ABOVE_SECONDS = 0.001
_WAIT_SMOOTHING = 0.05
# Only a wait measured on the main thread counts (a spawner thread's wait is its own: four of them at
# once on two cores made the child wait for a core behind them, which kept the threads on once the
# host was idle again); while the threads are on, every this-many-th start is made on the main thread
# to measure it (0: never).
_PROBE_EVERY = 16


class Launcher:
    """Starts the trees of ``table``; see the module docstring."""

    def __init__(
        self, table: TreeTable, groups: GroupPool, exits: Exits, switches: Switches,
        answers: FrameBatch, reply: Callable[[dict[str, Any]], None],
        apply_signal: Callable[[dict[str, Any]], bool], wake: Callable[[], None], *,
        sigdef: list[int], children_files: bool,
    ) -> None:  # fmt: skip
        self._table = table
        self._groups = groups
        self._exits = exits
        self._switches = switches
        self._answers = answers  # flushed by a spawner thread that answers its own start
        self._reply = reply
        self._apply_signal = apply_signal  # a signal request for a held tree (``kills.Killer.signal``)
        self._wake = wake  # wakes the loop to ``collect`` what a spawner thread did
        self._sigdef = sigdef  # the signals the children get back at default (filled in when the loop runs)
        self._has_children_files = children_files
        # Every turn of the loop holds ``turn`` (but for its select): the fork server's state is the
        # loop's; a spawner thread touches only its own ``_Start`` and hands it over through ``_done``.
        self.turn = _thread.RLock()
        self.spawners: Spawners | None = None  # made at the first start they can take
        self._spawn_attributes: Attributes | None = None
        self._spawners_off = False  # none here (not glibc, no children files)
        self._early: dict[str, list[dict[str, Any]]] = {}  # signal requests for starts in flight
        self._exec_wait = 0.0  # posix_spawn's wait for the exec on the main thread, smoothed (seconds)
        self._since_probe = 0  # starts handed to spawner threads since the main thread's last
        self._handed: list[Callable[[], None]] = []  # this turn's starts for spawner threads (hand_over)
        self._done: collections.deque[_Start] = collections.deque()  # their finished starts (collect)
        self.start_times = procfs.StartTimes()  # a posix_spawned leader's start time, mostly unread

    def spawn(self, req: dict[str, Any], fds: list[int]) -> None:
        """Start one tree. Its fds (input, stdout, stderr) are closed here before the answer goes out
        (and the list emptied for the caller), so once a spawn is answered the fork server holds
        nothing of it: the runner alone keeps the pipes' read ends."""
        try:
            reply = self._start_tree(req, fds)
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
        self._reply(reply)

    def _start_tree(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        if len(fds) != 3:  # fds lost in transit (our fd limit): never let the child inherit ours
            return {"op": "spawn_failed", "id": req["id"], "errno": errno.EMFILE, "what": "receive fds"}
        group = req.get("cgroup")
        if group and group.get("pool"):  # a reused group, or a new one made here (GroupPool)
            return self._groups.start(req, lambda: self._exec_tree(req, fds))
        return self._exec_tree(req, fds)

    def _exec_tree(self, req: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        step = "chdir"
        bracket: list[int] = []  # the boot clock just before and after a posix_spawn: its start time
        try:
            # A group with no limits is joined by posix_spawn from inside it (cgroupfs.spawn_inside).
            inside = bool(req.get("inside")) and cgroupfs.can_spawn_inside()
            if (req.get("cgroup") and not inside) or req.get("rlimits") or req.get("run_as"):
                from leasecore.process.forkserver.forkexec import fork_exec  # set up in the child

                step = "fork"
                pid = fork_exec(req, fds, self._sigdef)
            else:
                if req.get("cwd"):  # (a spawner thread's start: a file action, spawners.spawn)
                    os.chdir(req["cwd"])
                step = "exec"
                pid = self._posix_spawn(req, fds, req.get("cgroup") if inside else None, bracket)
        except Exception as exc:  # OSError; ValueError (a NUL byte), TypeError: a bad request never ends us
            return _failed(req, exc, step)
        return self._hold(req, pid, bracket)

    def _hold(self, req: dict[str, Any], pid: int, bracket: list[int]) -> dict[str, Any]:
        """The tree of a started leader held (its exit watched, its switch armed); its answer."""
        if bracket:
            start = self.start_times.of(pid, *bracket)
        else:
            info = procfs.read_stat(pid)
            start = info.start_time if info else 0
        tree = Tree(req["key"], pid, req["token"], float(req["grace"]), start)
        tree.directory = str(req.get("dir") or "")
        tree.cgroup = req.get("cgroup") or None
        self._table.trees[tree.key] = tree
        self._switches.arm(tree, req)  # its kill-by time, if its lease has a deadline
        self._exits.watch(tree)
        self._held(tree)
        return {"op": "spawned", "id": req["id"], "key": tree.key, "pid": pid, "start": tree.start_time}

    def _posix_spawn(
        self, req: dict[str, Any], fds: list[int], group: dict[str, Any] | None, bracket: list[int]
    ) -> int:
        def spawn() -> int:
            started = procfs.boot_clock_ns()
            try:
                return os.posix_spawn(
                    req["path"], req["argv"], req["env"],
                    file_actions=[(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)],
                    setsid=True, setsigdef=self._sigdef, setsigmask=(),
                )  # fmt: skip
            finally:
                bracket[:] = started, procfs.boot_clock_ns()
                self._waited((bracket[1] - started) / 1e9)
                self._since_probe = 0

        # A v1 group is joined by this thread alone (its ``tasks`` files), as a spawner thread joins
        # one: a spawner's joins and start run without the fork server's lock, and a whole-process
        # move (``cgroup.procs``) here would carry it along into this start's group.
        return spawn() if group is None else cgroupfs.spawn_inside(group, spawn, thread=group.get("v") == 1)

    def _waited(self, seconds: float) -> None:
        self._exec_wait += _WAIT_SMOOTHING * (seconds - self._exec_wait)

    def to_spawner(self, req: dict[str, Any], fds: list[int]) -> bool:
        """Hand ``req`` to a spawner thread (its tree held and answered by ``collect`` once the thread
        is done with it); False: start it here, as before."""
        if self._exec_wait <= _THREADS_ABOVE_SECONDS:
            return False
        if _PROBE_EVERY and self._since_probe >= _PROBE_EVERY - 1:
            return False  # this one on the main thread: a fresh measure of the wait (_posix_spawn)
        group = req.get("cgroup")
        if req.get("rlimits") or req.get("run_as") or len(fds) != 3:
            return False
        if group and not (group.get("v") == 1 and req.get("inside") and cgroupfs.can_spawn_inside()):
            return False  # a v2 group is joined by the whole process: not from a thread
        if self.spawners is None:
            if self._spawners_off:
                return False
            from leasecore.process.forkserver import spawners  # only now: ctypes and threads

            if not (self._has_children_files and spawners.usable()):
                self._spawners_off = True
                return False
            self._spawn_attributes = spawners.Attributes(self._sigdef)
            self.spawners = spawners.Spawners(_SPAWNER_THREADS)
        if not self.spawners.reserve():
            return False
        start = _Start(req, fds, group)
        if group and group.get("pool"):  # a reused group, or a new one made here (GroupPool)
            try:
                start.group, start.reused = self._groups.take(group)
                start.pooled = True
                req["cgroup"] = start.group  # as GroupPool.start: the tree's group is the one taken
            except OSError as exc:  # answered by ``collect``; the thread it reserved does nothing
                start.error = _failed(req, exc, "cgroup")
        self._table.inflight[str(req.get("key"))] = str(req.get("dir") or "")
        self._handed.append(lambda: self._spawn_on_thread(start))
        self._since_probe += 1
        return True

    def hand_over(self) -> None:
        """Queue the starts this turn took for their spawner threads. Called by the loop (main thread)
        once its turn has let go of ``turn``."""
        handed, self._handed = self._handed, []
        if self.spawners is not None:  # (None: nothing was handed)
            for job in handed:
                self.spawners.put(job)

    def _spawn_on_thread(self, start: _Start) -> None:
        """The job, on a spawner thread: only the start's system calls (the group's joins through its
        ``tasks`` files, libc's ``posix_spawn`` without the GIL, the moves back), without ``turn`` and
        without touching the fork server's state; then its tree is held and answered here if ``turn``
        is free, else by the loop (``collect``), woken by ``wake``. The whole start made here under
        ``turn``, released for the libc call and taken back after it, cost the fork server ~0.3 ms of
        CPU a task more than a start on its main thread: the lock and the GIL handed back and forth."""
        if start.error is None:
            group = start.group
            try:
                if group is None:
                    start.pid = self._spawn_unlocked(start)
                else:
                    start.pid = cgroupfs.spawn_inside(group, lambda: self._spawn_unlocked(start), thread=True)
            except Exception as exc:  # OSError; ValueError (a NUL byte): answered by ``collect``
                start.error = _failed(start.req, exc, "exec")
        # Its tree held and answered here when the loop is asleep in its select (``turn`` free): no
        # wake-up of the loop per start. Else (or a failed start, which may start again on the loop's
        # thread) the loop collects it, woken.
        if start.error is None and self.turn.acquire(False):
            try:
                self._collect(start)
                self._answers.flush()  # the runner waits for this answer
                wake = bool(self._table.pending or self._answers.waiting)  # signals it waited for; no room
            finally:
                self.turn.release()
            if not wake:
                return
        else:
            self._done.append(start)
        self._wake()

    def _spawn_unlocked(self, start: _Start) -> int:
        """libc's ``posix_spawn`` of ``start`` (the GIL released by ctypes for the call), its boot-clock
        bracket kept for its start time."""
        from leasecore.process.forkserver import spawners

        assert self._spawn_attributes is not None
        req = start.req
        started = procfs.boot_clock_ns()
        try:
            return spawners.spawn(self._spawn_attributes, req["path"], req["argv"], req["env"], start.fds,
                                  req.get("cwd"))  # fmt: skip
        except OSError as exc:
            cwd = req.get("cwd")
            if cwd and not os.path.isdir(cwd):
                exc.step = "chdir"  # type: ignore[attr-defined]  # named as a start here names it
            raise
        finally:
            start.bracket[:] = started, procfs.boot_clock_ns()

    def collect(self) -> None:
        """The loop, with ``turn`` held: hold and answer every start a spawner thread has finished, as
        a start on this thread would have been (its fds closed before its answer)."""
        while self._done:
            self._collect(self._done.popleft())

    def _collect(self, start: _Start) -> None:
        req, fds = start.req, start.fds
        key = str(req.get("key"))
        try:
            reply = self._finish(start)
        except Exception as exc:  # as the loop's: that task fails, the fork server goes on
            reply = {"op": "spawn_failed", "id": req.get("id"), "errno": getattr(exc, "errno", 0) or 0,
                     "what": "fork"}  # fmt: skip
        finally:
            for fd in fds:
                os.close(fd)
            fds.clear()
            self._table.inflight.pop(key, None)
            self._early.pop(key, None)  # applied if its tree is held; moot if it never started
            self._switches.forget(key)  # its early renewal likewise
        self._reply(reply)

    def _finish(self, start: _Start) -> dict[str, Any]:
        req = start.req
        if start.error is None:
            reply = self._hold(req, start.pid, start.bracket)
            return {**reply, "cgroup": start.group} if start.pooled else reply
        if not start.pooled or start.group is None:
            return start.error
        cgroupfs.remove(start.group)  # as GroupPool.start: a group it could not start in goes
        if start.reused and start.error.get("what") == "cgroup":  # removed meanwhile: once more, here
            req["cgroup"] = start.request
            return self._start_tree(req, start.fds)
        return start.error

    def keep_early(self, req: dict[str, Any]) -> None:
        """A signal for a tree not held: kept if its start is on a spawner thread, else moot."""
        key = str(req.get("key"))
        if key not in self._table.inflight:
            return
        early = self._early.setdefault(key, [])
        if len(early) < _EARLY_SIGNALS_MAX:
            early.append(req)
        elif int(req.get("sig", 0)) == signal.SIGKILL:
            early[-1] = req  # a KILL is never dropped

    def _held(self, tree: Tree) -> None:
        """A tree is held now: what was asked of it while its start was on a spawner thread applies."""
        for req in self._early.pop(tree.key, ()):
            self._apply_signal(req)
        table = self._table
        if table.closing_kill_at is not None and tree.key in table.inflight:  # the close began meanwhile
            tree.kill_at = table.closing_kill_at
            table.pending[tree.key] = signal.SIGTERM if time.monotonic() < tree.kill_at else signal.SIGKILL


class _Start:
    """A start handed to a spawner thread: what the thread needs, and what it found (``collect``)."""

    __slots__ = ("bracket", "error", "fds", "group", "pid", "pooled", "req", "request", "reused")

    def __init__(self, req: dict[str, Any], fds: list[int], group: dict[str, Any] | None) -> None:
        self.req = req
        self.fds = fds
        self.request = group  # the request's group (a pooled one's paths, for a new group)
        self.group = group  # the group the thread joins (a pooled request's: the one taken for it)
        self.pooled = False  # taken from GroupPool: named in the answer, removed if the start failed
        self.reused = False
        self.pid = 0
        self.bracket: list[int] = []
        self.error: dict[str, Any] | None = None  # the failed start's answer


def _failed(req: dict[str, Any], exc: Exception, step: str) -> dict[str, Any]:
    """The answer to a start that raised ``exc`` at ``step`` (unless the exception names its own)."""
    step = getattr(exc, "step", step)  # forkexec.StepFailed names the child's step that failed
    code = getattr(exc, "errno", None) or (0 if isinstance(exc, OSError) else errno.EINVAL)
    return {"op": "spawn_failed", "id": req["id"], "errno": code, "what": step}
