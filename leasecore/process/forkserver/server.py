"""The fork server: a small process, started by the Supervisor, parent of every task tree.

Owns the task trees (``trees.Tree``, from spawn until every process of one is dead and reaped) and
every process below it. Driven over the control socket (``frames.py``; the messages:
``supervisor/forkserver_link.py``), it starts each command in a new session (``launch.py``: ``posix_spawn``,
on a spawner thread where it can, from inside its cgroup when the group has no limits; else ``forkexec.py``
for a cgroup, rlimits or ``run_as``) with the three fds it was sent as 0-2 and the signals it ignores back
at default; is a child subreaper, so escapees (setsid, double fork) are re-parented here; reports
each exit from ``waitid(WNOWAIT)`` (a pidfd per leader, else at each SIGCHLD) but keeps the leader a
zombie until its whole tree is dead, so the group it signals is never a recycled pid's; kills a
tree's leftovers when its leader exits (TERM, KILL after the grace); batches the signals asked for
behind one /proc walk; ends a tree whose kill-by time the runner stopped renewing, on its own
(``switches.py``: the dead-man's switch of a stalled runner), never blocking on a runner that does not
read; and on EOF (the runner died or closed it) kills every tree and anything still below it, then exits.
It ignores SIGINT/SIGTERM/SIGHUP: how to stop is the runner's decision.

Must not touch: processes that are not below it, the runner's state record (only the directories of
a dead runner's tasks are removed here). Imports stay stdlib only and few: it lives as long as the
runner and its memory counts in the runner's footprint (the Supervisor boots it without the package
``__init__`` files). Threads: the main one (this loop) and, on a host where posix_spawn waits long
for the exec, up to four spawner threads (``launch.py``), all touching the state only with
``_turn`` held: a turn of the loop holds it but for its select, a spawner's start but for the libc
call. Signal handlers only wake the selector.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import selectors
import signal
import socket
import sys
import time
from typing import Any

from leasecore.process.forkserver.frames import FrameBatch, recv_frame, send_frame
from leasecore.process.forkserver.grouppool import GroupPool
from leasecore.process.forkserver.launch import TreeStarts
from leasecore.process.forkserver.switches import Switches, raise_priority
from leasecore.process.forkserver.trees import Tree, attribute, scan
from leasecore.process.linux import cgroupfs, procfs

_TICK_SECONDS = 0.05  # how often a tree being killed is re-checked (members need not be our children)
_GIVE_UP_SECONDS = 10.0
_BATCH_MAX = 256  # requests served between two looks at exits, fences and kills
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # by the fork server: the runner decides


class ForkServer(TreeStarts, Switches):
    """The event loop; see the module docstring (how a tree is started: launch.py)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pid = os.getpid()
        self._trees: dict[str, Tree] = {}
        self._closing_kill_at: float | None = None
        # Processes below us that belong to no live tree (their task is over): pid -> (start, kill_at).
        self._strays: dict[int, tuple[int, float]] = {}
        self._stray_grace_seconds = 10.0  # the grace of the last tree that ended
        self._next_scan_at = 0.0  # a /proc walk costs O(processes below us): at most every tick
        # Trees to signal once the requests already waiting are read: one walk of /proc for all of
        # them, in the order asked. A KILL asked after a TERM of the same tree supersedes it.
        self._pending: dict[str, int] = {}
        self._empty_groups: list[dict[str, Any]] = []  # groups of gone trees not removed yet
        self._groups = GroupPool()  # v1 groups without limits, reused once their tree is gone
        self._group_kills: list[dict[str, Any]] = []  # groups to KILL once this round's signals are sent
        self._orphaned_dirs: list[str] = []  # set when the runner dies (EOF): see _remove_orphaned_dirs
        self._answers = FrameBatch(sock)  # this turn's answers, sent together at its end
        self._room_wanted = False  # the selector waits for room to send (answers wait: FrameBatch)
        self._walks = self._walked = 0  # walks of /proc done, processes they read (``stats``)
        self._waitids = 0  # exit checks (``stats``)
        self._use_pidfds = procfs.IS_LINUX and hasattr(os, "pidfd_open")
        self._waiting = select.poll()  # is another request waiting on the socket? (_serve_waiting)
        self._waiting.register(self._sock, select.POLLIN)
        self._has_children_files = procfs.IS_LINUX and procfs.has_children_files(self._pid)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._sigdef: list[int] = []
        self._init_starts()  # launch.py: spawner threads, ``_turn``
        self._init_switches()  # switches.py: each tree's dead-man's switch

    def run(self) -> None:
        """Serve until EOF or shutdown, then kill and reap everything and return."""
        procfs.become_subreaper()
        raise_priority()  # switches.py: the switches fire on time on a busy host (not the trees)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        self._sigdef = [
            s
            for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN
        ]
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # SIGCHLD must wake us, whatever we inherited
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self._sock, selectors.EVENT_READ)
        send_frame(self._sock, {"op": "ready", "pid": self._pid})
        try:  # a turn that fails still sends what it answered (exits, starts) before we die
            while True:
                with self._turn:
                    if self._done():
                        break
                    timeout = self._timeout_seconds()
                    self._want_room(self._answers.waiting)
                ready = self._selector.select(timeout)  # (a spawner may register a pidfd meanwhile)
                with self._turn:
                    self._take_turn(ready)
        finally:
            with self._turn:
                self._answers.flush(block=True)
        for group in self._empty_groups + self._groups.drain():  # a last try; a next start's sweep
            cgroupfs.remove(group)  # removes the rest
        self._remove_orphaned_dirs()

    def _take_turn(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        sigchld = False
        for key, _ in ready:
            if key.fileobj == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                sigchld = True
            elif key.data is not None:  # a leader's pidfd: it exited
                self._check_exit(key.data)
        # The socket: whatever waits on it now, whether the select said so or not (a process stopped in
        # it wakes on its timeout with the runner's renewals waiting). Room to send: the flush below.
        if self._closing_kill_at is None and self._waiting.poll(0) and not self._serve_waiting():
            # EOF without a shutdown: the runner died
            self._orphaned_dirs = [tree.directory for tree in self._trees.values()]
            self._orphaned_dirs += [directory for directory in self._inflight.values() if directory]
            self._begin_close(0.0)
        # Trees past their kill-by time, with the renewals that were waiting applied (one read late is
        # still true: the server extended the lease), die first; a spawn fires them before it starts.
        self._fire_switches(time.monotonic())
        self._flush_signals()
        if sigchld:  # only a SIGCHLD means an exit: a spawn request need not waitid every tree
            self._reap()
        self._tick()
        self._answers.flush()  # before the loop sleeps

    def _want_room(self, waiting: bool) -> None:
        """Wake the loop when the socket can take more, while answers wait (the runner not reading)."""
        if self._closing_kill_at is None and waiting != self._room_wanted:
            self._room_wanted = waiting
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
            self._selector.modify(self._sock, events)

    def _remove_orphaned_dirs(self) -> None:
        """The runner died: remove the directories of the tasks it held (their input, maybe
        confidential, would otherwise wait in /tmp for a next start that may never come). The runner's
        record of them stays: the next start with its state directory still reports the tasks FAILED."""
        if not self._orphaned_dirs:
            return
        from leasecore.process.linux.leftovers import remove_tmpdir  # only now: it imports much we never need

        for directory in self._orphaned_dirs:
            remove_tmpdir(directory)

    # requests -------------------------------------------------------------------------------

    def _serve_waiting(self) -> bool:
        """Serve the request that woke us and every one already waiting behind it (bounded: a
        flood of requests must not starve reaping and killing); False on EOF."""
        for _ in range(_BATCH_MAX):
            if not self._serve_one():
                return False
            if self._closing_kill_at is not None:
                return True  # shutdown: the socket is no longer served
            if not self._waiting.poll(0):  # poll, not select: the socket's fd may be above 1023
                break
        return True

    def _serve_one(self) -> bool:
        try:
            frame = recv_frame(self._sock, maxfds=3)
        except (OSError, EOFError, ValueError):
            frame = None
        if frame is None:
            return False
        message, fds = frame
        op = message.get("op")
        if op == "spawn":
            self._fire_switches(time.monotonic())  # a tree past its kill-by time dies before any start
            if self._to_spawner(message, fds):
                return True  # answered from its spawner thread
            try:
                self._spawn(message, fds)
            except OSError as exc:  # EAGAIN from fork, EMFILE from pipe: that task fails, we go on
                self._reply({"op": "spawn_failed", "id": message.get("id"), "errno": exc.errno or 0,
                             "what": "fork"})  # fmt: skip
        elif op == "signal":
            self._signal(message)
        elif op == "kill_by":
            self._renew_switches(message)
        elif op == "shutdown":
            self._begin_close(float(message.get("grace", 0.0)))
        elif op == "stats":
            self._reply({"op": "stats", "id": message.get("id"), "walks": self._walks,
                         "walked": self._walked, "waitids": self._waitids,
                         "trees": len(self._trees), "groups_made": self._groups.made,
                         "groups_reused": self._groups.reused, "groups_free": len(self._groups),
                         "spawner_threads": self._spawners.threads if self._spawners else 0,
                         "start_times_read": self._start_times.read,
                         "start_times_off": self._start_times.off, **self._switch_stats()})  # fmt: skip
        for fd in fds:
            os.close(fd)
        return True

    def _watch_exit(self, tree: Tree) -> None:
        """Watch the leader's exit through a pidfd: a SIGCHLD then need not ``waitid`` every tree.
        Without one (a kernel before 5.3, or no fd left) the tree's exit is found by that loop."""
        if not self._use_pidfds:
            return
        try:
            tree.pidfd = os.pidfd_open(tree.pid)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EINVAL):
                self._use_pidfds = False
            return
        try:
            self._selector.register(tree.pidfd, selectors.EVENT_READ, tree)
        except OSError:  # epoll full (ENOSPC, ENOMEM): found at a SIGCHLD instead
            os.close(tree.pidfd)
            tree.pidfd = -1

    def _unwatch_exit(self, tree: Tree) -> None:
        fd, tree.pidfd = tree.pidfd, -1
        if fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fd)
            os.close(fd)

    def _signal(self, req: dict[str, Any]) -> None:
        tree = self._trees.get(str(req.get("key")))
        if tree is None:
            self._signal_early(req)
            return
        now = time.monotonic()
        sig = int(req["sig"])
        if not self._runner_signalled(tree, sig, req.get("at")):
            return  # the switch has TERMed it already: its KILL is due no later than the lease allows
        if sig == signal.SIGKILL:
            tree.kill_at = now
        else:
            grace = req.get("grace")
            since = req.get("since")
            # From when the runner decided (a TERM handed out late must not get a later KILL), never
            # from the future.
            start = min(now, float(since)) if isinstance(since, int | float) else now
            deadline = start + float(tree.grace_seconds if grace is None else grace)
            tree.kill_at = deadline if tree.kill_at is None else min(tree.kill_at, deadline)
        if self._pending.get(tree.key) != signal.SIGKILL:
            self._pending[tree.key] = sig  # sent by _flush_signals, with the others asked meanwhile

    def _flush_signals(self) -> None:
        """Signal every tree asked for since the last flush, after one walk of /proc for all."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        # A KILL asked for a tree already KILLed is the runner's own KILL fence arriving after ours
        # (hundreds at once when it stops): the ticks already KILL any member that still shows up.
        trees = [
            (self._trees[key], sig)
            for key, sig in pending.items()
            if key in self._trees and not (sig == signal.SIGKILL and self._trees[key].kill_sent)
        ]
        if not trees:
            return
        procs = self._scan()
        members = self._attribute(procs)[0]
        for tree, sig in trees:
            self._signal_tree(tree, sig, procs, members[tree.key])
        self._kill_groups()

    def _begin_close(self, grace_seconds: float) -> None:
        now = time.monotonic()
        self._closing_kill_at = now + grace_seconds
        with contextlib.suppress(OSError, ValueError):
            self._selector.unregister(self._sock)
        self._pending.clear()  # every tree gets its signal now
        if not self._trees:
            return
        procs = self._scan()
        members = self._attribute(procs)[0]
        for tree in self._trees.values():
            tree.kill_at = min(tree.kill_at or self._closing_kill_at, self._closing_kill_at)
            self._signal_tree(tree, signal.SIGTERM if grace_seconds > 0 else signal.SIGKILL, procs,
                              members[tree.key])  # fmt: skip
        self._kill_groups()

    # killing and reaping ------------------------------------------------------------------------

    def _scan(self, busy: list[Tree] | None = None) -> dict[int, procfs.ProcInfo]:
        """``trees.scan`` below us (counted for ``stats``)."""
        self._walks += 1
        procs = scan(self._pid, self._trees.values(), busy, children_files=self._has_children_files)
        self._walked += len(procs)
        return procs
    def _attribute(
        self, procs: dict[int, procfs.ProcInfo], walked: set[str] | None = None
    ) -> tuple[dict[str, set[int]], set[int]]:
        """``trees.attribute`` of the trees held now (their members, and the strays)."""
        return attribute(list(self._trees.values()), procs, walked)

    def _signal_tree(
        self, tree: Tree, sig: int, procs: dict[int, procfs.ProcInfo], members: set[int]
    ) -> None:
        # ``members`` from a walk made before any signal: once the leader dies, its children are
        # re-parented to us, and a walk of /proc in that moment can miss them (a setsid'ed one would
        # then wait for the KILL).
        # The leader is our unreaped child, so its pid still names its group: killpg is safe.
        procfs.killpg_quietly(tree.pid, sig)
        if not tree.exited:
            with contextlib.suppress(ProcessLookupError):
                os.kill(tree.pid, sig)
        procfs.signal_all(procs, members, sig)
        if sig == signal.SIGKILL:
            if tree.cgroup is not None and not tree.kill_sent:  # every member, even one no walk found
                self._group_kills.append(tree.cgroup)  # after the loop, all at once (_kill_groups)
            tree.kill_sent = True
        if sig == signal.SIGTERM:  # a stopped process would never see its TERM
            procfs.killpg_quietly(tree.pid, signal.SIGCONT)
            procfs.signal_all(procs, members, signal.SIGCONT)
            tree.term_sent = True
            tree.termed |= members | {tree.pid}

    def _handle_strays(self, procs: dict[int, procfs.ProcInfo], strays: set[int], now: float) -> None:
        """TERM each new stray, KILL it after the grace of the last tree that ended."""
        for pid in strays:
            start = procs[pid].start_time
            entry = self._strays.get(pid)
            if entry is None or entry[0] != start:
                self._strays[pid] = (start, now + self._stray_grace_seconds)
                procfs.signal_verified(pid, start, signal.SIGTERM)
                procfs.signal_verified(pid, start, signal.SIGCONT)
            elif now >= entry[1]:
                procfs.signal_verified(pid, start, signal.SIGKILL)
        for pid in set(self._strays) - strays:
            del self._strays[pid]

    def _check_exit(self, tree: Tree) -> None:
        """Report the leader's exit if it happened; it stays our zombie (WNOWAIT) until the tree is gone."""
        if tree.exited:
            return
        self._waitids += 1
        result = os.waitid(os.P_PID, tree.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        # Exited, or (if its pidfd woke us yet there is nothing to wait for) traced: only its tracer
        # (strace -p, gdb) sees the exit until it lets go, and the readable pidfd would wake us for
        # ever. Either way it is watched by SIGCHLD from now on (we get one when the tracer is done).
        self._unwatch_exit(tree)
        if result is None:
            return
        tree.exited = True
        killed = result.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        # What the tree used: from its group where it has one, else the leader's own (and its reaped
        # children's) rusage. The OOM kills from the group's events, never guessed from a SIGKILL.
        usage, oom = cgroupfs.tree_usage(tree.pid, tree.cgroup)
        self._reply(
            {
                "op": "exited",
                "key": tree.key,
                "pid": tree.pid,
                "code": None if killed else result.si_status,
                "signal": result.si_status if killed else None,
                "resources": usage,
                "oom_kills": oom,
                "switch": tree.switched,  # ended by its dead-man's switch: the runner was stalled
                "switch_late": tree.switch.late if tree.switched and tree.switch else None,  # its lateness
            }
        )

    def _reap(self) -> None:
        held = set()
        for tree in self._trees.values():
            held.add(tree.pid)
            if tree.pidfd < 0:  # watched by its pidfd otherwise
                self._check_exit(tree)
        # Everything else that died here (adopted escapees) is reaped at once: no zombies.
        for pid in procfs.children_of(self._pid, threads=1) if procfs.IS_LINUX else []:
            if pid not in held:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)

    def _tick(self) -> None:
        now = time.monotonic()
        busy = [tree for tree in self._trees.values() if tree.exited or tree.kill_at is not None]
        if not busy and self._closing_kill_at is None and not self._strays and not self._empty_groups:
            return
        # Walk /proc at most once per tick (it costs O(processes below us)), except when a KILL is due.
        kill_due = any(tree.kill_at is not None and now >= tree.kill_at for tree in busy) or (
            self._closing_kill_at is not None and now >= self._closing_kill_at
        )
        if now < self._next_scan_at and not kill_due:
            return
        self._next_scan_at = now + _TICK_SECONDS
        walked = {tree.key for tree in busy}
        procs = self._scan(busy)
        members, strays = self._attribute(procs, walked)
        if any(tree.exited and not members[tree.key] for tree in busy):
            # Confirm with a fresh walk: a member that forked and exited while /proc was being walked
            # may have left a child that neither list showed yet.
            procs = self._scan(busy)
            members, strays = self._attribute(procs, walked)
        for tree in busy:
            if tree.exited and not members[tree.key] and not self._group_holds(tree):
                self._unwatch_exit(tree)
                os.waitpid(tree.pid, 0)  # a zombie already: returns at once
                del self._trees[tree.key]
                # Its group goes to the next tree (GroupPool; never a KILLed tree's), or is removed.
                kept = tree.cgroup is not None and self._closing_kill_at is None and self._groups.give_back(
                    tree.cgroup, killed=tree.kill_sent)
                if tree.cgroup is not None and not kept and not cgroupfs.remove(tree.cgroup):
                    self._empty_groups.append(tree.cgroup)  # tried again at the next ticks
                self._stray_grace_seconds = tree.grace_seconds
                self._reply({"op": "gone", "key": tree.key})
            elif tree.kill_at is not None and now >= tree.kill_at:
                self._signal_tree(tree, signal.SIGKILL, procs, members[tree.key])
            elif tree.exited and not tree.term_sent:  # "the task's tree dies with the task"
                tree.kill_at = now + tree.grace_seconds
                self._signal_tree(tree, signal.SIGTERM, procs, members[tree.key])
            elif tree.term_sent and tree.kill_at is not None:
                # In its grace: a member that appeared since the TERM (forked and setsid'ed between the
                # walk and the signal, or by a TERM handler) gets its TERM now, not only the KILL.
                newcomers = members[tree.key] - tree.termed
                if newcomers:
                    procfs.signal_all(procs, newcomers, signal.SIGTERM)
                    procfs.signal_all(procs, newcomers, signal.SIGCONT)
                    tree.termed |= newcomers
        self._kill_groups()
        self._handle_strays(procs, strays, now)
        self._empty_groups = [group for group in self._empty_groups if not cgroupfs.remove(group)]
        if self._closing_kill_at is not None and now >= self._closing_kill_at:
            # Escapees that lost their marker belong to no known tree: at close they die too.
            procfs.signal_all(procs, procfs.live(procs, procs), signal.SIGKILL)

    def _kill_groups(self) -> None:
        """The group KILL of every tree KILLed in this round, in one go (``cgroupfs.kill_all``). A
        tree's group is killed at its first KILL; what appears later is KILLed by the ticks as a
        member (the group's members are members of the tree)."""
        if self._group_kills:
            groups, self._group_kills = self._group_kills, []
            cgroupfs.kill_all(groups)

    def _group_holds(self, tree: Tree) -> bool:
        """Whether the tree's group still holds a process: one no walk of /proc showed (in another
        pid namespace, or between a fork and its /proc entry) keeps the tree from being gone."""
        if tree.cgroup is None or not cgroupfs.populated(tree.cgroup):
            return False
        if tree.kill_at is None:  # the task's tree dies with the task: TERM, then KILL, as for members
            tree.kill_at = time.monotonic() + tree.grace_seconds
        elif tree.kill_sent:  # KILLed, and still holding what no walk shows: the group's KILL again
            self._group_kills.append(tree.cgroup)
        return True

    def _timeout_seconds(self) -> float | None:
        busy = any(t.exited or t.kill_at is not None for t in self._trees.values())
        closing = self._closing_kill_at is not None or self._strays or self._empty_groups
        return self._switch_timeout(time.monotonic(), _TICK_SECONDS if busy or closing else None)

    def _done(self) -> bool:
        if self._closing_kill_at is None or self._inflight:  # (a start on a spawner thread: its tree next)
            return False
        if time.monotonic() > self._closing_kill_at + _GIVE_UP_SECONDS:
            return True  # something unkillable (D state): do not spin for ever
        if self._trees:
            return False
        return not any(procfs.live(procs := procfs.subtree(self._pid, threads=1), procs))

    def _reply(self, message: dict[str, Any]) -> None:
        if self._closing_kill_at is not None and self._sock.fileno() < 0:
            return
        self._answers.add(message)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``argv[0]`` is the inherited fd of the control socket."""
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    sock.set_inheritable(False)
    ForkServer(sock).run()


if __name__ == "__main__":
    main()
