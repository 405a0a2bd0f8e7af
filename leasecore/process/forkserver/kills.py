"""How the fork server kills its trees and lets them go: signals, ticks, strays, groups.

Owns ``Killer``: the signals the runner asks for (batched behind one walk of /proc: ``flush``), the
TERM-then-KILL of every tree at the close, and the ticks: a tree whose leader exited has its
leftovers TERMed, then KILLed after its grace ("the task's tree dies with the task"); a member that
appears in a tree's grace gets its own TERM; a tree whose leader exited and whose members are all dead
(and whose group holds nothing) is reaped and answered ``gone``, its group handed back to the pool or
removed; a process below the fork server whose tree is over (a stray) is TERMed, then KILLed after the
grace of the last tree that ended. The group KILLs of one round go together (``cgroupfs.kill_all``).

Must not touch: the socket (answers go through the ``reply`` it is handed); processes that are not
below the fork server (``trees.scan`` walks only its subtree). Stdlib only, like every module the fork
server imports. Threads: the fork server's main one, and its spawners under the fork server's lock.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from typing import Any

from leasecore.process.forkserver.exits import Exits
from leasecore.process.forkserver.grouppool import GroupPool
from leasecore.process.forkserver.switches import Switches
from leasecore.process.forkserver.trees import Tree, TreeTable, attribute, scan
from leasecore.process.linux import cgroupfs, procfs

TICK_SECONDS = 0.05  # how often a tree being killed is re-checked (members need not be our children)


class Killer:
    """Signals, ticks and reaps the trees of ``table``; see the module docstring."""

    def __init__(
        self, table: TreeTable, groups: GroupPool, exits: Exits, switches: Switches,
        reply: Callable[[dict[str, Any]], None], *, children_files: bool,
    ) -> None:  # fmt: skip
        self._table = table
        self._groups = groups
        self._exits = exits
        self._switches = switches
        self._reply = reply
        self._children_files = children_files
        self._pid = os.getpid()
        # Processes below us that belong to no live tree (their task is over): pid -> (start, kill_at).
        self._strays: dict[int, tuple[int, float]] = {}
        self._stray_grace_seconds = 10.0  # the grace of the last tree that ended
        self._next_scan_at = 0.0  # a /proc walk costs O(processes below us): at most every tick
        self.empty_groups: list[dict[str, Any]] = []  # groups of gone trees not removed yet
        self._group_kills: list[dict[str, Any]] = []  # groups to KILL once this round's signals are sent
        self.walks = self.walked = 0  # walks of /proc done, processes they read (``stats``)

    def signal(self, req: dict[str, Any]) -> bool:
        """A ``signal`` request: the tree gets it at the next ``flush``; False if no such tree is held."""
        tree = self._table.trees.get(str(req.get("key")))
        if tree is None:
            return False
        now = time.monotonic()
        sig = int(req["sig"])
        if not self._switches.runner_signalled(tree, sig, req.get("at")):
            return True  # the switch has TERMed it already: its KILL is due no later than the lease allows
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
        self._table.ask(tree.key, sig)
        return True

    def flush(self) -> None:
        """Signal every tree asked for since the last flush, after one walk of /proc for all."""
        table = self._table
        if not table.pending:
            return
        pending, table.pending = table.pending, {}
        # A KILL asked for a tree already KILLed is the runner's own KILL fence arriving after ours
        # (hundreds at once when it stops): the ticks already KILL any member that still shows up.
        trees = [
            (table.trees[key], sig)
            for key, sig in pending.items()
            if key in table.trees and not (sig == signal.SIGKILL and table.trees[key].kill_sent)
        ]
        if not trees:
            return
        procs = self.scan()
        members = self._attribute(procs)[0]
        for tree, sig in trees:
            self._signal_tree(tree, sig, procs, members[tree.key])
        self._kill_groups()

    def close(self, sig: int) -> None:
        """The close began (``table.closing_kill_at`` set): every tree gets ``sig`` now, its KILL then."""
        table = self._table
        assert table.closing_kill_at is not None
        table.pending.clear()  # every tree gets its signal now
        if not table.trees:
            return
        procs = self.scan()
        members = self._attribute(procs)[0]
        for tree in table.trees.values():
            tree.kill_at = min(tree.kill_at or table.closing_kill_at, table.closing_kill_at)
            self._signal_tree(tree, sig, procs, members[tree.key])
        self._kill_groups()

    def busy(self) -> bool:
        """Whether the ticks have work: a tree exited or being killed, strays, groups left, a close."""
        trees = self._table.trees.values()
        return (any(t.exited or t.kill_at is not None for t in trees) or self._table.closing
                or bool(self._strays) or bool(self.empty_groups))  # fmt: skip

    def scan(self, busy: list[Tree] | None = None) -> dict[int, procfs.ProcInfo]:
        """``trees.scan`` below us (counted for ``stats``)."""
        self.walks += 1
        procs = scan(self._pid, self._table.trees.values(), busy, children_files=self._children_files)
        self.walked += len(procs)
        return procs

    def _attribute(
        self, procs: dict[int, procfs.ProcInfo], walked: set[str] | None = None,
        in_groups: dict[str, set[int]] | None = None,
    ) -> tuple[dict[str, set[int]], set[int]]:
        """``trees.attribute`` of the trees held now (their members, and the strays)."""
        return attribute(list(self._table.trees.values()), procs, walked, in_groups)

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

    def tick(self) -> None:
        """Move every busy tree on (see the module docstring); at most one walk of /proc per tick."""
        table = self._table
        now = time.monotonic()
        busy = [tree for tree in table.trees.values() if tree.exited or tree.kill_at is not None]
        if not busy and not table.closing and not self._strays and not self.empty_groups:
            return
        # Walk /proc at most once per tick (it costs O(processes below us)), except when a KILL is due.
        kill_due = any(tree.kill_at is not None and now >= tree.kill_at for tree in busy) or (
            table.closing_kill_at is not None and now >= table.closing_kill_at
        )
        if now < self._next_scan_at and not kill_due:
            return
        self._next_scan_at = now + TICK_SECONDS
        walked = {tree.key for tree in busy}
        procs = self.scan(busy)
        in_groups: dict[str, set[int]] = {}  # each busy tree's group members, read after the walk
        members, strays = self._attribute(procs, walked, in_groups)
        if any(tree.exited and not members[tree.key] for tree in busy):
            # Confirm with a fresh walk: a member that forked and exited while /proc was being walked
            # may have left a child the walk did not show yet (a group found empty after the first
            # walk is not read again: it stays empty, see trees.attribute).
            procs = self.scan(busy)
            members, strays = self._attribute(procs, walked, in_groups)
        for tree in busy:
            if tree.exited and not members[tree.key] and not self._group_holds(tree, in_groups.get(tree.key)):
                self._let_go(tree)
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
        self.empty_groups = [group for group in self.empty_groups if not cgroupfs.remove(group)]
        if table.closing_kill_at is not None and now >= table.closing_kill_at:
            # Escapees that lost their marker belong to no known tree: at close they die too.
            procfs.signal_all(procs, procfs.live(procs, procs), signal.SIGKILL)

    def _let_go(self, tree: Tree) -> None:
        """The tree is dead: its leader reaped, its group reused or removed, ``gone`` answered."""
        self._exits.unwatch(tree)
        os.waitpid(tree.pid, 0)  # a zombie already: returns at once
        del self._table.trees[tree.key]
        # Its group goes to the next tree (GroupPool; never a KILLed tree's), or is removed.
        kept = tree.cgroup is not None and not self._table.closing and self._groups.give_back(
            tree.cgroup, killed=tree.kill_sent)
        if tree.cgroup is not None and not kept and not cgroupfs.remove(tree.cgroup):
            self.empty_groups.append(tree.cgroup)  # tried again at the next ticks
        self._stray_grace_seconds = tree.grace_seconds
        self._reply({"op": "gone", "key": tree.key})

    def _kill_groups(self) -> None:
        """The group KILL of every tree KILLed in this round, in one go (``cgroupfs.kill_all``). A
        tree's group is killed at its first KILL; what appears later is KILLed by the ticks as a
        member (the group's members are members of the tree)."""
        if self._group_kills:
            groups, self._group_kills = self._group_kills, []
            cgroupfs.kill_all(groups)

    def _group_holds(self, tree: Tree, in_group: set[int] | None) -> bool:
        """Whether the tree's group still holds a process: one no walk of /proc showed (in another
        pid namespace, or between a fork and its /proc entry) keeps the tree from being gone.
        ``in_group``: its member list as this tick read it after its last walk; on v1 that list is
        what ``cgroupfs.populated`` would read again (one open and read of kernfs per tree less)."""
        if tree.cgroup is None:
            return False
        v1_list = in_group is not None and tree.cgroup.get("v") == 1
        if not (bool(in_group) if v1_list else cgroupfs.populated(tree.cgroup)):
            return False
        if tree.kill_at is None:  # the task's tree dies with the task: TERM, then KILL, as for members
            tree.kill_at = time.monotonic() + tree.grace_seconds
        elif tree.kill_sent:  # KILLed, and still holding what no walk shows: the group's KILL again
            self._group_kills.append(tree.cgroup)
        return True
