"""``RunningTrees``: the children a Supervisor holds, by key, and each one's tree record in the state
directory.

A child is added when its spawn is asked for and leaves when the fork server says its tree is
``gone`` (its record removed first: once ``Child.wait_gone`` returns, the tree is accounted for), when
its spawn never ran, or when the fork server is lost (every child then counts as killed). The record
(``leftovers.StateRecord``) is what the next start's sweep kills if this runner dies; a tree whose
record cannot be written runs on unrecorded, with an error logged.

Threads: the runner's main thread (add), the reader thread (started, gone, lost); every method takes
the Supervisor's condition, which also guards the spawns in flight.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
from typing import Any

from leasecore.process.linux.leftovers import StateRecord, TreeRecord
from leasecore.process.supervisor.child import Child, PendingStart
from leasecore.process.supervisor.killby import KillByTimes

__all__ = ["RunningTrees"]

log = logging.getLogger(__name__)


class RunningTrees:
    """Children by key and their records (see the module docstring)."""

    def __init__(self, cond: threading.Condition, record: StateRecord, kill_by: KillByTimes) -> None:
        self._cond = cond
        self.record = record
        self._kill_by = kill_by
        self._children: dict[str, Child] = {}

    def __len__(self) -> int:
        with self._cond:
            return len(self._children)

    def add(self, child: Child) -> None:
        with self._cond:
            self._children[child.key] = child

    def get(self, key: str) -> Child | None:
        with self._cond:
            return self._children.get(key)

    def discard(self, key: str) -> None:
        """A child whose spawn never ran."""
        with self._cond:
            self._children.pop(key, None)

    def children(self) -> list[Child]:
        with self._cond:
            return list(self._children.values())

    def started(self, pending: PendingStart, event: dict[str, Any]) -> None:
        """The fork server's ``spawned`` answer: the child runs, known by pid and start time now."""
        child = pending.child
        child.pid = int(event["pid"])
        start_time = int(event.get("start") or 0)  # read by the fork server, which holds the pid
        child.cgroup = event.get("cgroup", child.cgroup)  # the fork server's choice (GroupPool)
        record = dataclasses.replace(pending.record, pid=child.pid, start_time=start_time,
                                     cgroup=child.cgroup)  # fmt: skip
        try:
            with self._cond:
                self.record.add(record)
        except OSError as exc:  # the tree runs on unrecorded: only a crash of ours would lose it
            log.error("task %s: could not record its tree in the state directory: %s", child.key, exc)

    def gone(self, child: Child) -> None:
        """The fork server saw the child's whole tree gone: the record first, then the child."""
        with self._cond:
            self._children.pop(child.key, None)
            self._kill_by.gone(child.key)
            try:
                self.record.remove(child.key)
            finally:  # an unwritable record must not leave wait_gone waiting for ever
                child._on_gone()

    def all_killed(self) -> None:
        """A lost fork server: every tree it held was killed (by the caller); each child ends so."""
        with self._cond:
            for child in self._children.values():
                child._on_exit(None, signal.SIGKILL)
                child._on_gone()
                self.record.remove(child.key)
            self._children.clear()

    def trees(self) -> list[TreeRecord]:
        """The records of the trees held now."""
        with self._cond:
            return self.record.trees()
