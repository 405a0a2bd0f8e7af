"""The fork server's task trees: the ``Tree`` record, the table of them, and which process below it is whose.

Owns ``TreeTable`` (the trees held, the starts still on a spawner thread, the signals asked and not sent
yet, whether the close began: the state every part of the fork server reads), ``Tree`` (one task's tree
as the fork server holds it: leader pid and start time, marker token, cgroup, grace, the members seen at
the last scan, what was sent to it) and ``attribute``, the rule that assigns every process below the
fork server to a tree or calls it a stray. A process is a tree's when it is in the tree's session or
process group, carries its marker token, was seen in it at an earlier scan, is in its cgroup, or
descends from one of those; one that none claims (it left the group *and* wiped its environment) is
attributed by start time: only a tree whose leader started no later can own it, so with exactly one such
live tree it is that tree's, with none a stray (its tree is over), with several it stays unclaimed
(never a wrong kill).

Must not touch: signals, sockets, the selector: it decides whose a process is and nothing else
(``kills.Killer`` signals). Stdlib only and light, like every module the fork server imports.

Threads: the fork server's (under its lock, ``launch.py``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from typing import Any

from leasecore.process.forkserver.deadman import Switch
from leasecore.process.linux import cgroupfs, procfs


class Tree:
    """One task's tree, held from spawn until every process of it is dead and reaped.

    A plain class, not a dataclass: ``dataclasses`` imports ``inspect`` and more, all of it resident
    in this process for as long as the runner lives.
    """

    __slots__ = ("cgroup", "directory", "exited", "grace_seconds", "key", "kill_at", "kill_sent", "known",
                 "pid", "pidfd", "start_time", "switch", "switched", "term_sent", "termed",
                 "token")  # fmt: skip

    def __init__(self, key: str, pid: int, token: str, grace_seconds: float, start_time: int = 0) -> None:
        self.directory = ""  # the task's temporary directory (removed here only if the runner died)
        self.cgroup: dict[str, Any] | None = None  # its cgroup (cgroupfs): members, kill, accounting
        self.key = key
        self.pid = pid
        self.token = token
        self.grace_seconds = grace_seconds
        self.start_time = start_time  # clock ticks since boot, as /proc gives it (0 elsewhere than Linux)
        self.exited = False
        self.term_sent = False
        self.kill_sent = False  # the ticks KILL whatever of it still appears from then on
        self.termed: set[int] = set()  # pids sent the TERM (a member found later gets its own)
        self.kill_at: float | None = None
        self.pidfd = -1  # readable when the leader exits (-1: none, its exit is found at a SIGCHLD)
        # Members seen at the last scan (pid -> start time): one that leaves the group and wipes its
        # marker after being seen (e.g. on the TERM) is still recognised by its (pid, start time).
        self.known: dict[int, int] = {}
        self.switch: Switch | None = None  # its dead-man's switch (deadman.py): None, no kill-by time
        self.switched = False  # the switch signalled it before the runner did (the runner stalled)


class TreeTable:
    """What the fork server holds now; its parts share this one table (``server.ForkServer`` makes it)."""

    __slots__ = ("closing_kill_at", "inflight", "pending", "trees")

    def __init__(self) -> None:
        self.trees: dict[str, Tree] = {}
        self.inflight: dict[str, str] = {}  # key -> task directory, of starts on a spawner thread
        # Trees to signal once the requests already waiting are read: one walk of /proc for all of
        # them, in the order asked (``kills.Killer.flush``).
        self.pending: dict[str, int] = {}
        self.closing_kill_at: float | None = None  # set when the close began: every tree's last KILL

    @property
    def closing(self) -> bool:
        return self.closing_kill_at is not None

    def ask(self, key: str, sig: int) -> None:
        """Signal the tree at the next flush. A KILL asked after a TERM of the same tree supersedes it."""
        if self.pending.get(key) != signal.SIGKILL:
            self.pending[key] = sig


def attribute(
    trees: list[Tree], procs: dict[int, procfs.ProcInfo], walked: set[str] | None = None,
    in_groups: dict[str, set[int]] | None = None,
) -> tuple[dict[str, set[int]], set[int]]:
    """Each of ``trees``' live members (leader excluded), and the strays: live processes below the fork
    server whose tree is over. Also refreshes each tree's ``known`` members. ``walked``: the keys of
    the trees whose members ``procs`` holds (``kills.Killer.scan(busy)``; None: all); for the others,
    only what was walked of them (processes re-parented to the fork server) is answered and added to
    their ``known``. ``in_groups``, if given, gets each walked tree's group member list as read here
    (after the walk), whether /proc showed those pids or not; a list it already holds empty (read
    after an earlier walk of the same tick) is not read again: a group that held no process holds
    none later (a process is born in its parent's group, and only the fork server moves one into a
    group, at its tree's start), so the confirming walk of a tree that looked gone (``kills.py``)
    reads its group once, not twice.

    Every process below us descends from some tree's leader, which started no later than it did.
    A process that nothing else claims (it left the group, wiped its marker and was never seen)
    is attributed by its oldest unclaimed ancestor's start time: to the only live tree whose leader
    started at or before it, or, when no live tree did, to a tree that is over (a stray). With
    several candidates it stays unclaimed until the older ones end (never a wrong kill).
    """
    leaders = {tree.pid: tree for tree in trees}
    tokens = {tree.token: tree for tree in trees}
    roots: dict[str, set[int]] = {tree.key: {tree.pid} for tree in trees}
    for tree in trees:
        roots[tree.key].update(
            pid for pid, start in tree.known.items() if pid in procs and procs[pid].start_time == start
        )
    for pid, info in procs.items():
        if info.is_zombie or pid in leaders:
            continue
        owner = leaders.get(info.sid) or leaders.get(info.pgid)
        if owner is None and tokens:
            owner = tokens.get(procfs.read_marker(pid) or "")
        if owner is not None:
            roots[owner.key].add(pid)
    for tree in trees:  # a group holds its members whatever they did (setsid, env -i, double fork)
        if tree.cgroup is not None and (walked is None or tree.key in walked):
            read = in_groups.get(tree.key) if in_groups is not None else None
            in_group = read if read is not None and not read else cgroupfs.members(tree.cgroup)
            if in_groups is not None:
                in_groups[tree.key] = in_group
            roots[tree.key].update(pid for pid in in_group if pid in procs)
    children = procfs.children_map(procs)  # once: per tree it made every walk O(trees x procs)
    members = {key: procfs.descendants(procs, pids, children) for key, pids in roots.items()}
    claimed = set(leaders).union(*members.values())
    unclaimed = set(procfs.live(procs, procs)) - claimed
    strays: set[int] = set()
    for pid in unclaimed:
        if procs[pid].ppid in unclaimed:
            continue  # decided with its oldest unclaimed ancestor
        start = procs[pid].start_time
        candidates = [tree for tree in trees if tree.start_time <= start]
        if len(candidates) == 1:
            members[candidates[0].key] |= procfs.descendants(procs, [pid], children)
        elif not candidates:
            strays |= procfs.descendants(procs, [pid], children)
    result: dict[str, set[int]] = {}
    for tree in trees:
        live = set(procfs.live(procs, members[tree.key])) - {tree.pid}
        seen = {pid: procs[pid].start_time for pid in live}
        if walked is None or tree.key in walked:
            tree.known = seen
        else:  # only what was walked of it (its orphans): add, the rest was not looked at
            tree.known.update(seen)
        result[tree.key] = live
    return result, set(procfs.live(procs, strays))


def scan(
    own_pid: int, trees: Iterable[Tree], busy: list[Tree] | None, *, children_files: bool
) -> dict[int, procfs.ProcInfo]:
    """Every process below ``own_pid`` (the fork server); with ``busy``, only those that can belong
    to a busy tree or to no live tree: everything except the subtrees of the other trees' leaders
    (``children_files``: whether /proc has the ``children`` files that make this walk possible).

    Sound because the fork server is a subreaper: a process of its never leaves its subtree, and it
    moves only when its parent dies, to the fork server. So a member of a busy tree, or a stray,
    descends from a busy leader or from a process re-parented there, never from another tree's live
    leader. The ticks walk this way: their cost follows the busy trees and the orphans. The walk starts
    at the fork server's main thread's children (the orphans, adopted by a subreaper's first live
    thread, and the leaders it started) and at the leaders themselves: a leader started on a spawner
    thread (``launch.py``) is that thread's child, in that thread's ``children`` file only.
    """
    if not procfs.IS_LINUX:
        return {}
    if not children_files:  # a scan of all of /proc, by parent pid: every thread's children
        return procfs.subtree(own_pid, threads=1)
    trees = list(trees)
    # A leader whose exit was reported (``exited``) is not read: it is our zombie, and a zombie with no
    # children (the kernel reports a leader's exit only once its last thread is gone, and their
    # children were re-parented to us as they went); ``attribute`` makes nothing of a zombie (no
    # member, no stray), nor of a leader absent from the walk. Two reads of /proc a task fewer.
    over = {tree.pid for tree in trees if tree.exited}
    leaders = [tree.pid for tree in trees if not tree.exited]
    if busy is None:
        orphans = [pid for pid in procfs.children_of(own_pid, threads=1) if pid not in over]
        return procfs.walk(orphans + leaders)
    skip = over | set(leaders).difference(tree.pid for tree in busy)  # and the quiet trees' leaders
    roots = [pid for pid in procfs.children_of(own_pid, threads=1) if pid not in skip]
    return procfs.walk([*roots, *(tree.pid for tree in busy if not tree.exited)])
