"""How the fork server starts a task's tree: on its own thread or on a spawner thread (``spawners.py``).

Owns ``Launcher``, handed the fork server's tree table and what a held tree needs (its exit watched,
``exits.Exits``; its dead-man's switch armed, ``switches.Switches``), from a ``spawn`` request to a held
tree: ``spawn`` (answer it; the request's fds closed before the answer), ``_start_tree`` (a pooled
v1 group, ``GroupPool``), ``_exec_tree`` (``posix_spawn``, from inside the group when it has no
limits, ``cgroupfs.spawn_inside``; else ``forkexec.py`` for a cgroup, rlimits or ``run_as``; then the
``Tree`` held and its exit watched), and the starts on spawner threads.

Why spawner threads: glibc's ``posix_spawn`` returns once its vfork child has reached the exec, and
``os.posix_spawn`` keeps the GIL meanwhile; beside a busy process that child waited 2.8 ms on average
for a core, and every slot's start, exit and kill queued behind it (docs/benchmarks.md). While that
wait on the main thread, smoothed over ~20 starts (``_exec_wait``; while the threads are on, every
16th start is made on the main thread to measure it again), is above ``_THREADS_ABOVE_SECONDS``
(1 ms; 0.1-0.5 ms on an idle host, where the threads' hand-offs would cost more than they save),
``to_spawner`` hands a
request to a spawner thread when one can take it (glibc, /proc ``children`` files, no rlimits, no
``run_as``; no group, or a v1 group that the spawner thread alone joins through the v1 ``tasks`` files);
the job (``_start_threaded``) runs the same start with the fork server's lock (``turn``) held, released
only for libc's ``posix_spawn`` (``_spawn_unlocked``: the GIL too, by ctypes), and sends the answers.
Until its tree is held the start is in the table's ``inflight``: a signal asked for it waits in
``_early`` (``keep_early``) and applies the moment the tree is held (``_held``), as does a close begun
meanwhile, and the fork server does not end while a start is in flight.

Must not touch: anything of the fork server without ``turn`` held; signals (``kills.py``). Threads: the
fork server's main one and its spawners, each holding ``turn`` while it runs this code.
"""

from __future__ import annotations

import _thread
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
        self._answers = answers
        self._reply = reply
        self._apply_signal = apply_signal  # a signal request for a held tree (``kills.Killer.signal``)
        self._wake = wake
        self._sigdef = sigdef  # the signals the children get back at default (filled in when the loop runs)
        self._has_children_files = children_files
        # Every turn of the loop and every spawner's job holds ``turn`` (but for the select and the
        # libc call): one at a time touches the fork server's state, as when it had one thread.
        self.turn = _thread.RLock()
        self._main_thread = _thread.get_ident()
        self.spawners: Spawners | None = None  # made at the first start they can take
        self._spawn_attributes: Attributes | None = None
        self._spawners_off = False  # none here (not glibc, no children files)
        self._early: dict[str, list[dict[str, Any]]] = {}  # signal requests for starts in flight
        self._exec_wait = 0.0  # posix_spawn's wait for the exec on the main thread, smoothed (seconds)
        self._since_probe = 0  # starts handed to spawner threads since the main thread's last
        self._handed: list[Callable[[], None]] = []  # this turn's starts for spawner threads (hand_over)
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
                if req.get("cwd") and _thread.get_ident() == self._main_thread:  # a spawner's: a file action
                    os.chdir(req["cwd"])
                step = "exec"
                pid = self._posix_spawn(req, fds, req.get("cgroup") if inside else None, bracket)
        except Exception as exc:  # OSError; ValueError (a NUL byte), TypeError: a bad request never ends us
            step = getattr(exc, "step", step)  # forkexec.StepFailed names the child's step that failed
            code = getattr(exc, "errno", None) or (0 if isinstance(exc, OSError) else errno.EINVAL)
            return {"op": "spawn_failed", "id": req["id"], "errno": code, "what": step}
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
        if _thread.get_ident() != self._main_thread:
            return self._spawn_unlocked(req, fds, group, bracket)

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

        return spawn() if group is None else cgroupfs.spawn_inside(group, spawn)

    def _waited(self, seconds: float) -> None:
        self._exec_wait += _WAIT_SMOOTHING * (seconds - self._exec_wait)

    def to_spawner(self, req: dict[str, Any], fds: list[int]) -> bool:
        """Hand ``req`` to a spawner thread, which answers it; False: start it here, as before."""
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
        key = str(req.get("key"))
        self._table.inflight[key] = str(req.get("dir") or "")
        if self.spawners.reserve():
            self._handed.append(lambda: self._start_threaded(req, fds))
            self._since_probe += 1
            return True
        del self._table.inflight[key]
        return False

    def hand_over(self) -> None:
        """Queue the starts this turn took for their spawner threads. Called by the loop (main thread)
        once its turn has let go of ``turn``: a spawner woken mid-turn found the lock held and slept
        again until the turn's end (a sleep and a wake-up more per start, and the GIL fought for)."""
        handed, self._handed = self._handed, []
        if self.spawners is not None:  # (None: nothing was handed)
            for job in handed:
                self.spawners.put(job)

    def _start_threaded(self, req: dict[str, Any], fds: list[int]) -> None:
        """The job, on a spawner thread: the fork server's own start of ``req``, answered at once."""
        key = str(req.get("key"))
        with self.turn:
            try:
                self.spawn(req, fds)
            except Exception as exc:  # as the loop's: that task fails, the fork server goes on
                code = getattr(exc, "errno", 0) or 0
                self._reply({"op": "spawn_failed", "id": req.get("id"), "errno": code, "what": "fork"})
            finally:
                self._table.inflight.pop(key, None)
                self._early.pop(key, None)  # applied if its tree is held; moot if it never started
                self._switches.forget(key)  # its early renewal likewise
                self._answers.flush()  # the loop may be asleep: the runner waits for this answer
                # A signal that waited for the tree (the loop sends it: one walk), or answers the socket
                # did not take (the loop waits for room): wake the loop.
                if self._table.pending or self._answers.waiting:
                    self._wake()

    def _spawn_unlocked(
        self, req: dict[str, Any], fds: list[int], group: dict[str, Any] | None, bracket: list[int]
    ) -> int:
        """On a spawner thread: libc's ``posix_spawn`` with ``turn`` (and, by ctypes, the GIL) released
        for the call, from inside ``group`` if given (this thread alone joins it)."""
        from leasecore.process.forkserver import spawners

        assert self._spawn_attributes is not None
        attributes = self._spawn_attributes

        def spawn() -> int:
            self.turn.release()
            started = procfs.boot_clock_ns()
            try:
                return spawners.spawn(attributes, req["path"], req["argv"], req["env"], fds, req.get("cwd"))
            except OSError as exc:
                cwd = req.get("cwd")
                if cwd and not os.path.isdir(cwd):
                    exc.step = "chdir"  # type: ignore[attr-defined]  # named as a start here names it
                raise
            finally:
                bracket[:] = started, procfs.boot_clock_ns()
                self.turn.acquire()

        return spawn() if group is None else cgroupfs.spawn_inside(group, spawn, thread=True)

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
