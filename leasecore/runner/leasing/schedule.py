"""The lease engine core's pure parts: wake-up times, the queue of requests, an answer as an event.

Owns ``TimerHeap`` (one wake-up time per task: a heap of ``(when, arrival, key)`` entries with at most
one live time per key; scheduling a key again supersedes its older entry, skipped when it surfaces
and dropped by an occasional compaction, so the heap stays within a few times the live keys),
``SendQueue`` (heartbeats first, the most overdue first, then ownership checks in arrival order;
checks in flight capped and started no faster than the runner's ``CheckBudget``), ``Job`` (one queued
request) and ``Answer`` (a request's outcome as the ``Lease`` event it means, with constructors for
each outcome, so that the threaded engine and the simulator weigh an answer the same way).

Must not touch: clocks, threads, the port, logging. Plain data driven by ``core.EngineCore``.

Threads: none; not thread-safe (the threaded engine holds its lock around the core).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from leasecore.checkbudget import CheckBudget
from leasecore.lease import Action, CheckOwnership, Lease, SendHeartbeat
from leasecore.models import TaskOwnership

__all__ = [
    "Answer", "Job", "LeaseEvent", "SendQueue", "TimerHeap", "beat_acked", "beat_failed", "beat_not_found",
    "check_failed", "ownership_read",
]

_COMPACT_SLACK = 64  # superseded entries tolerated beyond 4 per live key before a compaction

LeaseEvent = Callable[[Lease, float], list[Action]]  # a Lease.on_* method: (lease, now) -> actions


class TimerHeap:
    """Wake-up times by key; ``pop_due(now)`` hands out the due keys, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, float] = {}
        self._arrival = itertools.count()
        # The earliest time scheduled since ``rearm``: whether a sleeper until then must wake, in one
        # read (no look at the heap's top, whose superseded entries ``earliest`` would drop first).
        self.scheduled_low = math.inf

    def __len__(self) -> int:
        """Keys with a wake-up time."""
        return len(self._live)

    @property
    def entries(self) -> int:
        """Entries held, superseded ones included (what ``compact`` bounds)."""
        return len(self._heap)

    def schedule(self, key: str, when: float | None) -> bool:
        """Set ``key``'s wake-up time (None: none); True when it was not already that time."""
        if self._live.get(key) == when:
            return False
        if when is None:
            del self._live[key]
            return True
        self._live[key] = when
        heapq.heappush(self._heap, (when, next(self._arrival), key))
        if when < self.scheduled_low:
            self.scheduled_low = when
        return True

    def rearm(self) -> float | None:
        """``earliest()``, and ``scheduled_low`` counts again from here (a sleeper until that time)."""
        self.scheduled_low = math.inf
        return self.earliest()

    def discard(self, key: str) -> None:
        """Forget ``key``'s wake-up time, if it has one."""
        self._live.pop(key, None)

    def earliest(self) -> float | None:
        """The earliest live wake-up time (None: nothing scheduled)."""
        self._drop_superseded()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> str | None:
        """The key whose time is earliest and at or before ``now`` (its time cleared), or None."""
        self._drop_superseded()
        if not self._heap or self._heap[0][0] > now:
            return None
        _, _, key = heapq.heappop(self._heap)
        del self._live[key]
        return key

    def compact(self) -> None:
        """Drop superseded entries once they outnumber the live ones by far (bounds the heap)."""
        if len(self._heap) > 4 * len(self._live) + _COMPACT_SLACK:
            self._heap = [(when, next(self._arrival), key) for key, when in self._live.items()]
            heapq.heapify(self._heap)

    def _drop_superseded(self) -> None:
        while self._heap and self._live.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)


@dataclass(frozen=True, eq=False)
class Job:
    """One request waiting for a sender: a lease's ``SendHeartbeat`` or ``CheckOwnership``."""

    task_id: str
    workflow_id: str
    action: SendHeartbeat | CheckOwnership
    min_attempt_seconds: float
    queued_at: float  # monotonic seconds
    task_type: str = ""  # the metrics' label


class SendQueue:
    """Requests waiting for a sender. Not thread-safe: the engine's lock."""

    def __init__(self, max_checks_calling: int, budget: CheckBudget) -> None:
        self._beats: list[tuple[float, int, Job]] = []  # heap by (due time, arrival)
        self._checks: deque[Job] = deque()
        self._arrival = itertools.count()
        self._max_checks_calling = max_checks_calling
        self._checks_calling = 0
        self._budget = budget

    def __len__(self) -> int:
        return len(self._beats) + len(self._checks)

    def push(self, job: Job) -> bool:
        """Queue ``job``. False for a check beyond the cap: it waits for a check in flight to end, so
        there is no sender to wake or add for it."""
        if isinstance(job.action, SendHeartbeat):
            heapq.heappush(self._beats, (job.action.due_at, next(self._arrival), job))
            return True
        self._checks.append(job)
        return len(self._checks) <= self._max_checks_calling - self._checks_calling

    def runnable(self, now: float) -> int:
        """How many queued requests a free sender may take now (checks beyond the cap or the budget
        wait)."""
        free_check_slots = max(0, self._max_checks_calling - self._checks_calling)
        if self._checks and free_check_slots:
            free_check_slots = min(free_check_slots, self._budget.available(now))
        return len(self._beats) + min(len(self._checks), free_check_slots)

    def budget_wait_seconds(self, now: float) -> float | None:
        """How long until the budget lets the first queued check go, when only the budget holds it
        back (None: it does not)."""
        if not self._checks or self._checks_calling >= self._max_checks_calling:
            return None
        wait = self._budget.wait_seconds(now)
        return wait if wait > 0 else None

    def pop(self) -> Job:
        """The next request (only while ``runnable``): the most overdue heartbeat, else the oldest check."""
        return heapq.heappop(self._beats)[2] if self._beats else self._checks.popleft()

    def check_started(self, now: float) -> None:
        """A popped check goes out: it counts against the cap and takes the budget's token."""
        self._checks_calling += 1
        self._budget.take(now)

    def check_done(self) -> bool:
        """A check in flight ended; True when a check held back by the cap may go now."""
        self._checks_calling -= 1
        return bool(self._checks)

    def withdraw_beats(self, task_id: str) -> bool:
        """Drop ``task_id``'s queued heartbeats (its final update begins); True when there were any."""
        if not self._beats:  # (the common case: no beat waits for a sender)
            return False
        queued = len(self._beats)
        self._beats = [b for b in self._beats if b[2].task_id != task_id]
        if len(self._beats) == queued:
            return False
        heapq.heapify(self._beats)
        return True

    def clear(self) -> None:
        """Drop everything queued (the engine stops)."""
        self._beats.clear()
        self._checks.clear()

    def queued_times(self) -> Iterator[float]:
        """When the waiting requests were queued (checks: only the oldest, they wait in order)."""
        yield from (job.queued_at for _, _, job in self._beats)
        if self._checks:
            yield self._checks[0].queued_at


@dataclass(frozen=True, eq=False)
class Answer:
    """A call's outcome as the lease's event. ``ok``: acknowledged (a beat) or answered (a check);
    ``beat_error``: a heartbeat's ``ConductorError``, for ``log_outcome``."""

    event: LeaseEvent
    ok: bool = False
    beat_error: str | None = None
    unknown_fate: bool = False  # no answer came: the request may still reach the server (finalcheck)


def beat_acked(sent_at: float) -> Answer:
    """A heartbeat sent at ``sent_at`` was acknowledged."""
    return Answer(functools.partial(Lease.on_heartbeat_ok, sent_at=sent_at), ok=True)


def beat_not_found() -> Answer:
    """A heartbeat answered 404: the server no longer knows the task."""
    return Answer(Lease.on_heartbeat_not_found)


def beat_failed(*, unknown_fate: bool, error: str | None = None) -> Answer:
    """A heartbeat failed (``unknown_fate``: no answer came, it may still reach the server)."""
    return Answer(Lease.on_heartbeat_failed, beat_error=error, unknown_fate=unknown_fate)


def ownership_read(ownership: TaskOwnership | None) -> Answer:
    """An ownership check was answered (None: the server does not know the task)."""
    return Answer(functools.partial(Lease.on_ownership, ownership=ownership), ok=True)


def check_failed() -> Answer:
    """An ownership check got no answer (the next one follows)."""
    return Answer(Lease.on_ownership_check_failed)
