"""The lease engine's book of leases: which lease of a task an event or a final update reaches.

Owns the per-delivery bookkeeping. A task has one *current* lease, started by its first delivery and
acked by re-deliveries of the same run; and, while a yield's final update is unacknowledged but the
task was already polled back (its next run: ``Lease.is_new_delivery``), one *retired* lease, inert,
kept only so that the update's ``begin_final_update`` / ``final_update_failed`` / ``reported`` reach
it and never the next run's lease. ``LeaseEntry`` carries what the engine keeps beside each lease
(the beat call in flight, the delivery that started it).

Must not touch: time (``now`` is handed in), the queues, the timer, the port, locks: the engine calls
it under its lock and carries out the actions it returns.

Threads: none of its own, and not thread-safe: the engine's lock (timer thread, senders, the runner's
loop).
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView
from dataclasses import dataclass

from leasecore.lease import Action, Lease, LeasePolicy
from leasecore.lease.finalcheck import beat_may_land_until
from leasecore.models import Task

__all__ = ["LeaseBook", "LeaseEntry"]


@dataclass(eq=False)
class LeaseEntry:
    """One lease and what the engine keeps beside it."""

    task: Task
    lease: Lease
    beat_calling_until: float | None = None  # a sender is in extend_lease, bounded by this time
    since_poll: int = 0  # the pollCount of the delivery that started this lease
    late_until: float | None = None  # a beat of unknown fate may reach the server until then (finalcheck)
    kill_by_sent: tuple[float, float] | None = None  # the lease's kill-by times last handed to on_kill_by

    def note_unknown_beat(self, gave_up_at: float) -> None:
        """A beat got no answer by ``gave_up_at``: it may still reach the server for a while."""
        until = beat_may_land_until(gave_up_at)
        self.late_until = until if self.late_until is None else max(self.late_until, until)


class LeaseBook:
    """Current leases by task id, and the retired ones still waiting for their final update's ack."""

    def __init__(self, random: Callable[[], float]) -> None:
        self._random = random  # each new lease's jitter source
        self._current: dict[str, LeaseEntry] = {}
        self._retired: dict[str, LeaseEntry] = {}

    def __len__(self) -> int:
        """Current leases."""
        return len(self._current)

    def __getitem__(self, task_id: str) -> LeaseEntry:
        """The current lease of ``task_id``; KeyError when there is none."""
        return self._current[task_id]

    def get(self, task_id: str) -> LeaseEntry | None:
        """The current lease of ``task_id`` (None: not tracked)."""
        return self._current.get(task_id)

    def items(self) -> ItemsView[str, LeaseEntry]:
        """Every current lease by task id."""
        return self._current.items()

    def retired(self) -> list[str]:
        """Tasks whose retired lease still waits for its final update's acknowledgement."""
        return list(self._retired)

    def admit(
        self, task: Task, policy: LeasePolicy, polled_at: float, now: float
    ) -> tuple[LeaseEntry, list[Action]]:
        """A poll delivered ``task``: the lease it belongs to and that lease's actions now.

        A new task gets a new lease. A re-delivery of the running task is an ack of its lease (the new
        pollCount is ours), except a newer delivery of a task in final update: the old lease retires and
        the new run gets a lease of its own.
        """
        entry = self._current.get(task.task_id)
        if entry is not None and entry.lease.is_new_delivery(task.poll_count):
            entry.lease.on_reported(now)  # no action ever again; its update's calls still find it
            self._retired[task.task_id] = entry
            entry = None
        if entry is None:
            lease = Lease(policy, polled_at, poll_count=task.poll_count, random=self._random)
            entry = LeaseEntry(task, lease, since_poll=task.poll_count)
            self._current[task.task_id] = entry
            return entry, entry.lease.on_tick(now)
        return entry, entry.lease.on_redelivered(now, polled_at, task.poll_count)

    def in_final_update(self, task_id: str) -> LeaseEntry | None:
        """The lease that ``begin_final_update`` / ``final_update_failed`` act on: the current one,
        unless the lease in final update is retired (inert: nothing to do). None: nothing to do."""
        return None if task_id in self._retired else self._current.get(task_id)

    def end(self, task_id: str, now: float, *, poll_count: int | None = None) -> bool:
        """``reported``: end the lease in final update (a retired one first), or, with ``poll_count``
        (the runner forgets a run), the current lease only if it started no later than that delivery.
        True when the current lease ended (the engine forgets its timer)."""
        entry = self._current.get(task_id)
        if poll_count is None:  # the update's acknowledgement: the lease in final update
            current = task_id not in self._retired
        else:  # the runner forgets a run: the current lease only if it is that run's
            current = entry is not None and poll_count >= entry.since_poll
        if current:
            self._current.pop(task_id, None)
        else:
            entry = self._retired.pop(task_id, None)  # never the newer delivery's lease
        if entry is not None:
            entry.lease.on_reported(now)
        return current
