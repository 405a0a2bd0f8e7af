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
        # Between hold and release (one read of the fork server's messages) removals from the record
        # are held back: the trees gone meanwhile wait for their write (the next add's, or release's).
        self._holding = False
        self._gone_held: list[Child] = []
        self.batch = (self.hold, self.release)  # around each read of the fork server's messages

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
        held = pending.record  # (the fields by hand: dataclasses.replace costs ~3 us a task)
        record = TreeRecord(held.key, child.pid, start_time, held.token, held.tmpdir, held.meta, child.cgroup,
                            held.survivors)  # fmt: skip
        with self._cond:
            try:
                self.record.add(record)  # written now, with the removals held before it
            except OSError as exc:  # the tree runs on unrecorded: only a crash of ours would lose it
                log.error("task %s: could not record its tree in the state directory: %s", child.key, exc)
                self._unremoved(exc)
            finally:
                self._wake_gone()

    def gone(self, child: Child) -> None:
        """The fork server saw the child's whole tree gone: the record first, then the child (held:
        once the removal is written, with the next add or at ``release``)."""
        with self._cond:
            self._children.pop(child.key, None)
            self._kill_by.gone(child.key)
            if self._holding:  # first: whatever the record does, its wait_gone is woken
                self._gone_held.append(child)
                self.record.remove(child.key)
                return
            try:
                self.record.remove(child.key)
            finally:  # an unwritable record must not leave wait_gone waiting for ever
                child._on_gone()

    def hold(self) -> None:
        """From now until ``release``, removals from the record are held back and written together."""
        with self._cond:
            self._holding = True
            self.record.hold()

    def release(self) -> None:
        """Write the removals held since ``hold`` (one ``write``), then wake their trees' waiters."""
        with self._cond:
            self._holding = False
            try:
                self.record.flush()
            except OSError as exc:
                self._unremoved(exc)
            finally:  # an unwritable record must not leave wait_gone waiting for ever
                self._wake_gone()

    def _unremoved(self, exc: OSError) -> None:
        """The held removals were not written (a later sweep finds those trees' leaders gone: it
        kills nothing, and reports their tasks as a dead runner's)."""
        if self._gone_held:
            keys = ", ".join(child.key for child in self._gone_held)
            log.error("tasks %s: could not remove their trees from the state record: %s", keys, exc)

    def _wake_gone(self) -> None:
        gone, self._gone_held = self._gone_held, []
        for child in gone:
            child._on_gone()

    def all_killed(self) -> None:
        """A lost fork server: every tree it held was killed (by the caller); each child ends so."""
        with self._cond:
            if self._holding:  # (never: the reader releases before the fork server's end)
                self.release()
            for child in self._children.values():
                child._on_exit(None, signal.SIGKILL)
                child._on_gone()
                self.record.remove(child.key)
            self._children.clear()

    def trees(self) -> list[TreeRecord]:
        """The records of the trees held now."""
        with self._cond:
            return self.record.trees()
