"""The lease engine: carries out every lease of this process, steppable by ``run_due``.

Owns the ``Lease`` objects (``leasecore.lease``) of the tasks being run, hands their heartbeats and
ownership checks to its senders (``leasecore.runner.senders``), feeds the answers back, hands the
fences to the runner through ``on_fence``, and keeps each task's final update apart from its beats
(``begin_final_update`` / ``final_update_failed`` / ``reported``; ``FinalUpdates`` makes those calls
around each attempt). Wake-up times wait in a ``TimerHeap`` (``leasecore.runner.timerheap``);
``run_due()`` runs whatever is due at the clock's now and returns: the timer thread loops on it, a
test on a ``FakeClock`` calls it with ``InlineSenders`` (no threads at all).

Must not touch: processes (fencing is the runner's, through ``on_fence``), the server except through
``LeasePort`` (``ConductorClient`` satisfies it), decisions about time (the ``Lease``'s).

Threads: ``lease-timer`` (``start``) sleeps on a condition until the earliest wake-up; the senders'
threads make the calls; the runner's loop calls the events. Every lease is touched only under the one
engine lock; ``on_fence`` is called outside it and must be quick (putting it on a queue).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from leasecore.checkbudget import CheckBudget
from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorError, ConductorNotFound
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
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskOwnership
from leasecore.runner.senders import Job, SenderExecutor, SendQueue, SendSource, ThreadedSenders
from leasecore.runner.timerheap import TimerHeap

__all__ = ["EngineMetrics", "LeaseEngine", "LeasePort"]

log = logging.getLogger(__name__)

_LATENESS_SAMPLES = 10_000
# begin_final_update waits for a beat in flight up to that call's own timeout plus this much.
_FINAL_UPDATE_WAIT_SLACK_SECONDS = 1.0


class LeasePort(Protocol):
    """The two server calls the engine makes (raising only ``leasecore.errors`` types)."""

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        """POST /api/tasks with extendLease; ``ConductorNotFound`` when the task is gone."""
        ...

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        """GET /api/tasks/{id}: the task's status, pollCount and workerId; None for a 404."""
        ...


@dataclass(frozen=True)
class EngineMetrics:
    """How the engine keeps up; ``queued`` > 0 for long means the sender pool is saturated."""

    tracked: int
    senders: int
    busy_senders: int
    queued: int
    oldest_queued_seconds: float
    saturated_waits: int  # requests that had to queue with every sender busy and the pool at max
    heartbeats_sent: int
    heartbeat_lateness_p99_seconds: float  # from due time to the port call, recent beats
    heartbeat_lateness_max_seconds: float


@dataclass


@dataclass
class _Entry:
    task: Task
    lease: Lease
    beat_calling_until: float | None = None  # a sender is in extend_lease, bounded by this time
    since_poll: int = 0  # the pollCount of the delivery that started this lease


Fences = list[tuple[str, FenceAction]]


class LeaseEngine:
    """Runs every task's lease: heartbeats, ownership checks and fence timing.

    Heartbeats (deadline-critical) go before ownership checks; checks in flight are capped at half the
    executor's capacity and start no faster than ``check_budget`` allows (#23), so checks hanging on a
    slow server never hold the senders a heartbeat needs. A lease never has two of its own heartbeats
    in flight. Requests waiting for a sender show in ``metrics()``. A task's final update excludes its
    heartbeats (DESIGN.md §4): a sender marks the beat it takes as calling in the same locked step,
    ``begin_final_update`` withdraws queued beats and waits (bounded) for a calling one, and the lease
    starts no beat until ``final_update_failed`` or ``reported``.

    Usage, as the runner drives it::

        engine = LeaseEngine(client, on_fence=lambda task_id, action: events.put((task_id, action)))
        engine.start()
        engine.track(task, LeasePolicy.from_task(task), polled_at=poll_sent_at)  # per polled task
        child = supervisor.spawn(task, spec, worker_id=worker_id)
        engine.child_started(task.task_id)            # the exec timeout counts from here
        ...                                           # TerminateTree/KillTree arrive through on_fence
        engine.child_exited(task.task_id)             # no more fencing; heartbeats go on
        if engine.fence_reason(task.task_id) is not FenceReason.OWNERSHIP_LOST:
            FinalUpdates(client, engine).update(result)  # begin_final_update, update, reported
        engine.reported(task.task_id, poll_count=task.poll_count)  # the runner forgets the run
        ...
        engine.shutdown(None, drain_deadline=None)    # first signal (or drain_deadline=monotonic time)
        engine.shutdown(None, force=True)             # second signal: KillTree now
        engine.stop()                                 # last, after every report

    Stepped instead (no threads)::

        clock, senders = FakeClock(), InlineSenders()
        engine = LeaseEngine(port, on_fence, clock=clock, executor=senders)
        engine.track(task, policy)
        clock.advance(engine.next_wakeup() - clock.monotonic())
        engine.run_due()                              # the due beat is sent, its answer fed back
    """

    def __init__(
        self,
        port: LeasePort,
        on_fence: Callable[[str, FenceAction], None],
        *,
        clock: Clock | None = None,
        senders: int = 8,
        max_senders: int = 64,
        executor: SenderExecutor | None = None,
        random_source: Callable[[], float] = random.random,
        observer: Observer = NO_METRICS,
        check_budget: CheckBudget | None = None,
    ) -> None:
        """``senders`` / ``max_senders``: the default executor's pool (``ThreadedSenders``); ``executor``
        replaces it (``InlineSenders``: requests carried out by ``run_due``'s caller).
        ``observer``: ``on_heartbeat`` / ``on_ownership_check`` per attempt (metrics).
        ``check_budget``: how fast ownership checks may start, for every task together (None: no
        limit, each goes when due)."""
        self._observer = observer
        self._port = port
        self._on_fence = on_fence
        self._clock: Clock = clock or SystemClock()
        self._random = random_source
        self._lock = threading.Lock()
        self._timer_cv = threading.Condition(self._lock)
        self._beat_done_cv = threading.Condition(self._lock)  # a heartbeat call returned
        self._entries: dict[str, _Entry] = {}
        # Leases whose final update (a yield) is still unacknowledged while the task's next delivery
        # already has its own lease in ``_entries``: inert, kept only for FinalUpdates' calls.
        self._retired: dict[str, _Entry] = {}
        self._timers = TimerHeap()  # by task id: each current lease's next_wakeup()
        self._timer_target = -math.inf  # what the timer sleeps until (-inf: it is awake)
        self._senders: SenderExecutor = executor or ThreadedSenders(senders, max_senders)
        self._queue = SendQueue(max(1, self._senders.capacity // 2), check_budget or CheckBudget(0.0))
        self._senders.bind(SendSource(self._lock, self._runnable_locked, self._budget_wait_locked,
                                      self._take_locked))  # fmt: skip
        self._timer: threading.Thread | None = None
        self._started = self._stopping = False
        self._heartbeats_sent = 0
        self._lateness: deque[float] = deque(maxlen=_LATENESS_SAMPLES)

    # ----- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer thread and the executor (the first ``senders`` sender threads)."""
        with self._lock:
            if self._started:
                raise RuntimeError("the lease engine was already started")
            self._started = True
            self._timer = threading.Thread(target=self._timer_loop, name="lease-timer", daemon=True)
            self._timer.start()
            self._senders.start_locked()

    def stop(self, timeout_seconds: float | None = None) -> None:
        """Stop and join every thread (a sender finishes its current request, bounded by its timeout)."""
        with self._lock:
            self._stopping = True
            self._queue.clear()
            self._timer_cv.notify_all()
            threads = ([self._timer] if self._timer is not None else []) + self._senders.stop_locked()
        deadline = None if timeout_seconds is None else self._clock.monotonic() + timeout_seconds
        for thread in threads:
            left = None if deadline is None else max(0.0, deadline - self._clock.monotonic())
            thread.join(left)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("lease engine stopped with threads still busy: %s", ", ".join(alive))

    def alive(self) -> bool:
        """The timer thread runs (False before ``start``, after ``stop``, or if it died)."""
        return self._timer is not None and self._timer.is_alive()

    def run_due(self) -> int:
        """Run every timer entry due at the clock's now, hand out the fences, then return their number.

        The timer thread's step. With an executor that works in its caller's thread (``InlineSenders``)
        the requests that may go are carried out here too, their answers fed back: a test advances a
        ``FakeClock`` to ``next_wakeup()`` and calls this, with no thread involved.
        """
        with self._lock:
            fences = self._fire_due_locked()
        self._deliver(fences)
        self._senders.run_ready()
        return len(fences)

    def next_wakeup(self) -> float | None:
        """When ``run_due`` next has something to do (monotonic seconds): the earliest timer entry, or
        when the check budget lets a queued check go. None: nothing scheduled."""
        with self._lock:
            times = [self._timers.earliest()]
            budget_wait = self._budget_wait_locked()
            if budget_wait is not None:
                times.append(self._clock.monotonic() + budget_wait)
            return min((t for t in times if t is not None), default=None)

    # ----- events from the runner ----------------------------------------------------------------

    def track(self, task: Task, policy: LeasePolicy, *, polled_at: float | None = None) -> None:
        """Start the lease of a polled task (``polled_at``: the poll's send time, default now).

        Tracking a task that is already tracked (the server delivered it again) keeps the running
        lease and counts the new poll as an ack: the poll reset the server's updateTime, and the new
        pollCount is ours (an ownership check then does not take it for someone else's poll).

        Except a newer delivery of a task whose final update is in flight (``Lease.is_new_delivery``:
        a yield re-queued at once): that is the task's next run, with a new lease of its own. The old
        lease is retired (inert) and ends with its update's ``reported``; ``reported`` with a
        ``poll_count`` older than the new delivery never ends the new lease.
        """
        fences: Fences = []
        with self._lock:
            now = self._clock.monotonic()
            at = now if polled_at is None else min(polled_at, now)
            entry = self._entries.get(task.task_id)
            if entry is not None and entry.lease.is_new_delivery(task.poll_count):
                entry.lease.on_reported(now)  # no action ever again; its update's calls still find it
                self._retired[task.task_id] = entry
                entry = None
            if entry is None:
                lease = Lease(policy, at, poll_count=task.poll_count, random=self._random)
                entry = _Entry(task, lease, since_poll=task.poll_count)
                self._entries[task.task_id] = entry
                actions = entry.lease.on_tick(now)
            else:
                actions = entry.lease.on_redelivered(now, at, task.poll_count)
            fences = self._apply_locked(entry, actions)
        self._deliver(fences)

    def start_held(self, task_id: str) -> None:
        """The runner holds the command back (``StartGate``): its exec timeout counts from its start."""
        self._event(task_id, lambda lease, now: lease.on_start_held(now))

    def child_started(self, task_id: str) -> None:
        """The child is being started (its spawn is asked for; the runner does not wait for the exec):
        its exec timeout counts from now."""
        self._event(task_id, lambda lease, now: lease.on_child_started(now))

    def child_exited(self, task_id: str) -> None:
        """The child is dead: no more fencing, but heartbeats go on until ``reported``."""
        self._event(task_id, lambda lease, now: lease.on_child_exited(now))

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool:
        """The final update of ``task_id`` is about to be sent: exclude its heartbeats.

        From here no heartbeat (or ownership check) of the task starts; queued ones are withdrawn, and
        a heartbeat call in flight is waited for, up to ``timeout_seconds`` (default: that call's
        own timeout + 1 s). True when no heartbeat call is in flight on return (always, for a task the
        engine does not know); False when the wait ran out (a port that ignores its timeout). Follow
        it with ``reported`` once the update is acknowledged, or ``final_update_failed``.
        """
        with self._lock:
            entry = self._entries.get(task_id)
            if entry is None or task_id in self._retired:  # (a retired lease is inert: nothing to stop)
                return True
            now = self._clock.monotonic()
            actions = entry.lease.on_final_update_started(now)
            if self._queue.withdraw_beats(task_id):
                actions += entry.lease.on_heartbeat_withdrawn(now)
            fences = self._apply_locked(entry, actions)
        self._deliver(fences)
        with self._lock:
            if entry.beat_calling_until is None:
                return True
            if timeout_seconds is None:
                until = entry.beat_calling_until + _FINAL_UPDATE_WAIT_SLACK_SECONDS
                timeout_seconds = max(0.0, until - self._clock.monotonic())
            if self._beat_done_cv.wait_for(lambda: entry.beat_calling_until is None, timeout_seconds):
                return True
        log.warning("task %s: a heartbeat call is still in flight past its timeout; sending the final "
                    "update anyway", task_id)  # fmt: skip
        return False

    def final_update_failed(self, task_id: str) -> None:
        """The final update failed and will be retried: heartbeat again meanwhile (an overdue beat now).

        A no-op while the task's lease is retired (its next delivery's own lease beats the task)."""
        if task_id in self._retired:
            return
        self._event(task_id, lambda lease, now: lease.on_final_update_failed(now))

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        """The final update was acknowledged: no heartbeat starts after this returns; forget the task.

        Call ``begin_final_update`` before sending the update: it also waits out a heartbeat call
        already in flight, so none overlaps the update or follows it. Ends the lease in final update:
        a retired one first (``track``); ``poll_count`` (the runner's newest pollCount of the run it
        forgets) ends the current lease only if that lease started no later than that delivery.
        """
        with self._lock:
            entry = self._entries.get(task_id)
            if poll_count is None:  # the update's acknowledgement: the lease in final update
                current = task_id not in self._retired
            else:  # the runner forgets a run: the current lease only if it is that run's
                current = entry is not None and poll_count >= entry.since_poll
            if current:
                self._entries.pop(task_id, None)
                self._timers.discard(task_id)
            else:
                entry = self._retired.pop(task_id, None)  # never the newer delivery's lease
            if entry is not None:
                entry.lease.on_reported(self._clock.monotonic())

    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None:
        """Fence one task (or all, for None) for SHUTDOWN: now, at ``drain_deadline``, or KILL now (force).

        KeyError for an unknown task id.
        """
        fences: Fences = []
        with self._lock:
            now = self._clock.monotonic()
            entries = list(self._entries.values()) if task_id is None else [self._entries[task_id]]
            for entry in entries:
                if force:
                    actions = entry.lease.on_force_shutdown(now)
                else:
                    actions = entry.lease.on_shutdown(now, drain_deadline)
                fences += self._apply_locked(entry, actions)
        self._deliver(fences)

    # ----- queries -------------------------------------------------------------------------------

    def fence_reason(self, task_id: str) -> FenceReason | None:
        """Why the task's tree was fenced (None: it was not, or the task is not tracked)."""
        with self._lock:
            entry = self._entries.get(task_id)
            return None if entry is None else entry.lease.fence_reason

    def view(self, task_id: str) -> LeaseView:
        """A snapshot of one lease. KeyError for an unknown (or already reported) task."""
        with self._lock:
            return self._entries[task_id].lease.view()

    def views(self) -> dict[str, LeaseView]:
        """Snapshots of every tracked lease."""
        with self._lock:
            return {task_id: entry.lease.view() for task_id, entry in self._entries.items()}

    def retired(self) -> list[str]:
        """Tasks whose old lease still waits for its final update's acknowledgement (see ``track``)."""
        with self._lock:
            return list(self._retired)


    def metrics(self) -> EngineMetrics:
        """Pool load and heartbeat lateness."""
        with self._lock:
            now = self._clock.monotonic()
            lateness = sorted(self._lateness)
            load = self._senders.load_locked()
            return EngineMetrics(
                tracked=len(self._entries),
                senders=load.senders,
                busy_senders=load.busy,
                queued=len(self._queue),
                oldest_queued_seconds=now - min(self._queue.queued_times(), default=now),
                saturated_waits=load.saturated_waits,
                heartbeats_sent=self._heartbeats_sent,
                heartbeat_lateness_p99_seconds=lateness[int(0.99 * (len(lateness) - 1))] if lateness else 0.0,
                heartbeat_lateness_max_seconds=lateness[-1] if lateness else 0.0,
            )

    # ----- internals: under the lock -------------------------------------------------------------

    def _runnable_locked(self) -> int:
        return self._queue.runnable(self._clock.monotonic())

    def _budget_wait_locked(self) -> float | None:
        return self._queue.budget_wait_seconds(self._clock.monotonic())

    def _event(self, task_id: str, apply: Callable[[Lease, float], list[Action]]) -> None:
        fences: Fences = []
        with self._lock:
            entry = self._entries.get(task_id)
            if entry is not None:
                fences = self._apply_locked(entry, apply(entry.lease, self._clock.monotonic()))
        self._deliver(fences)


    def _apply_locked(self, entry: _Entry, actions: Iterable[Action]) -> Fences:
        fences: Fences = []
        for action in actions:
            if isinstance(action, SendHeartbeat | CheckOwnership):
                self._enqueue_locked(entry, action)
            else:
                fences.append((entry.task.task_id, action))
        wake = entry.lease.next_wakeup()
        if self._timers.schedule(entry.task.task_id, wake) and wake is not None and wake < self._timer_target:
            self._timer_cv.notify()
        return fences

    def _enqueue_locked(self, entry: _Entry, action: SendHeartbeat | CheckOwnership) -> None:
        now = self._clock.monotonic()
        job = Job(entry.task.task_id, entry.task.workflow_id, action, entry.lease.policy.min_attempt_seconds,
                  now, task_type=entry.task.task_type)  # fmt: skip
        if self._queue.push(job):
            self._senders.work_queued_locked(self._queue.runnable(now))

    def _fire_due_locked(self) -> Fences:
        now = self._clock.monotonic()
        fences: Fences = []
        while (task_id := self._timers.pop_due(now)) is not None:
            entry = self._entries.get(task_id)
            if entry is not None:
                fences += self._apply_locked(entry, entry.lease.on_tick(now))
        self._timers.compact()
        return fences

    def _take_locked(self) -> Callable[[], None] | None:
        """A sender's next request, popped in one locked step with its marking (``SendSource.take``)."""
        job = self._queue.pop()
        entry = self._entries.get(job.task_id)
        if entry is None:
            return None  # reported meanwhile: never send it
        now = self._clock.monotonic()
        if isinstance(job.action, CheckOwnership):
            self._queue.check_started(now)  # in the same locked step as the pop: the cap holds
            # It may have waited for the budget: bound its call by the lease as it is now.
            return functools.partial(self._run_check, job, job.action, entry.lease.lease_deadline)
        # Marked in the same locked step as the pop: begin_final_update sees every beat either still
        # queued (and withdraws it) or calling (and waits for it).
        action = job.action
        entry.beat_calling_until = now + max(0.0, min(action.timeout_seconds, action.expires_at - now))
        return functools.partial(self._run_beat, entry, job, action)

    # ----- threads -------------------------------------------------------------------------------

    def _timer_loop(self) -> None:
        while True:
            if self.run_due():
                continue  # handing the fences out took time: look again before sleeping
            with self._lock:
                if self._stopping:
                    return
                wake = self._timers.earliest()
                self._timer_target = math.inf if wake is None else wake
                wait = self._timer_target - self._clock.monotonic()
                if wait > 0:
                    self._timer_cv.wait(None if wait == math.inf else wait)
                self._timer_target = -math.inf

    def _run_beat(self, entry: _Entry, job: Job, action: SendHeartbeat) -> None:
        try:
            fences = self._send_heartbeat(job, action)
        finally:
            with self._lock:
                entry.beat_calling_until = None
                self._beat_done_cv.notify_all()
        self._deliver(fences)

    def _run_check(self, job: Job, action: CheckOwnership, expires_at: float) -> None:
        try:
            fences = self._check_ownership(job, action, expires_at)
        finally:
            with self._lock:
                if self._queue.check_done():  # a check held back by the cap may go now
                    self._senders.notify_locked()
        self._deliver(fences)

    def _send_heartbeat(self, job: Job, action: SendHeartbeat) -> Fences:
        sent_at = self._clock.monotonic()
        timeout = min(action.timeout_seconds, action.expires_at - sent_at)
        outcome: Callable[[Lease, float], list[Action]]
        late: float | None = None  # sent minus due, for the metrics (None: never sent)
        ok = False
        if timeout < job.min_attempt_seconds:  # waited too long for a sender: too late to try
            outcome = Lease.on_heartbeat_failed
        else:
            late = sent_at - action.due_at
            with self._lock:
                self._heartbeats_sent += 1
                self._lateness.append(late)
            try:
                self._port.extend_lease(job.task_id, job.workflow_id, timeout_seconds=timeout)
                outcome = functools.partial(Lease.on_heartbeat_ok, sent_at=sent_at)
                ok = True
            except ConductorNotFound:
                log.warning("task %s: the server no longer knows it (404 on a heartbeat)", job.task_id)
                outcome = Lease.on_heartbeat_not_found
            except ConductorError as exc:
                self._observer.on_heartbeat(job.task_type, False, late)
                return self._outcome(job.task_id, Lease.on_heartbeat_failed, beat_error=str(exc))
            except Exception:  # a bug in the port must not leave the lease waiting forever
                log.exception("task %s: heartbeat raised unexpectedly", job.task_id)
                outcome = Lease.on_heartbeat_failed
        self._observer.on_heartbeat(job.task_type, ok, late)
        return self._outcome(job.task_id, outcome)

    def _check_ownership(self, job: Job, action: CheckOwnership, expires_at: float) -> Fences:
        started = self._clock.monotonic()
        timeout = min(action.timeout_seconds, expires_at - started)
        outcome: Callable[[Lease, float], list[Action]] = Lease.on_ownership_check_failed
        answered = False
        if timeout >= job.min_attempt_seconds:
            try:
                ownership = self._port.get_task_ownership(job.task_id, timeout_seconds=timeout)
                outcome = functools.partial(Lease.on_ownership, ownership=ownership)
                answered = True
            except ConductorError as exc:
                log.warning("task %s: ownership check failed: %s", job.task_id, exc)
            except Exception:
                log.exception("task %s: ownership check raised unexpectedly", job.task_id)
        fences = self._outcome(job.task_id, outcome, log_loss=True)
        if self._observer.enabled:  # "lost": the lease, having weighed the answer, holds the task lost
            lost = answered and self._lost_reason(job.task_id) is not None
            result = "lost" if lost else "ok" if answered else "failed"
            self._observer.on_ownership_check(job.task_type, result)
        return fences

    def _lost_reason(self, task_id: str) -> str | None:
        with self._lock:
            entry = self._entries.get(task_id)
            return entry.lease.lost_reason if entry is not None else None

    def _outcome(
        self,
        task_id: str,
        outcome: Callable[[Lease, float], list[Action]],
        *,
        log_loss: bool = False,
        beat_error: str | None = None,
    ) -> Fences:
        with self._lock:
            entry = self._entries.get(task_id)
            if entry is None:
                return []
            known = entry.lease.lost_reason
            failed_before = entry.lease.consecutive_failures
            fences = self._apply_locked(entry, outcome(entry.lease, self._clock.monotonic()))
            why = entry.lease.lost_reason
            failed_now = entry.lease.consecutive_failures
        if beat_error is not None:
            # Once per task per outage (its retries at debug level): with hundreds of tasks and the
            # server away, a line per attempt was thousands of lines a minute.
            level = logging.WARNING if failed_before == 0 else logging.DEBUG
            log.log(level, "task %s: heartbeat failed: %s (retrying until the lease deadline)", task_id,
                    beat_error)  # fmt: skip
        elif failed_before and not failed_now:
            log.info("task %s: heartbeat acknowledged again after %d failed", task_id, failed_before)
        if log_loss and why is not None and known is None:
            log.warning("task %s: no longer ours: %s", task_id, why)
        return fences

    def _deliver(self, fences: Fences) -> None:
        for task_id, action in fences:
            try:
                self._on_fence(task_id, action)
            except Exception:  # the runner's bug must not stop the timer: log it, fence the rest
                log.exception("task %s: on_fence(%s) failed", task_id, action)
