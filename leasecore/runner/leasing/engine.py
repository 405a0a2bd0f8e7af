"""The lease engine: the threaded driver of the engine core; steppable by ``run_due``.

Owns the threads and the I/O of carrying leases out. Every decision (which lease to tick when, the
requests waiting for a sender, one beat in flight per lease, a final update's exclusion of its beats,
retiring and ending leases, fences and kill-by times) is ``core.EngineCore``'s: this module steps it
under one lock with the clock's now and carries its effects out: the requests (``leasecalls``, on the
senders of ``senders``: the executor), the fences through ``on_fence``, the kill-by times through
``on_kill_by``, the log lines and metrics of each outcome, and ``begin_final_update``'s bounded wait
for a beat in flight. Wake-up times come from the core; the ``timer`` thread steps ``Tick`` when they
come, and ``run_due()`` does the same for a test on a ``FakeClock`` with ``InlineSenders`` (no threads).

Must not touch: processes (fencing is the runner's, through ``on_fence``), the server except through
``LeasePort`` (``runner.ports``; ``ConductorClient`` satisfies it), decisions (the core's and each
``Lease``'s).

Threads: ``lease-timer`` (``start``), the senders' threads, and the runner's loop calling the events.
The core is touched only under the one engine lock; ``on_fence`` is called outside it, from any of
those threads, and must be quick (putting it on a queue is the intended use).
"""

from __future__ import annotations

import functools
import logging
import random
import threading
from collections.abc import Callable

from leasecore.checkbudget import CheckBudget
from leasecore.clock import Clock, SystemClock
from leasecore.lease import FenceAction, FenceReason, LeasePolicy, LeaseView
from leasecore.lease.finalcheck import LateBeats
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task
from leasecore.runner.leasing.core import (
    Answered,
    AwaitBeat,
    BeatWaitOver,
    BeginFinalUpdate,
    ChildExited,
    ChildStarted,
    EngineCore,
    Event,
    Fence,
    FinalUpdateFailed,
    KillBy,
    Outcome,
    Reported,
    SendBeat,
    SendCheck,
    SenderFree,
    Shutdown,
    StartHeld,
    Stop,
    Tick,
    Track,
    WakeSenders,
)
from leasecore.runner.leasing.leasecalls import extend_lease, log_outcome, read_ownership
from leasecore.runner.leasing.schedule import Answer, beat_failed, check_failed
from leasecore.runner.leasing.senders import SenderExecutor, SendSource, ThreadedSenders
from leasecore.runner.leasing.timer import Timer
from leasecore.runner.ports import EngineMetrics, LeasePort

__all__ = ["EngineMetrics", "LeaseEngine", "LeasePort"]

log = logging.getLogger(__name__)


class _Out:
    """What one locked step hands out after the lock is released."""

    __slots__ = ("awaits", "call", "fences", "outcomes")

    def __init__(self) -> None:
        self.fences: list[Fence] = []
        self.outcomes: list[Outcome] = []
        self.awaits: list[AwaitBeat] = []
        self.call: SendBeat | SendCheck | None = None


_NOTHING = _Out()  # what a step with no effect hands out (most of a task's events): never changed


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
        self._senders: SenderExecutor = executor or ThreadedSenders(senders, max_senders)
        self._core = EngineCore(random_source=random_source, capacity=self._senders.capacity,
                                check_budget=check_budget, kill_by=on_kill_by is not None)  # fmt: skip
        self._timer = Timer(self._lock, self._clock, self._core.timer_heap)
        self._senders.bind(SendSource(self._lock, self._runnable_locked, self._budget_wait_locked,
                                      self._take_locked))  # fmt: skip
        self._started = False
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
            self._step_locked(Stop())
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
        """Step ``Tick`` at the clock's now, hand out the fences, then return their number.

        What the timer thread does on each wake-up. With an executor that works in its caller's thread
        (``InlineSenders``) the requests that may go are carried out here too, their answers fed back:
        a test advances a ``FakeClock`` to ``next_wakeup()`` and calls this, with no thread involved.
        """
        with self._lock:
            out = self._step_locked(Tick())
        self._deliver(out)
        self._senders.run_ready()
        return len(out.fences)

    def next_wakeup(self) -> float | None:
        """When ``run_due`` next has something to do (monotonic seconds): the earliest lease wake-up,
        or when the check budget lets a queued check go. None: nothing scheduled."""
        with self._lock:
            return self._core.next_wakeup(self._clock.monotonic())

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
        self._event(Track(task, policy, polled_at))

    def start_held(self, task_id: str) -> None:
        """The runner holds the command back (``StartGate``): its exec timeout counts from its start."""
        self._event(StartHeld(task_id))

    def child_started(self, task_id: str) -> None:
        """The child is being started (its spawn is asked for; the runner does not wait for the exec):
        its exec timeout counts from now."""
        self._event(ChildStarted(task_id))

    def child_exited(self, task_id: str) -> FenceReason | None:
        """The child is dead: no more fencing; no heartbeat before the final update unless the lease
        needs one, then heartbeats between its failed attempts until ``reported``. Returns why its
        tree was fenced, read in the same locked step (``fence_reason`` then: None, not fenced or
        not tracked)."""
        with self._lock:
            out = self._step_locked(ChildExited(task_id))
            entry = self._core.entry(task_id)
            fence = None if entry is None else entry.lease.fence_reason
        self._deliver(out)
        return fence

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool:
        """The final update of ``task_id`` is about to be sent: exclude its heartbeats.

        From here no heartbeat (or ownership check) of the task starts; queued ones are withdrawn, and
        a heartbeat call in flight is waited for, up to ``timeout_seconds`` (default: that call's
        own timeout + 1 s). True when no heartbeat call is in flight on return (always, for a task the
        engine does not know); False when the wait ran out (a port that ignores its timeout). Follow
        it with ``reported`` once the update is acknowledged, or ``final_update_failed``.
        """
        out = self._event(BeginFinalUpdate(task_id))
        if not out.awaits:
            return True
        with self._lock:
            if timeout_seconds is None:
                timeout_seconds = max(0.0, out.awaits[0].until - self._clock.monotonic())
            done = self._beat_done_cv.wait_for(lambda: not self._core.beat_calling(task_id), timeout_seconds)
            self._step_locked(BeatWaitOver(task_id))  # one still calling: of unknown fate (late_beats)
        if not done:
            log.warning("task %s: a heartbeat call is still in flight past its timeout; sending the final "
                        "update anyway", task_id)  # fmt: skip
        return done

    def late_beats(self, task_id: str) -> LateBeats | None:
        """Until when a beat of ``task_id`` with no answer may still reach the server, and the lease's
        pollCount (None: no such beat, the common path); between begin_final_update and reported."""
        with self._lock:
            return self._core.late_beats(task_id)

    def final_update_failed(self, task_id: str) -> None:
        """The final update failed and will be retried: heartbeat again meanwhile (an overdue beat now).

        A no-op while the task's lease is retired (its next delivery's own lease beats the task)."""
        self._event(FinalUpdateFailed(task_id))

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        """The final update was acknowledged: no heartbeat starts after this returns; forget the task.

        Call ``begin_final_update`` before sending the update: it also waits out a heartbeat call
        already in flight, so none overlaps the update or follows it. Ends the lease in final update:
        a retired one first (``track``); ``poll_count`` (the runner's newest pollCount of the run it
        forgets) ends the current lease only if that lease started no later than that delivery.
        """
        self._event(Reported(task_id, poll_count))

    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None:
        """Fence one task (or all, for None) for SHUTDOWN: now, at ``drain_deadline``, or KILL now (force).

        KeyError for an unknown task id.
        """
        self._event(Shutdown(task_id, drain_deadline, force))

    # ----- queries -------------------------------------------------------------------------------

    def fence_reason(self, task_id: str) -> FenceReason | None:
        """Why the task's tree was fenced (None: it was not, or the task is not tracked)."""
        with self._lock:
            return self._core.fence_reason(task_id)

    def lease_times(self, task_id: str) -> tuple[FenceReason | None, float | None, float | None] | None:
        """(fence reason, lease deadline, hard deadline) of one lease in one look (None: not tracked):
        what the runner's loop asks at a task's admission, its start and its exit, without a view."""
        with self._lock:
            entry = self._core.entry(task_id)
            return None if entry is None else entry.lease.times()

    def view(self, task_id: str) -> LeaseView:
        """A snapshot of one lease. KeyError for an unknown (or already reported) task."""
        with self._lock:
            return self._core.view(task_id)

    def views(self) -> dict[str, LeaseView]:
        """Snapshots of every tracked lease."""
        with self._lock:
            return self._core.views()

    def retired(self) -> list[str]:
        """Tasks whose old lease still waits for its final update's acknowledgement (see ``track``)."""
        with self._lock:
            return self._core.retired()

    def metrics(self) -> EngineMetrics:
        """Pool load and heartbeat lateness."""
        with self._lock:
            now = self._clock.monotonic()
            lateness = sorted(self._core.lateness)
            load = self._senders.load_locked()
            return EngineMetrics(
                tracked=self._core.tracked(),
                senders=load.senders,
                busy_senders=load.busy,
                queued=self._core.queued(),
                oldest_queued_seconds=now - min(self._core.queued_times(), default=now),
                saturated_waits=load.saturated_waits,
                heartbeats_sent=self._core.heartbeats_sent,
                heartbeat_lateness_p99_seconds=lateness[int(0.99 * (len(lateness) - 1))] if lateness else 0.0,
                heartbeat_lateness_max_seconds=lateness[-1] if lateness else 0.0,
            )

    # ----- internals: under the lock -------------------------------------------------------------

    def _runnable_locked(self) -> int:
        return self._core.runnable(self._clock.monotonic())

    def _budget_wait_locked(self) -> float | None:
        return self._core.budget_wait_seconds(self._clock.monotonic())

    def _event(self, event: Event) -> _Out:
        with self._lock:
            out = self._step_locked(event)
        self._deliver(out)
        return out

    def _step_locked(self, event: Event) -> _Out:
        """Step the core at the clock's now; carry out under the lock what belongs there (the senders'
        wake-ups, the timer's, the kill-by queue), return the rest to hand out after."""
        effects = self._core.step(event, self._clock.monotonic())
        if not effects:
            self._timer.poke_locked()
            return _NOTHING
        out = _Out()
        for effect in effects:
            if isinstance(effect, WakeSenders):
                if effect.grow:
                    self._senders.work_queued_locked(effect.runnable)
                else:
                    self._senders.notify_locked()
            elif isinstance(effect, Fence):
                out.fences.append(effect)
            elif isinstance(effect, KillBy):
                self._kill_bys.append((effect.task_id, effect.times))
            elif isinstance(effect, Outcome):
                out.outcomes.append(effect)
            elif isinstance(effect, AwaitBeat):
                out.awaits.append(effect)
            else:
                out.call = effect
        self._timer.poke_locked()
        return out

    def _fire_for_timer_locked(self) -> Callable[[], None] | None:
        """The timer thread's wake-up: ``run_due``'s first half under the lock; the hand-out after."""
        out = self._step_locked(Tick())
        return functools.partial(self._deliver, out) if out.fences or self._kill_bys else None

    def _take_locked(self) -> Callable[[], None] | None:
        """A sender's next request, popped and marked in one locked step (``SendSource.take``)."""
        out = self._step_locked(SenderFree())
        if out.call is not None:
            return functools.partial(self._call, out)
        return functools.partial(self._deliver, out) if out.fences or out.outcomes else None

    # ----- threads -------------------------------------------------------------------------------

    def _call(self, taken: _Out) -> None:
        """Carry out one request on this sender's thread, feed its answer back, hand out the results."""
        self._deliver(taken)
        call = taken.call
        answer: Answer | None = None  # (None: the call raised past its own handling; a failure)
        if isinstance(call, SendBeat):
            try:
                answer = extend_lease(self._port, call.task_id, call.workflow_id,
                                      timeout_seconds=call.timeout_seconds, sent_at=call.sent_at)  # fmt: skip
            finally:
                with self._lock:
                    out = self._step_locked(Answered(call.call_id, answer or beat_failed(unknown_fate=True)))
                    self._beat_done_cv.notify_all()
        elif isinstance(call, SendCheck):
            try:
                answer = read_ownership(self._port, call.task_id, timeout_seconds=call.timeout_seconds)
            finally:
                with self._lock:
                    out = self._step_locked(Answered(call.call_id, answer or check_failed()))
        else:
            return
        self._deliver(out)

    def _deliver(self, out: _Out) -> None:
        if out is _NOTHING and not self._kill_bys:
            return
        for outcome in out.outcomes:
            log_outcome(outcome.task_id, failed_before=outcome.failed_before, failed_now=outcome.failed_now,
                        beat_error=outcome.beat_error, lost_before=outcome.lost_before,
                        lost_now=outcome.lost_now)  # fmt: skip
            if outcome.kind == "heartbeat":
                self._observer.on_heartbeat(outcome.task_type, outcome.result == "ok", outcome.late)
            elif self._observer.enabled:
                self._observer.on_ownership_check(outcome.task_type, outcome.result)
        if self._on_kill_by is not None and self._kill_bys:  # (whoever queued one delivers after: safe)
            with self._lock:
                kill_bys, self._kill_bys = self._kill_bys, []
            for task_id, kill_by in kill_bys:  # (in any order across threads: the switch keeps the latest)
                self._on_kill_by(task_id, kill_by)  # (KillByTimes.renew raises nothing)
        for fence in out.fences:
            try:
                self._on_fence(fence.task_id, fence.action)
            except Exception:  # the runner's bug must not stop the timer: log it, fence the rest
                log.exception("task %s: on_fence(%s) failed", fence.task_id, fence.action)
