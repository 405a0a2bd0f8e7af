"""The lease engine's scheduling as a pure core: ``EngineCore.step(event, now) -> effects``.

Owns every decision the lease engine makes about carrying leases out: each polled task's ``Lease``
(``leasebook``: which lease an event reaches), when to tick which lease (``schedule.TimerHeap``), the
requests waiting for a sender (``schedule.SendQueue``: heartbeats before checks, the checks' cap and
budget), at most one heartbeat of a lease in flight, a beat withdrawn for a final update, the beat a
final update must wait for (``AwaitBeat``), the beats of unknown fate (``late_beats``), retiring and
ending leases, the fences and kill-by times handed to the runner, and the metrics' bookkeeping.

Events are what the engine's callers and its threads observe (a task tracked, a child started or
exited, a tick, a sender free, a request answered, a final update begun/failed/acknowledged, a
shutdown); effects are what a driver must do (send this heartbeat or check with this timeout, fence
this task, move this task's kill-by times, wake the senders, wait for this beat, log/count this
outcome). ``next_wakeup()`` says when to step ``Tick`` next. Two drivers: ``engine.LeaseEngine``
(threads, HTTP, one lock around the core) and the simulator's runner (``leasecore.sim.runner``).

Must not touch: clocks (``now`` is handed in), threads, locks, the port, logging, processes.

Threads: none; not thread-safe (the threaded driver holds its lock around every call).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from leasecore.checkbudget import CheckBudget
from leasecore.lease import (
    Action,
    CheckOwnership,
    FenceAction,
    FenceReason,
    Lease,
    LeasePolicy,
    LeaseView,
    SendHeartbeat,
)
from leasecore.lease.finalcheck import LateBeats
from leasecore.models import Task
from leasecore.runner.leasing.leasebook import LeaseBook, LeaseEntry
from leasecore.runner.leasing.schedule import (
    Answer,
    Job,
    LeaseEvent,
    SendQueue,
    TimerHeap,
    beat_failed,
    check_failed,
)

__all__ = [
    "AwaitBeat", "BeatWaitOver", "BeginFinalUpdate", "ChildExited", "ChildStarted", "Effect", "EngineCore",
    "Event", "Fence", "FinalUpdateFailed", "KillBy", "Outcome", "Reported", "SendBeat", "SendCheck",
    "SenderFree", "Shutdown", "StartHeld", "Stop", "Tick", "Track", "WakeSenders",
]

LATENESS_SAMPLES = 10_000
# A final update waits for a beat in flight up to that call's own timeout plus this much.
FINAL_UPDATE_WAIT_SLACK_SECONDS = 1.0


# ----- events ------------------------------------------------------------------------------------
# Events and effects are values, never changed once made; plain slotted dataclasses, not frozen ones,
# because a frozen one costs three times as much to make and a heartbeat makes about six of them.


@dataclass(slots=True, eq=False)
class Track:
    """A polled task (``polled_at``: the poll's send time; None: now). A re-delivery acks its lease."""

    task: Task
    policy: LeasePolicy
    polled_at: float | None = None


@dataclass(slots=True, eq=False)
class StartHeld:
    """The runner holds the command back (its exec timeout counts from here)."""

    task_id: str


@dataclass(slots=True, eq=False)
class ChildStarted:
    task_id: str


@dataclass(slots=True, eq=False)
class ChildExited:
    task_id: str


@dataclass(slots=True, eq=False)
class Tick:
    """The time ``next_wakeup`` named came: tick every lease that is due."""


@dataclass(slots=True, eq=False)
class SenderFree:
    """A sender may take a request: the next one that may go now becomes a ``SendBeat``/``SendCheck``."""


@dataclass(slots=True, eq=False)
class Answered:
    """The request ``call_id`` (from a ``SendBeat``/``SendCheck``) ended with ``answer``."""

    call_id: int
    answer: Answer


@dataclass(slots=True, eq=False)
class BeginFinalUpdate:
    """The task's final update is about to be sent: exclude its heartbeats (``AwaitBeat`` if one calls)."""

    task_id: str


@dataclass(slots=True, eq=False)
class BeatWaitOver:
    """The driver stopped waiting for the beat ``AwaitBeat`` named (one still calling: unknown fate)."""

    task_id: str


@dataclass(slots=True, eq=False)
class FinalUpdateFailed:
    task_id: str


@dataclass(slots=True, eq=False)
class Reported:
    """The final update was acknowledged (``poll_count`` None), or the runner forgets the run delivered
    with ``poll_count`` (its lease ends only if it started no later)."""

    task_id: str
    poll_count: int | None = None


@dataclass(slots=True, eq=False)
class Shutdown:
    """Fence one task (None: all) for SHUTDOWN, now or at ``drain_deadline``; ``force``: KILL now."""

    task_id: str | None = None
    drain_deadline: float | None = None
    force: bool = False


@dataclass(slots=True, eq=False)
class Stop:
    """The engine stops: drop every queued request."""


Event = (Track | StartHeld | ChildStarted | ChildExited | Tick | SenderFree | Answered | BeginFinalUpdate
         | BeatWaitOver | FinalUpdateFailed | Reported | Shutdown | Stop)  # fmt: skip


# ----- effects -----------------------------------------------------------------------------------


@dataclass(slots=True)
class SendBeat:
    """Send one heartbeat now; feed its outcome back as ``Answered(call_id, ...)``."""

    call_id: int
    task_id: str
    workflow_id: str
    timeout_seconds: float
    sent_at: float


@dataclass(slots=True)
class SendCheck:
    """Read the task back now (ownership check); feed the outcome back as ``Answered(call_id, ...)``."""

    call_id: int
    task_id: str
    timeout_seconds: float


@dataclass(slots=True)
class Fence:
    task_id: str
    action: FenceAction


@dataclass(slots=True)
class KillBy:
    """The task's kill-by times moved (an ack), or None: its lease ended (the fork server's switch)."""

    task_id: str
    times: tuple[float, float] | None


@dataclass(slots=True)
class WakeSenders:
    """Requests wait: ``runnable`` may go now; ``grow``: a pool may add a sender for them (a new request;
    not for a check freed by the cap)."""

    runnable: int
    grow: bool = True


@dataclass(slots=True)
class AwaitBeat:
    """A heartbeat of the task is calling: wait (until ``beat_calling`` is False, at most until
    ``until``), then step ``BeatWaitOver``; only then send the final update."""

    task_id: str
    until: float


@dataclass(slots=True)
class Outcome:
    """One request's outcome, for the log and the metrics (``result``: ok, failed, lost; ``late``: how
    late a sent beat went out, None when it never went)."""

    task_id: str
    task_type: str
    kind: str  # "heartbeat" or "ownership"
    result: str
    late: float | None = None
    beat_error: str | None = None
    failed_before: int = 0
    failed_now: int = 0
    lost_before: str | None = None
    lost_now: str | None = None


Effect = SendBeat | SendCheck | Fence | KillBy | WakeSenders | AwaitBeat | Outcome


@dataclass(eq=False)
class _Call:
    entry: LeaseEntry
    job: Job
    late: float | None  # a beat's lateness when sent


class EngineCore:
    """Every lease of one runner and the scheduling of their requests, stepped by events.

    ``capacity``: the most requests carried out at once (checks in flight: half, at least one);
    ``check_budget``: how fast checks may start (None: no limit); ``kill_by``: emit ``KillBy``."""

    def __init__(self, *, random_source: Callable[[], float], capacity: int,
                 check_budget: CheckBudget | None = None, kill_by: bool = False) -> None:  # fmt: skip
        self._leases = LeaseBook(random_source)
        self._timer = TimerHeap()
        self._queue = SendQueue(max(1, capacity // 2), check_budget or CheckBudget(0.0))
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count(1)
        self._awaiting: dict[str, LeaseEntry] = {}  # a final update waits for this entry's beat
        self._kill_by = kill_by
        self.heartbeats_sent = 0
        self.lateness: deque[float] = deque(maxlen=LATENESS_SAMPLES)
        self._steps = self._by_event()

    def step(self, event: Event, now: float) -> list[Effect]:
        """Apply ``event`` at ``now`` (monotonic seconds); what the driver must do, in order."""
        return self._steps[type(event)](event, now)  # (by the event's class: no chain of isinstance)

    def _by_event(self) -> dict[type, Callable[[Any, float], list[Effect]]]:
        """Each event class's step."""
        on = self._on
        return {
            SenderFree: lambda event, now: self._take(now),
            Answered: self._answered,
            Tick: lambda event, now: self._tick(now),
            Track: self._track,
            StartHeld: lambda event, now: on(self._leases.get(event.task_id), Lease.on_start_held, now),
            ChildStarted: lambda event, now: on(self._leases.get(event.task_id), Lease.on_child_started, now),
            ChildExited: lambda event, now: on(self._leases.get(event.task_id), Lease.on_child_exited, now),
            BeginFinalUpdate: lambda event, now: self._begin_final_update(event.task_id, now),
            BeatWaitOver: lambda event, now: self._beat_wait_over(event.task_id),
            FinalUpdateFailed: self._final_update_failed,
            Reported: self._reported,
            Shutdown: self._shutdown,
            Stop: lambda event, now: self._stop(),
        }

    # ----- queries ---------------------------------------------------------------------------------

    def timer_due(self) -> float | None:
        """The earliest lease wake-up (None: none): when ``Tick`` has something to do."""
        return self._timer.earliest()

    @property
    def timer_heap(self) -> TimerHeap:
        """The lease wake-up times (for the timer thread: ``earliest`` and ``scheduled_low``)."""
        return self._timer

    def next_wakeup(self, now: float) -> float | None:
        """When to step next: the earliest lease wake-up, or when the check budget lets a queued check go."""
        times = [self._timer.earliest()]
        wait = self._queue.budget_wait_seconds(now)
        if wait is not None:
            times.append(now + wait)
        return min((t for t in times if t is not None), default=None)

    def runnable(self, now: float) -> int:
        """Queued requests a free sender may take now."""
        return self._queue.runnable(now)

    def budget_wait_seconds(self, now: float) -> float | None:
        return self._queue.budget_wait_seconds(now)

    def beat_calling(self, task_id: str) -> bool:
        """A heartbeat of the task's lease (the one a final update waits for, else the current) calls."""
        entry = self._awaiting.get(task_id) or self._leases.get(task_id)
        return entry is not None and entry.beat_calling_until is not None

    def entry(self, task_id: str) -> LeaseEntry | None:
        """The task's current lease and what is kept beside it (None: not tracked)."""
        return self._leases.get(task_id)

    def late_beats(self, task_id: str) -> LateBeats | None:
        """Until when a beat of the task with no answer may still reach the server (None: no such beat)."""
        entry = self._leases.in_final_update(task_id)
        if entry is None or entry.late_until is None:
            return None
        return LateBeats(entry.late_until, entry.lease.poll_count, entry.task.task_type)

    def fence_reason(self, task_id: str) -> FenceReason | None:
        entry = self._leases.get(task_id)
        return None if entry is None else entry.lease.fence_reason

    def view(self, task_id: str) -> LeaseView:
        """KeyError for an unknown (or already reported) task."""
        return self._leases[task_id].lease.view()

    def views(self) -> dict[str, LeaseView]:
        return {task_id: entry.lease.view() for task_id, entry in self._leases.items()}

    def retired(self) -> list[str]:
        return self._leases.retired()

    def tracked(self) -> int:
        return len(self._leases)

    def queued(self) -> int:
        return len(self._queue)

    def queued_times(self) -> Iterator[float]:
        return self._queue.queued_times()

    def calls_in_flight(self) -> int:
        return len(self._calls)

    # ----- events --------------------------------------------------------------------------------

    def _track(self, event: Track, now: float) -> list[Effect]:
        at = now if event.polled_at is None else min(event.polled_at, now)
        entry, actions = self._leases.admit(event.task, event.policy, at, now)
        return self._apply(entry, actions, now)

    def _tick(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        while (task_id := self._timer.pop_due(now)) is not None:
            entry = self._leases.get(task_id)
            if entry is not None:
                effects += self._apply(entry, entry.lease.on_tick(now), now)
        self._timer.compact()
        return effects

    def _take(self, now: float) -> list[Effect]:
        """The next request that may go now, marked in the same step as its pop: a final update then
        finds every beat of its task either still queued (withdrawn) or calling (waited for)."""
        while self._queue.runnable(now):
            job = self._queue.pop()
            entry = self._leases.get(job.task_id)
            if entry is None:
                continue  # reported meanwhile: never send it
            call_id = next(self._call_ids)
            if isinstance(job.action, CheckOwnership):
                self._queue.check_started(now)  # counts against the cap, takes the budget's token
                # It may have waited for the budget: bound its call by the lease as it is now.
                timeout = min(job.action.timeout_seconds, entry.lease.lease_deadline - now)
                self._calls[call_id] = _Call(entry, job, None)
                if timeout < job.min_attempt_seconds:  # too late to try: a failed check
                    return self._answered(Answered(call_id, check_failed()), now)
                return [SendCheck(call_id, job.task_id, timeout)]
            action = job.action
            timeout = min(action.timeout_seconds, action.expires_at - now)
            if timeout < job.min_attempt_seconds:  # waited too long for a sender: a failed beat
                self._calls[call_id] = _Call(entry, job, None)
                return self._answered(Answered(call_id, beat_failed(unknown_fate=False)), now)
            entry.beat_calling_until = now + max(0.0, timeout)
            late = now - action.due_at
            self.heartbeats_sent += 1
            self.lateness.append(late)
            self._calls[call_id] = _Call(entry, job, late)
            return [SendBeat(call_id, job.task_id, job.workflow_id, timeout, now)]
        return []

    def _answered(self, event: Answered, now: float) -> list[Effect]:
        call = self._calls.pop(event.call_id, None)
        if call is None:
            return []
        answer, job = event.answer, call.job
        effects: list[Effect] = []
        is_check = isinstance(job.action, CheckOwnership)
        if is_check:
            if self._queue.check_done():  # a check held back by the cap may go now
                effects.append(WakeSenders(self._queue.runnable(now), grow=False))
        elif call.late is not None:  # a beat that was sent: it no longer calls
            call.entry.beat_calling_until = None
            if answer.unknown_fate:
                call.entry.note_unknown_beat(now)
        entry = self._leases.get(job.task_id)  # (the current lease: the task's server lease is one)
        if entry is None:
            return effects
        lease = entry.lease
        failed_before, lost_before = lease.consecutive_failures, lease.lost_reason
        effects += self._apply(entry, answer.event(lease, now), now)
        if is_check:
            result = ("lost" if lease.lost_reason is not None else "ok") if answer.ok else "failed"
        else:
            result = "ok" if answer.ok else "failed"
        effects.append(Outcome(job.task_id, job.task_type, "ownership" if is_check else "heartbeat", result,
                               call.late, answer.beat_error, failed_before, lease.consecutive_failures,
                               lost_before, lease.lost_reason))  # fmt: skip
        return effects

    def _begin_final_update(self, task_id: str, now: float) -> list[Effect]:
        entry = self._leases.in_final_update(task_id)
        if entry is None:  # unknown, or a retired lease (inert: nothing to stop)
            return []
        actions = entry.lease.on_final_update_started(now)
        if self._queue.withdraw_beats(task_id):
            actions += entry.lease.on_heartbeat_withdrawn(now)
        effects = self._apply(entry, actions, now)
        if entry.beat_calling_until is not None:
            self._awaiting[task_id] = entry
            until = entry.beat_calling_until + FINAL_UPDATE_WAIT_SLACK_SECONDS
            effects.append(AwaitBeat(task_id, until))
        return effects

    def _beat_wait_over(self, task_id: str) -> list[Effect]:
        entry = self._awaiting.pop(task_id, None)
        if entry is not None and entry.beat_calling_until is not None:
            entry.note_unknown_beat(entry.beat_calling_until)  # it may be handled after the update
        return []

    def _reported(self, event: Reported, now: float) -> list[Effect]:
        self._awaiting.pop(event.task_id, None)  # (a driver that never stepped BeatWaitOver: no leak)
        if not self._leases.end(event.task_id, now, poll_count=event.poll_count):
            return []
        self._timer.discard(event.task_id)
        return [KillBy(event.task_id, None)] if self._kill_by else []

    def _shutdown(self, event: Shutdown, now: float) -> list[Effect]:
        """KeyError for an unknown task id."""
        if event.task_id is None:
            entries = [entry for _, entry in self._leases.items()]
        else:
            entries = [self._leases[event.task_id]]
        effects: list[Effect] = []
        for entry in entries:
            if event.force:
                actions = entry.lease.on_force_shutdown(now)
            else:
                actions = entry.lease.on_shutdown(now, event.drain_deadline)
            effects += self._apply(entry, actions, now)
        return effects

    # ----- internals -----------------------------------------------------------------------------

    def _on(self, entry: LeaseEntry | None, event: LeaseEvent, now: float) -> list[Effect]:
        return [] if entry is None else self._apply(entry, event(entry.lease, now), now)

    def _final_update_failed(self, event: FinalUpdateFailed, now: float) -> list[Effect]:
        return self._on(self._leases.in_final_update(event.task_id), Lease.on_final_update_failed, now)

    def _stop(self) -> list[Effect]:
        self._queue.clear()
        return []

    def _apply(self, entry: LeaseEntry, actions: Iterable[Action], now: float) -> list[Effect]:
        effects: list[Effect] = []
        task = entry.task
        for action in actions:
            if isinstance(action, SendHeartbeat | CheckOwnership):
                job = Job(task.task_id, task.workflow_id, action, entry.lease.policy.min_attempt_seconds, now,
                          task_type=task.task_type)  # fmt: skip
                if self._queue.push(job):
                    effects.append(WakeSenders(self._queue.runnable(now)))
            else:
                effects.append(Fence(task.task_id, action))
        self._timer.schedule(task.task_id, entry.lease.next_wakeup())
        if self._kill_by and (kill_by := entry.lease.kill_by()) != entry.kill_by_sent:
            entry.kill_by_sent = kill_by
            effects.append(KillBy(task.task_id, kill_by))
        return effects
