"""The lease engine: carries out every lease of this process; steppable by ``run_due``.

Owns the policy of carrying leases out. It keeps each polled task's ``Lease`` (``leasecore.lease``;
which lease a call reaches: ``leasebook``), queues their heartbeats and ownership checks for its
senders (``senders``: the queue and the executor), feeds each call's answer back (``leasecalls``),
hands fences to the runner through ``on_fence``, and keeps a task's final update apart from its beats
(``begin_final_update`` / ``final_update_failed`` / ``reported``, which ``finalupdates.FinalUpdates``
calls around each attempt). Wake-up times wait in the ``timer``; ``run_due()`` runs what is due at
the clock's now and returns: the timer thread does that on each wake-up, a test on a ``FakeClock``
calls it with ``InlineSenders`` (no threads at all).

Must not touch: processes (fencing is the runner's, through ``on_fence``), the server except through
``LeasePort`` (``runner.ports``; ``ConductorClient`` satisfies it), decisions about time (each
``Lease`` makes them).

Threads: ``lease-timer`` (``start``), the senders' threads, and the runner's loop calling the events.
Every lease is touched only under the one engine lock; ``on_fence`` is called outside it, from any of
those threads, and must be quick (putting it on a queue is the intended use).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections import deque
from collections.abc import Callable, Iterable

from leasecore.checkbudget import CheckBudget
from leasecore.clock import Clock, SystemClock
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
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task
from leasecore.runner.leasing.leasebook import LeaseBook, LeaseEntry
from leasecore.runner.leasing.leasecalls import Answer, extend_lease, log_outcome, read_ownership
from leasecore.runner.leasing.senders import Job, SenderExecutor, SendQueue, SendSource, ThreadedSenders
from leasecore.runner.leasing.timer import Timer
from leasecore.runner.ports import EngineMetrics, LeasePort

__all__ = ["EngineMetrics", "LeaseEngine", "LeasePort"]

log = logging.getLogger(__name__)

_LATENESS_SAMPLES = 10_000
# begin_final_update waits for a beat in flight up to that call's own timeout plus this much.
_FINAL_UPDATE_WAIT_SLACK_SECONDS = 1.0


Fences = list[tuple[str, FenceAction]]


class LeaseEngine:
    """Runs every task's lease: heartbeats, ownership checks and fence timing.

    Heartbeats (deadline-critical) go before ownership checks; checks in flight are capped at half the
    executor's capacity and start no faster than ``check_budget`` allows, so checks hanging on a
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
        engine.child_exited(task.task_id)             # no more fencing; beats wait for the update
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
        on_kill_by: Callable[[str, tuple[float, float] | None], None] | None = None,
    ) -> None:
        """``senders`` / ``max_senders``: the default executor's pool (``ThreadedSenders``); ``executor``
        replaces it (``InlineSenders``: requests carried out by ``run_due``'s caller).
        ``observer``: ``on_heartbeat`` / ``on_ownership_check`` per attempt (metrics).
        ``check_budget``: how fast ownership checks may start, for every task together (None: no
        limit, each goes when due). ``on_kill_by(task_id, Lease.kill_by() | None)``: when it moves (an
        ack) and None once the lease ends, outside the lock (the fork server's dead-man's switch)."""
        self._observer = observer
        self._port = port
        self._on_fence = on_fence
        self._clock: Clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._beat_done_cv = threading.Condition(self._lock)  # a heartbeat call returned
        self._leases = LeaseBook(random_source)
        self._timer = Timer(self._lock, self._clock)  # by task id: each current lease's next_wakeup()
        self._senders: SenderExecutor = executor or ThreadedSenders(senders, max_senders)
        self._queue = SendQueue(max(1, self._senders.capacity // 2), check_budget or CheckBudget(0.0))
        self._senders.bind(SendSource(self._lock, self._runnable_locked, self._budget_wait_locked,
                                      self._take_locked))  # fmt: skip
        self._started = False
        self._heartbeats_sent = 0
        self._lateness: deque[float] = deque(maxlen=_LATENESS_SAMPLES)
        self._on_kill_by = on_kill_by
        self._kill_bys: list[tuple[str, tuple[float, float] | None]] = []  # to hand out (``_deliver``)

    # ----- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the timer thread and the executor (the first ``senders`` sender threads)."""
        with self._lock:
            if self._started:
                raise RuntimeError("the lease engine was already started")
            self._senders.start_locked()  # (InlineSenders refuse: a stepped engine is never started)
            self._started = True
            self._timer.start_locked(self._fire_for_timer_locked)

    def stop(self, timeout_seconds: float | None = None) -> None:
        """Stop and join every thread (a sender finishes its current request, bounded by its timeout)."""
        with self._lock:
            self._queue.clear()
            threads = self._timer.stop_locked() + self._senders.stop_locked()
        deadline = None if timeout_seconds is None else self._clock.monotonic() + timeout_seconds
        for thread in threads:
            left = None if deadline is None else max(0.0, deadline - self._clock.monotonic())
            thread.join(left)
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            log.warning("lease engine stopped with threads still busy: %s", ", ".join(alive))

    def alive(self) -> bool:
        """The timer thread runs (False before ``start``, after ``stop``, or if it died)."""
        return self._timer.alive()

    def run_due(self) -> int:
        """Run every timer entry due at the clock's now, hand out the fences, then return their number.

        What the timer thread does on each wake-up. With an executor that works in its caller's thread
        (``InlineSenders``) the requests that may go are carried out here too, their answers fed back:
        a test advances a ``FakeClock`` to ``next_wakeup()`` and calls this, with no thread involved.
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
            times = [self._timer.earliest_locked()]
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
            entry, actions = self._leases.admit(task, policy, at, now)
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
        """The child is dead: no more fencing; no heartbeat before the final update unless the lease
        needs one, then heartbeats between its failed attempts until ``reported``."""
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
            entry = self._leases.in_final_update(task_id)
            if entry is None:  # unknown, or a retired lease (inert: nothing to stop)
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
            if entry.beat_calling_until is not None:  # it may be handled after the update: unknown fate
                entry.note_unknown_beat(entry.beat_calling_until)
        log.warning("task %s: a heartbeat call is still in flight past its timeout; sending the final "
                    "update anyway", task_id)  # fmt: skip
        return False

    def late_beats(self, task_id: str) -> LateBeats | None:
        """Until when a beat of ``task_id`` with no answer may still reach the server, and the lease's
        pollCount (None: no such beat, the common path); between begin_final_update and reported."""
        with self._lock:
            entry = self._leases.in_final_update(task_id)
            if entry is None or entry.late_until is None:
                return None
            return LateBeats(entry.late_until, entry.lease.poll_count, entry.task.task_type)

    def final_update_failed(self, task_id: str) -> None:
        """The final update failed and will be retried: heartbeat again meanwhile (an overdue beat now).

        A no-op while the task's lease is retired (its next delivery's own lease beats the task)."""
        self._event(task_id, lambda lease, now: lease.on_final_update_failed(now),
                    self._leases.in_final_update)  # fmt: skip

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        """The final update was acknowledged: no heartbeat starts after this returns; forget the task.

        Call ``begin_final_update`` before sending the update: it also waits out a heartbeat call
        already in flight, so none overlaps the update or follows it. Ends the lease in final update:
        a retired one first (``track``); ``poll_count`` (the runner's newest pollCount of the run it
        forgets) ends the current lease only if that lease started no later than that delivery.
        """
        with self._lock:
            if self._leases.end(task_id, self._clock.monotonic(), poll_count=poll_count):
                self._timer.discard_locked(task_id)
                if self._on_kill_by is not None:
                    self._kill_bys.append((task_id, None))
        self._deliver([])

    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None:
        """Fence one task (or all, for None) for SHUTDOWN: now, at ``drain_deadline``, or KILL now (force).

        KeyError for an unknown task id.
        """
        fences: Fences = []
        with self._lock:
            now = self._clock.monotonic()
            entries = [e for _, e in self._leases.items()] if task_id is None else [self._leases[task_id]]
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
            entry = self._leases.get(task_id)
            return None if entry is None else entry.lease.fence_reason

    def view(self, task_id: str) -> LeaseView:
        """A snapshot of one lease. KeyError for an unknown (or already reported) task."""
        with self._lock:
            return self._leases[task_id].lease.view()

    def views(self) -> dict[str, LeaseView]:
        """Snapshots of every tracked lease."""
        with self._lock:
            return {task_id: entry.lease.view() for task_id, entry in self._leases.items()}

    def retired(self) -> list[str]:
        """Tasks whose old lease still waits for its final update's acknowledgement (see ``track``)."""
        with self._lock:
            return self._leases.retired()

    def metrics(self) -> EngineMetrics:
        """Pool load and heartbeat lateness."""
        with self._lock:
            now = self._clock.monotonic()
            lateness = sorted(self._lateness)
            load = self._senders.load_locked()
            return EngineMetrics(
                tracked=len(self._leases),
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

    def _event(
        self,
        task_id: str,
        apply: Callable[[Lease, float], list[Action]],
        find: Callable[[str], LeaseEntry | None] | None = None,
    ) -> None:
        fences: Fences = []
        with self._lock:
            entry = (find or self._leases.get)(task_id)
            if entry is not None:
                fences = self._apply_locked(entry, apply(entry.lease, self._clock.monotonic()))
        self._deliver(fences)


    def _apply_locked(self, entry: LeaseEntry, actions: Iterable[Action]) -> Fences:
        fences: Fences = []
        for action in actions:
            if isinstance(action, SendHeartbeat | CheckOwnership):
                self._enqueue_locked(entry, action)
            else:
                fences.append((entry.task.task_id, action))
        self._timer.schedule_locked(entry.task.task_id, entry.lease.next_wakeup())
        if self._on_kill_by is not None and (kill_by := entry.lease.kill_by()) != entry.kill_by_sent:
            entry.kill_by_sent = kill_by
            self._kill_bys.append((entry.task.task_id, kill_by))
        return fences

    def _enqueue_locked(self, entry: LeaseEntry, action: SendHeartbeat | CheckOwnership) -> None:
        now = self._clock.monotonic()
        job = Job(entry.task.task_id, entry.task.workflow_id, action, entry.lease.policy.min_attempt_seconds,
                  now, task_type=entry.task.task_type)  # fmt: skip
        if self._queue.push(job):
            self._senders.work_queued_locked(self._queue.runnable(now))

    def _fire_due_locked(self) -> Fences:
        now = self._clock.monotonic()
        fences: Fences = []
        while (task_id := self._timer.pop_due_locked(now)) is not None:
            entry = self._leases.get(task_id)
            if entry is not None:
                fences += self._apply_locked(entry, entry.lease.on_tick(now))
        self._timer.compact_locked()
        return fences

    def _fire_for_timer_locked(self) -> Callable[[], None] | None:
        """The timer thread's wake-up: ``run_due``'s first half under the lock; the hand-out after."""
        fences = self._fire_due_locked()
        return functools.partial(self._deliver, fences) if fences or self._kill_bys else None

    def _take_locked(self) -> Callable[[], None] | None:
        """A sender's next request, popped in one locked step with its marking (``SendSource.take``)."""
        job = self._queue.pop()
        entry = self._leases.get(job.task_id)
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

    def _run_beat(self, entry: LeaseEntry, job: Job, action: SendHeartbeat) -> None:
        unknown = True  # (until the answer says otherwise)
        try:
            fences, unknown = self._send_heartbeat(job, action)
        finally:
            with self._lock:
                entry.beat_calling_until = None
                if unknown:
                    entry.note_unknown_beat(self._clock.monotonic())
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

    def _send_heartbeat(self, job: Job, action: SendHeartbeat) -> tuple[Fences, bool]:
        """Send one beat: (the fences its answer brings, whether its fate is unknown)."""
        sent_at = self._clock.monotonic()
        timeout = min(action.timeout_seconds, action.expires_at - sent_at)
        if timeout < job.min_attempt_seconds:  # waited too long for a sender: too late to try
            self._observer.on_heartbeat(job.task_type, False, None)
            return self._outcome(job.task_id, Answer(Lease.on_heartbeat_failed)), False
        late = sent_at - action.due_at  # for the metrics
        with self._lock:
            self._heartbeats_sent += 1
            self._lateness.append(late)
        answer = extend_lease(self._port, job.task_id, job.workflow_id, timeout_seconds=timeout,
                              sent_at=sent_at)  # fmt: skip
        self._observer.on_heartbeat(job.task_type, answer.ok, late)
        return self._outcome(job.task_id, answer), answer.unknown_fate

    def _check_ownership(self, job: Job, action: CheckOwnership, expires_at: float) -> Fences:
        timeout = min(action.timeout_seconds, expires_at - self._clock.monotonic())
        answer = Answer(Lease.on_ownership_check_failed)
        if timeout >= job.min_attempt_seconds:
            answer = read_ownership(self._port, job.task_id, timeout_seconds=timeout)
        fences = self._outcome(job.task_id, answer)
        if self._observer.enabled:  # "lost": the lease, having weighed the answer, holds the task lost
            with self._lock:
                entry = self._leases.get(job.task_id)
                lost = answer.ok and entry is not None and entry.lease.lost_reason is not None
            result = "lost" if lost else "ok" if answer.ok else "failed"
            self._observer.on_ownership_check(job.task_type, result)
        return fences

    def _outcome(self, task_id: str, answer: Answer) -> Fences:
        with self._lock:
            entry = self._leases.get(task_id)
            if entry is None:
                return []
            lease = entry.lease
            failed_before, lost_before = lease.consecutive_failures, lease.lost_reason
            fences = self._apply_locked(entry, answer.event(lease, self._clock.monotonic()))
            failed_now, lost_now = lease.consecutive_failures, lease.lost_reason
        log_outcome(task_id, failed_before=failed_before, failed_now=failed_now, beat_error=answer.beat_error,
                    lost_before=lost_before, lost_now=lost_now)  # fmt: skip
        return fences

    def _deliver(self, fences: Fences) -> None:
        if self._on_kill_by is not None and self._kill_bys:  # (whoever queued one delivers after: safe)
            with self._lock:
                kill_bys, self._kill_bys = self._kill_bys, []
            for task_id, kill_by in kill_bys:  # (in any order across threads: the switch keeps the latest)
                self._on_kill_by(task_id, kill_by)  # (KillByTimes.renew raises nothing)
        for task_id, action in fences:
            try:
                self._on_fence(task_id, action)
            except Exception:  # the runner's bug must not stop the timer: log it, fence the rest
                log.exception("task %s: on_fence(%s) failed", task_id, action)
