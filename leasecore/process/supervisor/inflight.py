"""``StartsInFlight``: the spawns asked of the fork server and not answered yet, and what became of
those given up.

A spawn is in flight from its request until the fork server's answer (``spawned`` or
``spawn_failed``). One left unanswered too long is given up (its task fails) but stays counted: it is
still queued at the fork server, so it holds room against ``max_starting``, and if it starts after
all (a late start) its tree is known by pid until it is gone, so that a fork server lost meanwhile
kills it too. The table holds no processes and does no I/O; the ``Supervisor`` acts on what it says,
and on what the fork server's answer means (``answer_meaning``, a pure table).

Threads: the runner's main thread (add, drop), the reader thread (answers, expiry, a lost fork
server). Every method takes the condition it is handed (the Supervisor's, a re-entrant lock, which
also guards the children), and a change that frees room notifies it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from enum import Enum
from typing import Any

from leasecore.process.linux.leftovers import TreeRecord
from leasecore.process.supervisor.child import PendingStart

__all__ = ["Answer", "StartsInFlight", "answer_meaning"]


class Answer(Enum):
    """What the Supervisor does with one answer of the fork server."""

    STARTED = "started"  # a spawn in flight runs: record its tree, read its pipes, call on_started
    FAILED = "failed"  # a spawn in flight could not start: its task fails with the reason
    KILL_LATE = "kill late"  # a command started whose spawn was given up (or is unknown): kill it
    NOTHING = "nothing"  # a call's answer, stats, or a given-up spawn that did not start


def answer_meaning(op: str, *, in_flight: bool, given_up: bool, call_answer: bool) -> Answer:
    """``op`` answered a spawn still ``in_flight``, one ``given_up``, or neither (then
    ``call_answer``: a waiting call took it)."""
    if in_flight:
        if op == "spawned":
            return Answer.STARTED
        return Answer.FAILED if op == "spawn_failed" else Answer.NOTHING
    if op == "spawned" and not call_answer:  # a command must not run unowned
        return Answer.KILL_LATE
    return Answer.NOTHING


class StartsInFlight:
    """Spawns unanswered (by request id), given up (their records), and late starts (by key)."""

    def __init__(self, cond: threading.Condition, max_starting: int) -> None:
        self._cond = cond
        self.max_starting = max_starting
        self._starting: dict[int, PendingStart] = {}
        self._given_up: dict[int, TreeRecord] = {}  # still queued at the fork server: they hold room
        self._late: dict[str, TreeRecord] = {}  # given up, started late, killed: until gone

    def __len__(self) -> int:
        """Spawns waiting for their answer (not counting those given up)."""
        with self._cond:
            return len(self._starting)

    def has_room(self) -> bool:
        """Another spawn may be sent (the caller waits on the condition for this)."""
        with self._cond:
            return len(self._starting) + len(self._given_up) < self.max_starting

    def add(self, pending: PendingStart) -> None:
        with self._cond:
            self._starting[pending.request_id] = pending

    def drop(self, pending: PendingStart) -> bool:
        """Take back a spawn whose request was never sent. False: it was ended already (given up or
        lost while the send was under way); a request that failed to go out gets no answer, so it
        holds no room either."""
        with self._cond:
            if self._starting.pop(pending.request_id, None) is None:
                if self._given_up.pop(pending.request_id, None) is not None:
                    self._cond.notify_all()
                return False
            self._cond.notify_all()  # room for a start waiting on max_starting
            return True

    def give_up(self, which: Callable[[PendingStart], bool]) -> list[PendingStart]:
        """Move the unanswered spawns ``which`` picks to the given-up ones; returns them to fail."""
        with self._cond:
            given_up = [pending for pending in self._starting.values() if which(pending)]
            for pending in given_up:
                del self._starting[pending.request_id]
                self._given_up[pending.request_id] = pending.record
            return given_up

    def answered(self, request_id: int, op: str, event: dict[str, Any]) -> tuple[PendingStart | None, bool]:
        """The fork server answered spawn ``request_id``: the pending start it ends (None: not one in
        flight), and whether it was one given up (a ``spawned`` one is then a late start, known by
        pid until ``gone``)."""
        with self._cond:
            pending = self._starting.pop(request_id, None)
            late = None if pending is not None else self._given_up.pop(request_id, None)
            if late is not None and op == "spawned":
                self._late[str(event.get("key"))] = dataclasses.replace(
                    late, pid=int(event["pid"]), start_time=int(event.get("start") or 0),
                    cgroup=event.get("cgroup", late.cgroup))  # fmt: skip
            if pending is not None or late is not None:
                self._cond.notify_all()  # room for a start waiting on max_starting
            return pending, late is not None

    def gone(self, key: str) -> None:
        """A late-started tree is gone: accounted for now."""
        with self._cond:
            self._late.pop(key, None)

    def take_all(self) -> tuple[list[PendingStart], list[TreeRecord]]:
        """A lost fork server: every spawn still unanswered (to fail), and the records of every tree
        that may have started unseen (unanswered, given up, late) to kill by token."""
        with self._cond:
            starting = list(self._starting.values())
            records = [p.record for p in starting] + list(self._given_up.values()) + list(self._late.values())
            self._starting.clear()
            self._given_up.clear()
            self._late.clear()
            return starting, records
