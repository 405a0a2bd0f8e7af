"""The lease engine: every lease of this process on one timer thread plus a bounded pool of senders.

Owns the ``Lease`` objects (``leasecore.lease``), carries out their actions and feeds the outcomes
back. It must not touch processes: fencing is handed to the runner through ``on_fence``. It talks to
the server only through ``LeasePort`` (``runner.ports``; ``ConductorClient`` satisfies it).

Threads and locking:

* one timer thread sleeps on a ``Condition`` until the earliest wake-up in a heap of
  ``(when, task)`` entries; whoever makes a wake-up earlier notifies it. No polling loop.
* a pool of sender threads (``senders`` at start, growing up to ``max_senders`` while every sender is
  busy) runs ``SendHeartbeat`` / ``CheckOwnership`` so that one hanging request never delays the other
  leases. A lease never has two of its own heartbeats in flight (the state machine forbids it).
  Heartbeats (deadline-critical) go first: they wait in their own queue, ordered by due time, and a
  free sender always takes a heartbeat before an ownership check. Checks in flight are capped at half
  the pool (``max_senders // 2``, at least 1), so a burst of checks, or checks hanging on a slow
  server, never occupies the senders a heartbeat needs (with ``max_senders`` >= 2). Checks also
  start no faster than the runner's budget allows (``leasecore.checkbudget``, #23: at most
  ``ownership_check_rate`` per second, shared by every task, first come first served); one idle
  sender at a time waits for the budget's next token.
  Requests waiting for a sender show up in ``metrics()`` (``queued``, ``oldest_queued_seconds``).
* every ``Lease`` is touched only under the one engine lock; ``on_fence`` is called outside it, from
  the timer thread, a sender thread or the caller of ``shutdown``. It must be quick and must not call
  back into the engine synchronously (putting the fence on the runner's queue is the intended use).
* a task's final update excludes its heartbeats (DESIGN.md §4: none after the final update): a sender
  marks the beat it takes off the queue as calling in the same locked step, ``begin_final_update``
  withdraws queued beats and waits (bounded) for a calling one to return, and the lease starts no beat
  until ``final_update_failed`` or ``reported``.

Usage, as the runner drives it::

    engine = LeaseEngine(client, on_fence=lambda task_id, action: events.put((task_id, action)))
    engine.start()
    engine.track(task, LeasePolicy.from_task(task), polled_at=poll_sent_at)  # per polled task
    child = supervisor.spawn(task, spec, worker_id=worker_id)
    engine.child_started(task.task_id)            # the exec timeout counts from here
    ...                                           # TerminateTree/KillTree arrive through on_fence
    engine.child_exited(task.task_id)             # no more fencing; heartbeats go on
    if engine.fence_reason(task.task_id) is not FenceReason.OWNERSHIP_LOST:
        engine.begin_final_update(task.task_id)   # no heartbeat of this task overlaps the update
        try:
            client.update(result)                 # (the reporter retries: ``FinalUpdates`` does this)
        except ConductorError:
            engine.final_update_failed(task.task_id)  # beat again until the next attempt
            raise
    engine.reported(task.task_id)                 # heartbeats stop; the engine forgets the task
    ...
    engine.shutdown(None, drain_deadline=None)    # first signal (or drain_deadline=monotonic time)
    engine.shutdown(None, force=True)             # second signal: KillTree now
    engine.stop()                                 # last, after every report
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import math
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

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
from leasecore.models import Task, TaskResult
from leasecore.runner.ports import FinalUpdateGuard, LeasePort, UpdatePort

__all__ = ["EngineMetrics", "FinalUpdates", "LeaseEngine", "LeasePort"]

log = logging.getLogger(__name__)

_LATENESS_SAMPLES = 10_000
# begin_final_update waits for a beat in flight up to that call's own timeout plus this much.
_FINAL_UPDATE_WAIT_SLACK_SECONDS = 1.0


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
class _Entry:
    task: Task
    lease: Lease
    wake_at: float | None = None
    beat_calling_until: float | None = None  # a sender is in extend_lease, bounded by this time
    since_poll: int = 0  # the pollCount of the delivery that started this lease


@dataclass(frozen=True)
class _Job:
    task_id: str
    workflow_id: str
    action: SendHeartbeat | CheckOwnership
    min_attempt_seconds: float
    queued_at: float
    task_type: str = ""  # the metrics' label


Fences = list[tuple[str, FenceAction]]


class LeaseEngine:
    """Runs every task's lease: heartbeats, ownership checks and fence timing."""

    def __init__(
        self,
        port: LeasePort,
        on_fence: Callable[[str, FenceAction], None],
        *,
        clock: Clock | None = None,
        senders: int = 8,
        max_senders: int = 64,
        random_source: Callable[[], float] = random.random,
        observer: Observer = NO_METRICS,
        check_budget: CheckBudget | None = None,
    ) -> None:
        """``observer``: ``on_heartbeat`` / ``on_ownership_check`` per attempt (metrics).
        ``check_budget``: how fast ownership checks may start, for every task together (None: no
        limit, each goes when due)."""
        self._observer = observer
        if not 1 <= senders <= max_senders:
            raise ValueError(f"need 1 <= senders ({senders}) <= max_senders ({max_senders})")
        self._port = port
        self._on_fence = on_fence
        self._clock: Clock = clock or SystemClock()
        self._senders, self._max_senders = senders, max_senders
        self._random = random_source
        self._lock = threading.Lock()
        self._timer_cv = threading.Condition(self._lock)
        self._work_cv = threading.Condition(self._lock)
        self._beat_done_cv = threading.Condition(self._lock)  # a heartbeat call returned
        self._entries: dict[str, _Entry] = {}
        # Leases whose final update (a yield) is still unacknowledged while the task's next delivery
        # already has its own lease in ``_entries``: inert, kept only for FinalUpdates' calls.
        self._retired: dict[str, _Entry] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._timer_target = -math.inf  # what the timer sleeps until (-inf: it is awake)
        self._beats: list[tuple[float, int, _Job]] = []  # heap by (due time, arrival)
        self._checks: deque[_Job] = deque()
        self._checks_calling = 0
        self._max_checks_calling = max(1, max_senders // 2)
        self._check_budget = check_budget or CheckBudget(0.0)
        self._budget_waiter = False  # an idle sender sleeps until the budget's next token
        self._idle = 0
        self._threads: list[threading.Thread] = []
        self._started = self._stopping = False
        self._saturated_waits = self._heartbeats_sent = 0
        self._lateness: deque[float] = deque(maxlen=_LATENESS_SAMPLES)

    # ----- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer thread and the first ``senders`` sender threads."""
        with self._lock:
            if self._started:
                raise RuntimeError("the lease engine was already started")
            self._started = True
            self._spawn_locked(self._timer_loop, "lease-timer")
            for _ in range(self._senders):
                self._spawn_locked(self._sender_loop, f"lease-sender-{len(self._threads)}")

    def stop(self, timeout_seconds: float | None = None) -> None:
        """Stop and join every thread (a sender finishes its current request, bounded by its timeout)."""
        with self._lock:
            self._stopping = True
            self._beats.clear()
            self._checks.clear()
            self._timer_cv.notify_all()
            self._work_cv.notify_all()
            threads = list(self._threads)
        deadline = None if timeout_seconds is None else self._clock.monotonic() + timeout_seconds
        for thread in threads:
            left = None if deadline is None else max(0.0, deadline - self._clock.monotonic())
            thread.join(left)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("lease engine stopped with threads still busy: %s", ", ".join(alive))

    def alive(self) -> bool:
        """The timer thread runs (False before ``start``, after ``stop``, or if it died)."""
        return bool(self._threads) and self._threads[0].is_alive()

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
            queued = len(self._beats)
            self._beats = [b for b in self._beats if b[2].task_id != task_id]
            if len(self._beats) != queued:
                heapq.heapify(self._beats)
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
            return EngineMetrics(
                tracked=len(self._entries),
                senders=len(self._threads) - (1 if self._started else 0),
                busy_senders=len(self._threads) - (1 if self._started else 0) - self._idle,
                queued=len(self._beats) + len(self._checks),
                oldest_queued_seconds=now - min(self._queued_times(), default=now),
                saturated_waits=self._saturated_waits,
                heartbeats_sent=self._heartbeats_sent,
                heartbeat_lateness_p99_seconds=lateness[int(0.99 * (len(lateness) - 1))] if lateness else 0.0,
                heartbeat_lateness_max_seconds=lateness[-1] if lateness else 0.0,
            )

    # ----- internals: under the lock -------------------------------------------------------------

    def _queued_times(self) -> Iterable[float]:
        yield from (job.queued_at for _, _, job in self._beats)
        if self._checks:
            yield self._checks[0].queued_at

    def _runnable_locked(self) -> int:
        """How many queued requests a free sender may take now (checks beyond the cap or the budget
        wait)."""
        free_check_slots = max(0, self._max_checks_calling - self._checks_calling)
        if self._checks and free_check_slots:
            free_check_slots = min(free_check_slots, self._check_budget.available(self._clock.monotonic()))
        return len(self._beats) + min(len(self._checks), free_check_slots)

    def _budget_wait_locked(self) -> float | None:
        """How long an idle sender sleeps: until the budget lets the first queued check go, when
        only the budget holds it back and no other sender waits for that already; else untimed."""
        if self._budget_waiter or not self._checks or self._checks_calling >= self._max_checks_calling:
            return None
        wait = self._check_budget.wait_seconds(self._clock.monotonic())
        return wait if wait > 0 else None

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
        if wake != entry.wake_at:
            entry.wake_at = wake
            if wake is not None:
                heapq.heappush(self._heap, (wake, next(self._seq), entry.task.task_id))
                if wake < self._timer_target:
                    self._timer_cv.notify()
        return fences

    def _enqueue_locked(self, entry: _Entry, action: SendHeartbeat | CheckOwnership) -> None:
        job = _Job(
            entry.task.task_id,
            entry.task.workflow_id,
            action,
            entry.lease.policy.min_attempt_seconds,
            self._clock.monotonic(),
            task_type=entry.task.task_type,
        )
        if isinstance(action, SendHeartbeat):
            heapq.heappush(self._beats, (action.due_at, next(self._seq), job))
        else:
            self._checks.append(job)
            if len(self._checks) > self._max_checks_calling - self._checks_calling:
                return  # over the cap: it waits for a check in flight to end (no sender to add)
        if self._runnable_locked() <= self._idle:
            self._work_cv.notify()
        elif self._started and not self._stopping and len(self._threads) - 1 < self._max_senders:
            self._spawn_locked(self._sender_loop, f"lease-sender-{len(self._threads)}")
        elif self._started:
            self._saturated_waits += 1

    def _spawn_locked(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _fire_due_locked(self) -> Fences:
        now = self._clock.monotonic()
        fences: Fences = []
        while self._heap and self._heap[0][0] <= now:
            when, _, task_id = heapq.heappop(self._heap)
            entry = self._entries.get(task_id)
            if entry is None or entry.wake_at != when:
                continue  # superseded by a later reschedule, or forgotten
            entry.wake_at = None
            fences += self._apply_locked(entry, entry.lease.on_tick(now))
        if len(self._heap) > 4 * len(self._entries) + 64:  # drop superseded entries now and then
            live = [(e.wake_at, k) for k, e in self._entries.items() if e.wake_at is not None]
            self._heap = [(when, next(self._seq), k) for when, k in live]
            heapq.heapify(self._heap)
        return fences

    # ----- threads -------------------------------------------------------------------------------

    def _timer_loop(self) -> None:
        while True:
            with self._lock:
                self._timer_target = -math.inf
                fences = self._fire_due_locked()
                if not fences:
                    if self._stopping:
                        return
                    self._timer_target = self._heap[0][0] if self._heap else math.inf
                    wait = self._timer_target - self._clock.monotonic()
                    self._timer_cv.wait(None if wait == math.inf else max(0.0, wait))
                    continue
            self._deliver(fences)

    def _sender_loop(self) -> None:
        while True:
            with self._lock:
                while not self._runnable_locked() and not self._stopping:
                    timeout = self._budget_wait_locked()
                    self._budget_waiter = self._budget_waiter or timeout is not None
                    self._idle += 1
                    self._work_cv.wait(timeout)
                    self._idle -= 1
                    if timeout is not None:
                        self._budget_waiter = False
                if self._stopping:
                    return
                # Heartbeats first, the most overdue first; then checks, in order.
                job = heapq.heappop(self._beats)[2] if self._beats else self._checks.popleft()
                entry = self._entries.get(job.task_id)
                if entry is None:
                    continue  # reported meanwhile: never send it
                if isinstance(job.action, CheckOwnership):
                    self._checks_calling += 1  # in the same locked step as the pop: the cap holds
                    self._check_budget.take(self._clock.monotonic())
                    # It may have waited for the budget: bound its call by the lease as it is now.
                    check_expires_at = entry.lease.lease_deadline
                else:
                    # Marked in the same locked step as the pop: begin_final_update sees every beat
                    # either still queued (and withdraws it) or calling (and waits for it).
                    started = self._clock.monotonic()
                    entry.beat_calling_until = started + max(
                        0.0, min(job.action.timeout_seconds, job.action.expires_at - started)
                    )
            if isinstance(job.action, SendHeartbeat):
                try:
                    fences = self._send_heartbeat(job, job.action)
                finally:
                    with self._lock:
                        entry.beat_calling_until = None
                        self._beat_done_cv.notify_all()
                self._deliver(fences)
            else:
                try:
                    fences = self._check_ownership(job, job.action, check_expires_at)
                finally:
                    with self._lock:
                        self._checks_calling -= 1
                        if self._checks:  # a check held back by the cap may go now
                            self._work_cv.notify()
                self._deliver(fences)

    def _send_heartbeat(self, job: _Job, action: SendHeartbeat) -> Fences:
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

    def _check_ownership(self, job: _Job, action: CheckOwnership, expires_at: float) -> Fences:
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


_Guard = TypeVar("_Guard", bound=FinalUpdateGuard)


class FinalUpdates:
    """The reporter's update port: each attempt of a final update excludes that task's heartbeats.

    Wraps the client's ``update``: ``begin_final_update`` before each attempt, ``reported`` once it is
    acknowledged, ``final_update_failed`` when it raises (the reporter may retry: the task beats again
    meanwhile, so its lease outlives a slow report). The engine is attached once it exists (the runner
    makes it), so both can be built without an order between them::

        updates = FinalUpdates(client)
        make_engine = lambda on_fence: updates.attach(LeaseEngine(client, on_fence))
        make_reporter = lambda done: Reporter(updates, done)
    """

    def __init__(self, port: UpdatePort, engine: FinalUpdateGuard | None = None) -> None:
        self._port = port
        self._engine = engine

    def attach(self, engine: _Guard) -> _Guard:
        """Use ``engine`` from now on; returns it (for a factory's one-liner)."""
        self._engine = engine
        return engine

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        engine = self._engine
        if engine is None:
            raise RuntimeError("FinalUpdates.update before attach(): no lease engine to exclude")
        engine.begin_final_update(result.task_id)
        try:
            self._port.update(result, timeout_seconds=timeout_seconds)
        except BaseException:
            engine.final_update_failed(result.task_id)
            raise
        engine.reported(result.task_id)
