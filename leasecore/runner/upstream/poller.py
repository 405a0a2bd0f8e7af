"""One poll loop per task type: batch long-poll for as many tasks as there are free slots.

The poller only fetches work and hands each task to ``on_task``; the runner's main thread decides
what to do with it and gives the slot back (``Poller.release``) when the task is finished. A shared
``WorkBudget`` enforces ``--once`` / ``--max-tasks`` across task types. Delays between polls come
from the pure ``PollBackoff``; the server's reachability is logged once per change, not per failure.

A claimed task is never dropped: the server counts every task of a poll's answer as ours until R,
even past the count asked. Such extras run too (a slot overshoot of at most the count asked, within
the work budget); any beyond that go to ``on_surplus``, which hands them back to the server.

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
from leasecore.runner.upstream.pollpolicy import BackoffPolicy, FailureKind, PollBackoff, Reachability

log = logging.getLogger("conductor_run.poll")


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


_REPORTS_WAITING_MIN = 8  # see Poller._reporting


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
        self.settings = settings
        self._port = port
        self._on_task = on_task
        self._on_surplus = on_surplus or on_task
        self._on_exit = on_exit
        self.failed = False  # the thread ended on an unexpected error (set before on_exit is called)
        self.refused: ConductorAuthError | None = None  # set before on_exit: refused before any answer
        self._end_on_refusal = end_on_refusal_at_start
        self._answered = False  # some poll of this poller was answered
        self._budget = budget
        self._stop = stop
        # Paused: no claim is made (no poll, no update-v2 chaining); starts as configured, then
        # changed live by ``set_paused`` (the runner's pause/resume/reload).
        self._paused = settings.paused
        base = max(0.01, settings.interval_seconds)
        self._backoff = backoff or PollBackoff(
            BackoffPolicy(empty_base_seconds=base, empty_cap_seconds=max(1.0, base))
        )
        self._clock = clock or SystemClock()
        self._cond = threading.Condition()
        self._in_use = 0
        self._unstarted = 0  # handed to on_task / on_surplus, not yet taken up (see taken_up)
        # Tasks whose child is gone and whose final update is still being sent: they hold no slot,
        # but at most max(concurrency, 8) of them may wait, or a server refusing updates while it
        # hands out tasks would have us claim its whole queue (each lease held, each result kept).
        # Not fewer than 8: with one slot, the next poll must not wait for each report's round trip.
        self._reporting = 0
        self.reachability = Reachability()
        self.last_ok_at: datetime | None = None  # wall clock of the last successful poll
        self.backoff_seconds = 0.0  # the current wait before the next poll
        self._thread = threading.Thread(target=self._run, name=f"poll-{settings.task_type}", daemon=True)

    @property
    def consecutive_errors(self) -> int:
        return self._backoff.consecutive_errors

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        """Its thread runs (started and not ended)."""
        return self._thread.is_alive()

    def set_paused(self, paused: bool) -> bool:
        """Stop (or restart) claiming work for this type; returns whether that changed anything.

        Paused, no poll leaves once the one in flight (if any) has returned, and whatever that poll
        claims is handed back at once (``on_surplus``); running tasks are not touched. Thread-safe."""
        with self._cond:
            changed = self._paused != paused
            self._paused = paused
            self._cond.notify_all()
        return changed

    def reconfigure(self, settings: PollSettings) -> None:
        """Poll with ``settings`` from the next poll on (a reload: concurrency, poll timeout, domain...);
        the paused state is ``set_paused``'s, not ``settings.paused``. Thread-safe."""
        if settings.task_type != self.settings.task_type:
            raise ValueError("a poller's task type cannot change")
        with self._cond:
            if settings.interval_seconds != self.settings.interval_seconds:
                base = max(0.01, settings.interval_seconds)
                self._backoff.policy = BackoffPolicy(empty_base_seconds=base,
                                                     empty_cap_seconds=max(1.0, base))
            self.settings = settings
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
            self._in_use = max(0, self._in_use - count)
            self._wake_if_free_locked()

    def reporting(self) -> None:
        """A task's child is gone and its result is being reported: its slot is free for another
        task, and it counts against the reports that may wait (see ``_take_slots``)."""
        with self._cond:
            self._in_use = max(0, self._in_use - 1)
            self._reporting += 1
            self._wake_if_free_locked()

    def keep_for_chain(self) -> bool:
        """A task's child is gone and its final update may claim the next task (update-v2): keep its
        slot for that task, with one unit of the work budget. False (nothing kept: call ``reporting``)
        when the budget is spent, the type is paused or polling stopped. The claimed task then takes
        the slot over (no call); if nothing comes, ``chain_ended``."""
        if self._paused or self._stop.is_set():
            return False
        return self._budget.reserve(1) == 1

    def chain_ended(self) -> None:
        """The update-v2 of a task kept by ``keep_for_chain`` claimed nothing: its budget unit goes
        back, and its slot is free while its result is still reported (as ``reporting``)."""
        self._budget.give_back(1)
        self.reporting()

    def reported(self) -> None:
        """A result counted by ``reporting`` is delivered, saved for later or dropped."""
        with self._cond:
            self._reporting = max(0, self._reporting - 1)
            self._wake_if_free_locked()

    def taken_up(self, count: int = 1) -> None:
        """The runner has dealt with ``count`` tasks this poller handed over (started, refused or
        handed back): room for more claims."""
        with self._cond:
            self._unstarted = max(0, self._unstarted - count)
            self._wake_if_free_locked()

    def wake(self) -> None:
        """Make a waiting poller re-check ``stop`` now."""
        with self._cond:
            self._cond.notify_all()

    def _run(self) -> None:
        try:
            if self._paused:
                # Idle, not ended: a runner whose every type is paused stays up until stopped (as the
                # SDKs' workers do), instead of exiting 0 at once and being restarted in a loop; a
                # resume starts polling.
                log.info("task type %s is paused: not polling it", self.settings.task_type)
            while not self._stop.is_set() and self.refused is None:
                self._poll_once()
        except Exception:  # a thread's top level: log it; the runner sees the poller end
            self.failed = True
            log.exception("the poller of %s failed", self.settings.task_type)
        finally:
            self._on_exit(self.settings.task_type)

    def _full_locked(self) -> bool:
        """No claim may be made now: every slot taken, or too many tasks not started or reporting."""
        return (
            self._in_use >= self.settings.concurrency
            or self._unstarted >= max(1, self.settings.max_unstarted)
            or self._reporting >= max(self.settings.concurrency, _REPORTS_WAITING_MIN)
        )

    def _wake_if_free_locked(self) -> None:
        # Only when a claim has become possible: a wake-up that finds every slot still taken costs the
        # poller a thread switch and the GIL for nothing, several times per task.
        if not self._full_locked():
            self._cond.notify_all()

    def _take_slots(self) -> int:
        """Wait for free slots (and not paused), reserve them and the budget; 0 means stop polling."""
        with self._cond:
            while (self._paused or self._full_locked()) and not self._stop.is_set():
                self._cond.wait(timeout=1.0)
            if self._stop.is_set():
                return 0
            cap = max(1, self.settings.max_unstarted)
            room = min(self.settings.concurrency - self._in_use, cap - self._unstarted)
            granted = self._budget.reserve(room)
            self._in_use += granted
            return granted

    def _poll_once(self) -> None:
        count = self._take_slots()
        if count == 0:
            if not self._stop.is_set():  # the budget is spent: nothing more to poll for
                self._stop_polling()
            return
        polled_at = self._clock.monotonic()
        try:
            tasks = self._port.poll(
                self.settings.task_type, count=count, timeout_ms=self.settings.timeout_ms,
                worker_id=self.settings.worker_id, domain=self.settings.domain,
            )
        except ConductorError as exc:
            self._observer.on_poll(self.settings.task_type, self._clock.monotonic() - polled_at, exc)
            self._unreserve(count)
            if isinstance(exc, ConductorAuthError) and self._end_on_refusal and not self._answered:
                self.refused = exc  # the client already retried once with a fresh token
                return
            self._note(self.reachability.on_failure(str(exc), failure_kind(exc)))
            self.backoff_seconds = self._backoff.on_error()
            self._stop.wait(self.backoff_seconds)
            return
        self._observer.on_poll(self.settings.task_type, self._clock.monotonic() - polled_at, None)
        if self._paused and tasks:  # paused while this poll was out: nothing it claimed runs here
            self._unreserve(count)
            run, surplus = list[Task](), tasks
            log.info("task type %s was paused during a poll: handing its %d task(s) back",
                     self.settings.task_type, len(tasks))
        else:
            run, surplus = self._split(tasks, count)
        with self._cond:
            self._unstarted += len(run) + len(surplus)
        self._answered = True
        self._note(self.reachability.on_success())
        self.last_ok_at = self._clock.now()
        for task in run:
            self._on_task(task, polled_at)
        for task in surplus:
            self._on_surplus(task, polled_at)
        self.backoff_seconds = self._backoff.on_tasks() if tasks else self._backoff.on_empty()
        if self.backoff_seconds:
            self._stop.wait(self.backoff_seconds)

    def _split(self, tasks: list[Task], count: int) -> tuple[list[Task], list[Task]]:
        """The tasks to run and the surplus to hand back; slots and budget follow the tasks run."""
        extra = len(tasks) - count
        if extra <= 0:
            self._unreserve(count - len(tasks))
            return tasks, []
        with self._cond:  # overshoot: up to `count` more, as far as the budget allows
            granted = self._budget.reserve(min(extra, count))
            self._in_use += granted
        log.warning("the server returned %d task(s) for a poll of %d (%s): running %d more than asked, "
                    "handing %d back", len(tasks), count, self.settings.task_type, granted, extra - granted)
        return tasks[: count + granted], tasks[count + granted :]

    def _stop_polling(self) -> None:
        # The budget is shared: this poller simply ends; the runner stops when the work is done.
        with self._cond:
            while not self._stop.is_set() and self._budget.exhausted:
                self._cond.wait(timeout=1.0)

    def _unreserve(self, count: int) -> None:
        if count:
            self._budget.give_back(count)
            self.release(count)

    def _note(self, change: tuple[Reachability, str | None]) -> None:
        self.reachability, line = change
        if line is not None:
            level = logging.INFO if self.reachability.reachable else logging.WARNING
            log.log(level, "%s (polling %s)", line, self.settings.task_type)
