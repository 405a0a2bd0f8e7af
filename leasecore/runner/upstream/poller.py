"""One poll loop per task type: batch long-poll for as many tasks as there are free slots.

The poller only fetches work and hands each task to ``on_task``; the runner's main thread decides
what to do with it and gives the slot back (``Poller.release``) when the task is finished. A shared
``WorkBudget`` enforces ``--once`` / ``--max-tasks`` across task types.

Every decision is the pure ``PollCore``'s (``leasecore.runner.upstream.pollcore``): slots, the work
budget, pause, the slot kept for update-v2, when the next poll may leave and for how many tasks, what
an answer or a failure means (surplus handed back, the backoff, the server's reachability logged once
per change). This module is its driver: a thread that waits until the core lets a poll out, does the
HTTP, feeds the outcome back, hands the tasks over and logs the lines the core returns.

Must not: start children, track leases or decide a task's fate (the runner does, on its thread);
sleep past a stop. Its server call is ``runner.ports.PollPort``.
Threads: one ``poll-<type>`` thread per task type; ``release`` and ``stop`` from the main thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorAuthError, ConductorError, ConductorRejected
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task
from leasecore.runner.ports import PollPort, PollSettings
from leasecore.runner.upstream.pollcore import PollCore, SendPoll
from leasecore.runner.upstream.pollpolicy import FailureKind, PollBackoff, Reachability

log = logging.getLogger("conductor_run.poll")

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING}


class WorkBudget:
    """How many more tasks this run may start (``None``: unlimited); shared by every poller."""

    def __init__(self, max_tasks: int | None) -> None:
        self._left = max_tasks
        self._lock = threading.Lock()

    def reserve(self, want: int) -> int:
        """Take up to ``want`` from the budget; returns how many were granted (0: exhausted)."""
        with self._lock:
            if self._left is None:
                return want
            granted = min(want, self._left)
            self._left -= granted
            return granted

    def give_back(self, count: int) -> None:
        with self._lock:
            if self._left is not None:
                self._left += count

    @property
    def exhausted(self) -> bool:
        with self._lock:
            return self._left == 0


def failure_kind(exc: ConductorError) -> FailureKind:
    """How a failed poll is reported: refused credentials and other rejections are not "unreachable"."""
    if isinstance(exc, ConductorAuthError):
        return "no_credentials" if exc.without_credentials else "auth"
    if isinstance(exc, ConductorRejected):
        return "rejected"
    return "unreachable"


class Poller:
    """Polls one task type on its own thread until ``stop`` is set or the budget runs out."""

    def __init__(
        self,
        port: PollPort,
        settings: PollSettings,
        on_task: Callable[[Task, float], None],
        *,
        budget: WorkBudget,
        stop: threading.Event,
        on_exit: Callable[[str], None] = lambda _task_type: None,
        backoff: PollBackoff | None = None,
        clock: Clock | None = None,
        on_surplus: Callable[[Task, float], None] | None = None,
        end_on_refusal_at_start: bool = False,
        observer: Observer = NO_METRICS,
    ) -> None:
        """``on_surplus(task, polled_at)``: a task beyond what this poller may run (None: ``on_task``);
        ``observer.on_poll`` after every poll request (metrics).

        ``end_on_refusal_at_start``: when the server refuses the very first polls (401/403: no or
        wrong credentials, no permission) before any poll was answered, the thread ends with
        ``refused`` set instead of retrying: an auth failure at start must never look like an idle
        queue (the runner stops and exits 4). Once a poll was answered, refusals are an outage:
        logged once, retried with backoff."""
        self._observer = observer
        self._port = port
        self._on_task = on_task
        self._on_surplus = on_surplus or on_task
        self._on_exit = on_exit
        self.failed = False  # the thread ended on an unexpected error (set before on_exit is called)
        self.refused: ConductorAuthError | None = None  # set before on_exit: refused before any answer
        self._stop = stop
        self._clock = clock or SystemClock()
        # Every call into the core holds this lock: the core is not thread-safe, and the thread waits
        # on it for room (a slot, a task taken up, a result reported) or a resume.
        self._cond = threading.Condition()
        self._core = PollCore(settings, budget, backoff=backoff,
                              end_on_refusal_at_start=end_on_refusal_at_start)
        self.last_ok_at: datetime | None = None  # wall clock of the last successful poll
        self._thread = threading.Thread(target=self._run, name=f"poll-{settings.task_type}", daemon=True)

    @property
    def settings(self) -> PollSettings:
        return self._core.settings

    @property
    def consecutive_errors(self) -> int:
        return self._core.consecutive_errors

    @property
    def reachability(self) -> Reachability:
        return self._core.reachability

    @property
    def backoff_seconds(self) -> float:
        """The current wait before the next poll."""
        return self._core.backoff_seconds

    @property
    def paused(self) -> bool:
        return self._core.paused

    @property
    def alive(self) -> bool:
        """Its thread runs (started and not ended)."""
        return self._thread.is_alive()

    def set_paused(self, paused: bool) -> bool:
        """Stop (or restart) claiming work for this type; returns whether that changed anything.

        Paused, no poll leaves once the one in flight (if any) has returned, and whatever that poll
        claims is handed back at once (``on_surplus``); running tasks are not touched. Thread-safe."""
        with self._cond:
            changed = self._core.set_paused(paused)
            self._cond.notify_all()
        return changed

    def reconfigure(self, settings: PollSettings) -> None:
        """Poll with ``settings`` from the next poll on (a reload: concurrency, poll timeout, domain...);
        the paused state is ``set_paused``'s, not ``settings.paused``. Thread-safe."""
        with self._cond:
            self._core.reconfigure(settings)
            self._cond.notify_all()  # more slots may be free now

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end; True when it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def release(self, count: int = 1) -> None:
        """A task of this type is finished (or was never started): its slot is free again."""
        with self._cond:
            self._core.release(count)
            self._wake_if_free_locked()

    def reporting(self) -> None:
        """A task's child is gone and its result is being reported: its slot is free for another
        task, and it counts against the reports that may wait (``PollCore.reporting_started``)."""
        with self._cond:
            self._core.reporting_started()
            self._wake_if_free_locked()

    def keep_for_chain(self) -> bool:
        """A task's child is gone and its final update may claim the next task (update-v2): keep its
        slot for that task, with one unit of the work budget. False (nothing kept: call ``reporting``)
        when the budget is spent, the type is paused or polling stopped. The claimed task then takes
        the slot over (no call); if nothing comes, ``chain_ended``."""
        with self._cond:
            self._see_stop_locked()
            return self._core.keep_for_chain()

    def chain_ended(self) -> None:
        """The update-v2 of a task kept by ``keep_for_chain`` claimed nothing: its budget unit goes
        back, and its slot is free while its result is still reported (as ``reporting``)."""
        with self._cond:
            self._core.chain_ended()
            self._wake_if_free_locked()

    def reported(self) -> None:
        """A result counted by ``reporting`` is delivered, saved for later or dropped."""
        with self._cond:
            self._core.reported()
            self._wake_if_free_locked()

    def taken_up(self, count: int = 1) -> None:
        """The runner has dealt with ``count`` tasks this poller handed over (started, refused or
        handed back): room for more claims."""
        with self._cond:
            self._core.taken_up(count)
            self._wake_if_free_locked()

    def wake(self) -> None:
        """Make a waiting poller re-check ``stop`` now."""
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            if self._core.paused:
                # Idle, not ended: a runner whose every type is paused stays up until stopped (as the
                # SDKs' workers do), instead of exiting 0 at once and being restarted in a loop; a
                # resume starts polling.
                log.info("task type %s is paused: not polling it", self.settings.task_type)
            while self.refused is None and (request := self._next_poll()) is not None:
                self._poll(request)
        except Exception:  # a thread's top level: log it; the runner sees the poller end
            self.failed = True
            log.exception("the poller of %s failed", self.settings.task_type)
        finally:
            self._on_exit(self.settings.task_type)

    def _see_stop_locked(self) -> None:
        if self._stop.is_set() and not self._core.stopped:
            self._core.stop()

    def _wake_if_free_locked(self) -> None:
        # Only when a claim has become possible: a wake-up that finds every slot still taken costs the
        # poller a thread switch and the GIL for nothing, several times per task.
        if not self._core.full:
            self._cond.notify_all()

    def _next_poll(self) -> SendPoll | None:
        """Wait until the core lets a poll out (its slots and budget reserved); None: stopped."""
        slept_until = float("-inf")
        while True:
            with self._cond:
                self._see_stop_locked()
                # (After a backoff slept out on the wall clock, it is over even if the clock given
                # is a test's that did not move.)
                now = max(self._clock.monotonic(), slept_until)
                request = self._core.take_poll(now)
                if request is not None or self._core.stopped:
                    return request
                due = self._core.next_wakeup(now)
                if due is None:
                    # Room, a resume or another type's budget: those wake us; the stop within 1 s
                    # even if nobody calls ``wake``.
                    self._cond.wait(timeout=1.0)
                    continue
            self._stop.wait(max(0.0, due - now))  # the backoff: only a stop cuts it short
            slept_until = due

    def _poll(self, request: SendPoll) -> None:
        polled_at = self._clock.monotonic()
        try:
            tasks = self._port.poll(request.task_type, count=request.count, timeout_ms=request.timeout_ms,
                                    worker_id=request.worker_id, domain=request.domain)
        except ConductorError as exc:
            self._observer.on_poll(request.task_type, self._clock.monotonic() - polled_at, exc)
            with self._cond:
                failed = self._core.on_failure(str(exc), failure_kind(exc), self._clock.monotonic())
                self._wake_if_free_locked()
            if failed.give_up:
                assert isinstance(exc, ConductorAuthError)  # (the only kind the core gives up on)
                self.refused = exc  # the client already retried once with a fresh token
            elif failed.note is not None:
                log.warning("%s (polling %s)", failed.note, request.task_type)
            return
        self._observer.on_poll(request.task_type, self._clock.monotonic() - polled_at, None)
        with self._cond:
            answered = self._core.on_answer(tasks, self._clock.monotonic())
            self._wake_if_free_locked()
        for level, line in answered.lines:
            log.log(_LEVELS[level], "%s", line)
        if answered.note is not None:
            log.info("%s (polling %s)", answered.note, request.task_type)
        self.last_ok_at = self._clock.now()
        for task in answered.run:
            self._on_task(task, polled_at)
        for task in answered.surplus:
            self._on_surplus(task, polled_at)
