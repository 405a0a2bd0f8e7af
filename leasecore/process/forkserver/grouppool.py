"""The fork server's reused cgroup v1 groups: one tree at a time each, handed to the next tree once empty.

Owns the free groups of this fork server and the choice between a free one and a new one for a spawn
whose request asks for a pooled group (``cgroups.pool_request``: v1, no limits). Must not touch: a
group with limits, a v2 group, a group whose tree is not gone (the caller gives back only those),
and any group it did not make or was not given back. Threads: the fork server's (under its lock). Stdlib
and ``cgroupfs`` only (the fork server imports it).

Why: on cgroup v1 a new group per tree costs three ``mkdir`` (and the kernel's new files in each),
three ``rmdir`` and the first opens of its files: 0.3-0.4 ms of CPU a task on a 2-core VM, the
largest single cost of a short task (docs/benchmarks.md). A reused group is the same guarantee for
its tree: nobody else is in it (it is handed out only once empty, and only the fork server puts
processes in it), the KILL goes to the whole group, and its figures are the tree's own
(``cgroupfs.recycle`` takes the base they are counted from while it is empty). A group whose tree
was KILLed (frozen and thawed), or whose leftover charge grew too large, is removed as before.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from leasecore.process.linux import cgroupfs

Group = dict[str, Any]
POOL_MOST = 64  # free groups kept at once; more (after a burst of trees) are removed as before


class GroupPool:
    """Free groups and the counters the fork server's ``stats`` answer gives."""

    def __init__(self, most: int = POOL_MOST) -> None:
        self._free: list[Group] = []
        self._most = most
        self.made = 0  # new groups made for pool requests
        self.reused = 0  # spawns that took a free group

    def __len__(self) -> int:
        return len(self._free)

    def take(self, request: Group) -> tuple[Group, bool]:
        """A group for the tree of ``request`` (a ``pool`` request): a free one (True), or a new one
        made at the request's paths (False). OSError if a new one cannot be made (nothing is left)."""
        if self._free:
            self.reused += 1
            return self._free.pop(), True
        cgroupfs.make(request)
        self.made += 1
        return {"v": 1, "dirs": dict(request["dirs"]), "pool": True}, False

    def start(self, req: dict[str, Any], start: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Start the tree of spawn request ``req`` (a ``pool`` request) in a free or new group with
        ``start()`` (the fork server's own start, reading ``req["cgroup"]``); its answer, naming the
        group when it started, so the runner records the group it is in. A group it could not start in
        is removed (the runner removes the request's paths too, as for any failed start); one that was
        reused and could not be joined (removed meanwhile) is replaced by a new one, once."""
        request = req["cgroup"]
        reply: dict[str, Any] = {}
        for _ in range(2):
            try:
                req["cgroup"], reused = self.take(request)
            except OSError as exc:
                return {"op": "spawn_failed", "id": req["id"], "errno": exc.errno or errno.EIO,
                        "what": "cgroup"}  # fmt: skip
            reply = start()
            if reply["op"] == "spawned":
                return {**reply, "cgroup": req["cgroup"]}
            cgroupfs.remove(req["cgroup"])
            if not (reused and reply.get("what") == "cgroup"):
                break
        return reply

    def give_back(self, group: Group, *, killed: bool = False) -> bool:
        """Keep the empty group of a gone tree for the next one; False when it is not kept (not a
        pooled group, its tree was KILLed, the pool is full, or ``recycle`` refuses it): the caller
        removes it."""
        if killed or len(self._free) >= self._most or not cgroupfs.poolable(group):
            return False
        ready = cgroupfs.recycle(group)
        if ready is None:
            return False
        self._free.append(ready)
        return True

    def drain(self) -> list[Group]:
        """Every free group, no longer kept (the fork server removes them as it ends)."""
        free, self._free = self._free, []
        return free
