"""The runner: wires pollers, the lease engine, the process supervisor, the log streamer and the reporter.

Threads only produce events (``leasecore.runner.ports``) onto one queue; the main thread consumes them
and is the only writer of per-task state. Per task the order is fixed:

    poll -> engine.track -> spawn -> (heartbeats, fences) -> child exits -> engine.child_exited
         -> result (by fence reason) -> report (retried) -> engine.reported -> forget

Shutdown keeps that order (STYLE.md 2.4): stop polling at once; ask the engine to fence every task
(now, or at the drain deadline); the children die; their results are reported; heartbeats stop
last (``engine.reported`` per task, ``engine.stop`` at the very end). A second signal kills every
tree at once and stops waiting between report retries (undelivered results go to the outbox).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import queue
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ProcessError
from leasecore.handover import DyingTrees, StartGate, YieldHold, mark_yield, may_run_elsewhere
from leasecore.lease import FenceAction, FenceReason, KillTree, LeasePolicy, TerminateTree
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.contact import RecordedCalls, ServerContact
from leasecore.runner.engine import FinalUpdates
from leasecore.runner.events import (
    ChildExited,
    Event,
    Fence,
    PollerExited,
    ReportDone,
    ShutdownRequested,
    TaskPolled,
    Tick,
)
from leasecore.runner.logsink import LogStreamer
from leasecore.runner.poller import Poller, WorkBudget
from leasecore.runner.ports import (
    ConductorPort,
    EnginePort,
    RunOptions,
    RunOutcome,
    StatusPort,
    SupervisorPort,
    TaskTypePlan,
    UpdatePort,
)
from leasecore.runner.reporter import Reporter, ReportOutcome
from leasecore.runner.signals import capture_signals
from leasecore.runner.status import InFlight, Phase, server_health, task_snapshot, undelivered_snapshot
from leasecore.snapshot import MAX_OUTPUT_LINES, TaskSnapshot
from leasecore.state.outbox import still_saved

log = logging.getLogger("conductor_run.runner")

SHUTDOWN_REASON = "worker shutting down"
# A long poll in flight when a stop starts is waited for up to its poll timeout (<= 5 s) + this, so
# that a task it brings can be handed straight back; a poll stuck past that (a server that accepted
# the connection but does not answer) is abandoned rather than allowed to delay the exit.
_POLLER_JOIN_SLACK_SECONDS = 0.5
_STOP_SAFETY_MARGIN_SECONDS = 5.0  # past TERM + grace, the runner kills leftovers itself
_UNDELIVERED_SHOWN = 100  # results waiting in the outbox that status lists (the newest)
_DYING_POLL_SECONDS = 0.05  # how often a task held for an earlier attempt's dying tree looks again
_YIELD_SLACK_SECONDS = 1.0  # a yield's tree is waited for up to its grace + margin + this (YieldHold)



class ToResult(Protocol):
    """``leasecore.process.to_task_result`` as the runner calls it (``exit_``: a ChildExit)."""

    def __call__(
        self, task: Task, exit_: Any, spec: Any, worker_id: str, *, timed_out: bool = False
    ) -> TaskResult: ...


class Runner:
    """Serves every task type of ``plans`` until stopped; see the module docstring."""

    def __init__(
        self,
        plans: list[TaskTypePlan],
        *,
        conductor: ConductorPort,
        make_engine: Callable[[Callable[[str, FenceAction], None]], EnginePort],
        supervisor: SupervisorPort,
        to_result: ToResult,
        options: RunOptions | None = None,
        status: StatusPort | None = None,
        reporter: Callable[[UpdatePort, Callable[[ReportOutcome], None]], Reporter] | None = None,
        logs: LogStreamer | None = None,
        clock: Clock | None = None,
        contact: ServerContact | None = None,
        on_force: Callable[[], None] | None = None,
        metrics: Observer = NO_METRICS,
    ) -> None:
        """``reporter(updates, on_done)`` builds the reporter around ``updates``: the conductor's
        ``update`` guarded by the engine (``FinalUpdates``: no heartbeat overlaps or follows a final
        update), so no caller can forget the guard. ``contact`` records the outcome of every call to
        the server for the status snapshots; pass the one that records the engine's calls too
        (``leasecore.runner.contact.RecordedLeaseCalls``). ``on_force()``: called on the main thread at a
        forced stop (the second signal), before the trees are killed: the worker cuts the HTTP calls
        in flight there (``ConductorClient.abort``). ``metrics``: the hooks of ``leasecore.metrics``
        (the runner's own, and its pollers' and default reporter's)."""
        self._on_force = on_force
        if not plans:
            raise ValueError("a runner needs at least one task type")
        self._metrics = metrics
        self.loop_at: float | None = None  # monotonic time the main loop last turned (liveness probe)
        self.options = options or RunOptions()
        self._clock = clock or SystemClock()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._plans = {p.poll.task_type: p for p in plans}
        self._supervisor = supervisor
        self._to_result = to_result
        self._status = status
        self._contact = contact or ServerContact(self._clock)
        conductor = RecordedCalls(conductor, self._contact)  # every call counts as server contact
        self._engine = make_engine(lambda task_id, action: self._events.put(Fence(task_id, action)))
        updates = FinalUpdates(conductor, self._engine)
        make_reporter = reporter or (lambda port, done: Reporter(port, done, clock=self._clock,
                                                                 observer=metrics))
        self._reporter = make_reporter(updates, lambda outcome: self._events.put(ReportDone(outcome)))
        self._logs = logs or LogStreamer(conductor, clock=self._clock)
        self._stop_polling = threading.Event()
        self._budget = WorkBudget(self._task_limit())
        self._pollers = {
            t: Poller(conductor, p.poll, functools.partial(self._on_polled, poller=t), budget=self._budget,
                      stop=self._stop_polling,
                      on_exit=lambda tt: self._events.put(PollerExited(tt, self._pollers[tt].failed,
                                                                       self._pollers[tt].refused)),
                      clock=self._clock, on_surplus=functools.partial(self._on_surplus, poller=t),
                      end_on_refusal_at_start=True, observer=metrics)
            for t, p in self._plans.items()
        }
        self._tasks: dict[str, InFlight] = {}
        # Tasks polled but not started yet: a re-delivery whose previous holder may still run it, or a
        # retry whose earlier attempt's tree is still dying here (leasecore.handover).
        self._gate = StartGate(DyingTrees(_tree_gone))
        self._handing_back: set[str] = set()  # surplus tasks whose hand-back update is in flight
        # A task's next delivery polled while its previous run's result is reported: started after it.
        self._next_runs: dict[str, tuple[Task, float, LeasePolicy | None, bool]] = {}
        self._yields = YieldHold(_tree_gone)  # IN_PROGRESS results waiting for their tree to be gone
        self._pollers_alive = len(self._pollers)
        # Pollers of types that are not paused, still polling: when the last one ends (budget spent,
        # or it failed) there is no more work. A paused type's poller only waits for the stop, so a
        # runner whose every type is paused idles until stopped.
        self._polling_types = {t for t, p in self._plans.items() if not p.poll.paused}
        self._any_polling = bool(self._polling_types)
        self._poller_failed = False
        self._refused: Exception | None = None  # a poller's first polls were refused (see Poller)
        # Tasks whose result the reporter saved to the outbox, shown by ``status`` as undelivered
        # until the file is gone (delivered or dropped by the outbox's redelivery); the newest 100.
        self._undelivered: dict[str, tuple[Path, TaskSnapshot]] = {}
        self._statuses: list[TaskStatus | None] = []  # per started task, in start order
        self._stopping_since: float | None = None
        self._forced = False
        self._signum: int | None = None
        self._escalate_at: float | None = None
        self._started_at = self._clock.monotonic()
        self._publish_at = self._started_at
        self._publish_pending = False

    # ------------------------------------------------------------------ public

    @property
    def stopping(self) -> bool:
        """A stop has begun (read by the readiness probe's thread)."""
        return self._stopping_since is not None

    def failed_pollers(self) -> list[str]:
        """Task types whose poller ended on an unexpected error (the liveness probe's)."""
        return [t for t, p in self._pollers.items() if p.failed]

    def request_stop(self, *, force: bool = False) -> None:
        """Stop as a signal would, without the signal (thread-safe; for tests and embedding)."""
        self._events.put(ShutdownRequested(force=force))

    def handle_signal(self, signum: int, count: int) -> None:
        """A signal handler's whole job: enqueue (``SimpleQueue.put`` is reentrant). ``count`` > 1: force."""
        self._events.put(ShutdownRequested(force=count > 1, signum=signum))

    def run(self, *, install_signal_handlers: bool = True) -> RunOutcome:
        """Serve until stopped; returns how the run ended. A task's failure is never raised.

        ``install_signal_handlers=False``: the caller routes signals to ``handle_signal`` itself (it
        keeps them captured over its own setup and cleanup, see ``leasecore.runner.wiring``).
        """
        handlers = capture_signals(self.handle_signal) if install_signal_handlers else None
        with handlers or contextlib.nullcontext():
            self._engine.start()
            self._logs.start()
            try:
                for poller in self._pollers.values():
                    poller.start()
                self._loop()
            finally:
                self._close()
        return RunOutcome(signum=self._signum, started=len(self._statuses), statuses=tuple(self._statuses),
                          poller_failed=self._poller_failed, refused=self._refused)  # fmt: skip

    # ------------------------------------------------------------------ other threads -> queue

    def _on_surplus(self, task: Task, polled_at: float, *, poller: str) -> None:
        self._events.put(TaskPolled(task, polled_at, surplus=True, poller=poller))

    def _on_polled(self, task: Task, polled_at: float, *, poller: str = "") -> None:
        # On the poller's thread, for every task of the batch before any is spawned: the lease starts
        # at the poll's send time, so a task waiting for its spawn behind others (1000 at once) is
        # already heartbeated. A task delivered again while it runs here is re-tracked the same way
        # (the new poll reset the server's clock, and its pollCount is ours).
        policy: LeasePolicy | None = None
        try:
            plan = self._plans.get(task.task_type) or next(iter(self._plans.values()))
            policy = plan.make_policy(task)
            self._engine.track(task, policy, polled_at=polled_at)
        except Exception:  # never lose the task: the main thread tracks it (or reports the failure)
            log.exception("task %s: could not start its lease at poll time", task.task_id)
            policy = None
        self._events.put(TaskPolled(task, polled_at, policy, poller=poller))

    # ------------------------------------------------------------------ main loop

    def _loop(self) -> None:
        self._publish()
        while not self._done():
            wait = min(0.5, self.options.status_interval_seconds)
            if self._publish_pending:
                wait = max(0.0, min(wait, self._publish_at - self._clock.monotonic()))
            now = self._clock.monotonic()
            if (start_at := self._gate.next_at(now, poll_seconds=_DYING_POLL_SECONDS)) is not None:
                wait = max(0.0, min(wait, start_at - now))
            if self._yields:
                wait = min(wait, _DYING_POLL_SECONDS)
            try:
                event: Event = self._events.get(timeout=wait)
            except queue.Empty:
                event = Tick()
            self.loop_at = self._clock.monotonic()
            self._handle(event)
            self._report_yields()
            self._start_released()
            self._check_deadlines()
            self._maybe_publish()

    def _maybe_publish(self) -> None:
        # A snapshot costs O(tasks) to build and a file write: at most every status_min_interval
        # (a burst of events, e.g. 1000 tasks polled at once, is one publish, not one per event).
        now = self._clock.monotonic()
        if now < self._publish_at:
            self._publish_pending = True
            return
        self._publish_pending = False
        self._publish()
        # ... and at most 1/20 of the main loop's time: with 1000 tasks a snapshot costs ~50 ms, and
        # 5 of them a second starved the spawns and heartbeats (#9).
        cost = self._clock.monotonic() - now
        self._publish_at = now + max(self.options.status_min_interval_seconds, 20 * cost)

    def _task_limit(self) -> int | None:
        return 1 if self.options.once else self.options.max_tasks

    def _done(self) -> bool:
        if self._tasks:
            return False
        if self._stopping_since is not None:
            if self._pollers_alive == 0:
                return True
            longest_poll = max(p.poll.timeout_ms for p in self._plans.values()) / 1000.0
            if self._clock.monotonic() - self._stopping_since > longest_poll + _POLLER_JOIN_SLACK_SECONDS:
                log.warning("a poll is still in flight past its timeout: not waiting for it (a task it "
                            "brings now is retried by the server after its response timeout)")
                return True
            return False
        limit = self._task_limit()
        if (limit is not None and len(self._statuses) >= limit) or (
            self._any_polling and not self._polling_types
        ):
            self._begin_stop(None, reason="no more work to do")
        return False

    def _handle(self, event: Event) -> None:
        if isinstance(event, TaskPolled):
            try:
                self._on_task(event.task, event.polled_at, event.policy, surplus=event.surplus)
            finally:  # the poller that claimed it (its plan is found by the task's own type)
                poller = self._pollers.get(event.poller) or next(iter(self._pollers.values()))
                poller.taken_up()
        elif isinstance(event, ChildExited):
            self._on_child_exited(event.task_id, event.exit)
        elif isinstance(event, Fence):
            self._on_fence(event.task_id, event.action)
        elif isinstance(event, ReportDone):
            self._on_reported(event.outcome)
        elif isinstance(event, ShutdownRequested):
            self._on_shutdown(event)
        elif isinstance(event, PollerExited):
            self._pollers_alive -= 1
            self._poller_failed |= event.failed
            self._polling_types.discard(event.task_type)
            if event.refused is not None and self._refused is None:
                self._refused = event.refused
                self._begin_stop(None, reason=f"the server refused the first poll of {event.task_type}")

    # ------------------------------------------------------------------ one task

    def _on_task(
        self, task: Task, polled_at: float, policy: LeasePolicy | None = None, *, surplus: bool = False
    ) -> None:
        plan = self._plans.get(task.task_type) or next(iter(self._plans.values()))
        if (entry := self._tasks.get(task.task_id)) is not None and entry.phase is Phase.REPORTING and (
            task.poll_count > entry.task.poll_count
        ):
            # Its next run (a yield re-queued at once), polled before its report was acknowledged: it
            # starts once that report is done; its own lease (engine.track) holds it meanwhile.
            log.info("task %s polled again (pollCount %d) while its result is reported: running it "
                     "once that report is done", task.task_id, task.poll_count)
            self._next_runs[task.task_id] = (task, polled_at, policy, surplus)
            return
        if task.task_id in self._tasks:
            # Delivered again while it runs here (a re-queue, a server hiccup): the running child
            # keeps the lease; starting a second copy would run one task twice at once.
            log.warning("task %s delivered again while it runs here: not starting it twice", task.task_id)
            entry = self._tasks[task.task_id]
            if task.poll_count > entry.task.poll_count:
                entry.task = task  # its pollCount is ours now (kept with a result saved for later)
            if policy is None and entry.tracked and entry.policy is not None:  # not re-tracked at poll
                self._engine.track(task, entry.policy, polled_at=polled_at)
            if not surplus:  # a surplus task took no slot and no budget
                self._pollers[plan.poll.task_type].release()
                self._budget.give_back(1)
            return
        if surplus:
            self._hand_back(task, plan)
            return
        entry = InFlight(task, plan, index=len(self._statuses), started_at=self._clock.now())
        self._tasks[task.task_id] = entry
        self._statuses.append(None)
        if policy is not None:  # tracked at poll time
            entry.policy, entry.tracked = policy, True
        if self._stopping_since is not None:
            # Polled while stopping (a long poll was in flight): hand it straight back for a retry.
            self._end_unstarted(entry, (entry.policy or plan.make_policy(task)).start_delay_seconds,
                                held=False)
            return
        if entry.policy is None:
            entry.policy = plan.make_policy(task)
            self._engine.track(task, entry.policy, polled_at=polled_at)
            entry.tracked = True
        elif self._engine.fence_reason(task.task_id) is not None:  # fenced while in _next_runs
            self._end_unstarted(entry, entry.policy.start_delay_seconds, held=False)
            return
        here = ((e.task, e.child) for e in self._tasks.values() if e.child is not None)  # earlier attempts?
        # From now, not from the poll's send time (a long poll may have waited 5 s before the server
        # handed it out): the previous holder's fence counts from the hand-out, which is before now.
        now = self._clock.monotonic()
        why = self._gate.hold(task, now + entry.policy.start_delay_seconds, now, here)
        if why is not None:  # its lease is held (heartbeats) meanwhile
            entry.phase = Phase.WAITING
            self._engine.start_held(task.task_id)  # its exec timeout counts from the command's start
            self._metrics.on_task_held(task.task_type, True)  # it holds its slot meanwhile
            log.warning("task %s: not starting it yet: %s", task.task_id, why)
            return
        self._start_child(entry)

    def _start_child(self, entry: InFlight) -> None:
        task, plan = entry.task, entry.plan
        task_id = task.task_id

        def on_started(child: Any) -> None:  # on the supervisor's reader thread, once the exec is done
            log.info("task %s (%s, workflow %s) started: pid %d", task_id, task.task_type,
                     task.workflow_id, child.pid)

        self._metrics.on_task_started(task.task_type)
        try:  # returns without waiting for the exec: the next event is handled meanwhile
            entry.child = self._supervisor.start(
                task, _spawn_spec(plan.spec, entry.policy), worker_id=plan.worker_id,
                on_lines=self._lines_sink(entry),
                on_done=lambda exit_: self._events.put(ChildExited(task_id, exit_)), on_started=on_started,
            )  # fmt: skip
        except ProcessError as exc:  # known before asking the fork server (no such command, say)
            self._metrics.on_task_exited(task.task_type, exc, None, None)
            self._engine.child_exited(task.task_id)
            self._logs.close(task.task_id)
            self._report_not_started(entry, exc)
            return
        self._engine.child_started(task.task_id)

    def _start_released(self) -> None:
        for task in self._gate.due(self._clock.monotonic()):
            entry = self._tasks.get(task.task_id)
            if entry is not None and entry.phase is Phase.WAITING:
                entry.phase = Phase.RUNNING
                self._metrics.on_task_held(task.task_type, False)
                log.info("task %s: its previous holder must have stopped by now: starting it", task.task_id)
                self._start_child(entry)

    def _end_unstarted(self, entry: InFlight, wait_left: float, *, held: bool = True) -> None:
        """A task fenced (or stopped) before its command started: report it, or nothing if lost.

        One whose previous holder may still run it (``may_run_elsewhere``) goes back as an unmarked
        IN_PROGRESS, re-queued no sooner than ``wait_left`` (the hold time left): FAILED would make
        the server create a retry at once that nobody waits for (two copies, and a retry spent)."""
        task = entry.task
        if entry.tracked:
            self._engine.child_exited(task.task_id)
            entry.fence = self._engine.fence_reason(task.task_id)
        if held:  # its fence (if any) counts: conductor_run_fences_total
            self._metrics.on_task_held(task.task_type, False, entry.fence)
        if entry.fence is FenceReason.OWNERSHIP_LOST:
            log.warning("task %s: no longer ours before it started; nothing is reported", task.task_id)
            self._forget(entry, None)
            return
        why = fence_text(entry.fence, task, entry) or SHUTDOWN_REASON
        if may_run_elsewhere(task):
            seconds = max(0, math.ceil(wait_left))
            log.warning("task %s: %s before its command started; its previous holder may still run it: "
                        "handing it back (re-queued in %d s, its next holder waits too)", task.task_id,
                        why, seconds)
            self._report(entry, TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                                           callback_after_seconds=seconds, worker_id=entry.plan.worker_id))
            return
        self._report(entry, _failed(task, entry.plan, f"{why} (before its command started)" if held else why))

    def _report_not_started(self, entry: InFlight, why: object) -> None:
        log.error("task %s: could not start the command: %s", entry.task.task_id, why)
        self._report(entry, _failed(entry.task, entry.plan, f"could not start the command: {why}"))

    def _hand_back(self, task: Task, plan: TaskTypePlan) -> None:
        """A task polled beyond our slots and budget: never dropped (the server counts it as ours until
        R), but re-queued at once for any worker: IN_PROGRESS with callbackAfterSeconds 0 makes it
        SCHEDULED again (CONDUCTOR_PROTOCOL.md §3 step 5), unlike FAILED it costs no retry."""
        log.warning("task %s (%s): polled beyond this runner's slots and task budget; handing it back "
                    "to the server (re-queued at once)", task.task_id, task.task_type)
        self._handing_back.add(task.task_id)
        result = TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                            callback_after_seconds=0, worker_id=plan.worker_id)
        if not may_run_elsewhere(task):  # (else its previous holder may still run it: no marker)
            result = mark_yield(result, task.poll_count)
        self._reporter.submit(result, retry_seconds=5.0, poll_count=task.poll_count, task_type=task.task_type)

    def _lines_sink(self, entry: InFlight) -> Callable[[str, list[str]], None]:
        send = entry.log_lines = self._logs.open_lines(entry.task.task_id)
        tail = entry.tail

        def on_lines(stream: str, lines: list[str]) -> None:  # on a reader thread: no blocking here
            for line in lines[-MAX_OUTPUT_LINES:]:  # the tail keeps no more
                tail.append(line)
            send(stream, lines)

        return on_lines

    def _on_fence(self, task_id: str, action: FenceAction) -> None:
        entry = self._tasks.get(task_id)
        start_at = self._gate.start_at(task_id)
        if entry is not None and self._gate.drop(task_id):  # fenced before its command started: no tree
            self._end_unstarted(entry, (start_at or 0.0) - self._clock.monotonic())
            return
        if entry is None or entry.child is None or entry.phase is Phase.REPORTING:
            return
        self._gate.dying.add(entry.task, entry.child)  # a retry polled meanwhile waits for this tree
        kill = isinstance(action, KillTree)
        log.warning("task %s: %s the process tree (%s)", task_id, "killing" if kill else "terminating",
                    action.reason.value.replace("_", " "))
        entry.phase = Phase.STOPPING
        try:
            if isinstance(action, TerminateTree):  # its KILL counts from the fence's own time
                since = action.at if isinstance(self._clock, SystemClock) else None  # a shared clock
                entry.child.terminate_tree(since=since, grace_seconds=action.grace_seconds)
            else:
                entry.child.kill_tree()
        except ProcessError as exc:
            log.error("task %s: could not signal the process tree: %s", task_id, exc)

    def _on_child_exited(self, task_id: str, exit_: Any | None) -> None:
        entry = self._tasks.get(task_id)
        if entry is None:
            return
        self._engine.child_exited(task_id)
        if entry.child is not None:
            self._gate.dying.add(entry.task, entry.child)  # escapees may outlive the child
        entry.fence = self._engine.fence_reason(task_id)
        self._metrics.on_task_exited(entry.task.task_type, exit_, entry.fence,
                                     getattr(entry.plan.spec, "in_progress_exit_code", None))
        start_error = getattr(exit_, "start_error", None)  # the command never ran (an exec failed, say)
        if start_error is not None and entry.fence is not FenceReason.OWNERSHIP_LOST:
            self._logs.close(task_id)
            self._report_not_started(entry, start_error)
            return
        if entry.fence is FenceReason.OWNERSHIP_LOST:
            self._logs.close(task_id)
            log.warning("task %s: no longer ours on the server (cancelled, timed out or re-assigned); "
                        "its tree was killed and nothing is reported", task_id)
            self._forget(entry, None)
            return
        result = self._stream_result_logs(entry, self._result_for(entry, exit_))
        self._logs.close(task_id)
        why = f" ({result.reason_for_incompletion})" if result.reason_for_incompletion else ""
        log.info("task %s: child exited; reporting %s%s", task_id, result.status.value, why)
        if result.status is TaskStatus.IN_PROGRESS:
            self._yield(entry, result)
            return
        self._report(entry, result)

    def _yield(self, entry: InFlight, result: TaskResult) -> None:
        """An IN_PROGRESS result is marked as our yield (its next holder starts at once) only once the
        whole tree is gone: it waits meanwhile, lease heartbeated, up to the tree's effective grace +
        margin (the fork server kills escapees by then); still alive then, it goes out unmarked."""
        if entry.child is None or _tree_gone(entry.child):
            self._report(entry, mark_yield(result, entry.task.poll_count))
            return
        lead = entry.policy.fence_lead_seconds if entry.policy else entry.plan.kill_grace_seconds
        until = self._clock.monotonic() + lead + _YIELD_SLACK_SECONDS
        log.info("task %s: its tree is not gone yet: reporting IN_PROGRESS once it is", entry.task.task_id)
        self._yields.hold(entry.task.task_id, entry.child, result, until)

    def _report_yields(self) -> None:
        if not self._yields:
            return
        for task_id, result, gone in self._yields.due(self._clock.monotonic()):
            entry = self._tasks.get(task_id)
            if entry is None:
                continue
            if gone:
                result = mark_yield(result, entry.task.poll_count)
            else:
                log.warning("task %s: its tree outlived its grace; reporting IN_PROGRESS without the yield "
                            "marker, so its next holder waits", task_id)
            self._report(entry, result)

    def _result_for(self, entry: InFlight, exit_: Any | None) -> TaskResult:
        task, plan = entry.task, entry.plan
        if exit_ is None:
            return _failed(task, plan, "lost track of the child process")
        # An exec timeout is the process layer's own wording ("exec timeout after Ns"), with the
        # child's output kept; any other fence overrides the status and reason.
        timed_out = entry.fence is FenceReason.EXEC_TIMEOUT
        result = self._to_result(task, exit_, plan.spec, plan.worker_id, timed_out=timed_out)
        reason = None if timed_out else fence_text(entry.fence, task, entry)
        if reason is None:
            return result
        return dataclasses.replace(result, status=TaskStatus.FAILED, reason_for_incompletion=reason,
                                   callback_after_seconds=0)

    def _stream_result_logs(self, entry: InFlight, result: TaskResult) -> TaskResult:
        """A result's own log lines (the stdio protocol's ``logs``) go to the task log the way the
        child's stderr went, after it: an update keeps only its first 10 (CONDUCTOR_PROTOCOL.md §6)."""
        if not result.logs:
            return result
        if entry.log_lines is not None:
            entry.log_lines("stdout", [line.log for line in result.logs])  # as written: no prefix
        return dataclasses.replace(result, logs=())

    def _report(self, entry: InFlight, result: TaskResult) -> None:
        if entry.slot_held:  # the child is gone: another may start while this one reports
            entry.slot_held = False
            entry.report_held = True
            self._pollers[entry.plan.poll.task_type].reporting()
        entry.phase = Phase.REPORTING  # (a yield was marked by _yield, once its tree was gone)
        entry.result_status = result.status
        opts = self.options
        if self._forced:
            seconds = 0.0
        elif entry.fence is FenceReason.LEASE_EXPIRED:
            seconds = 5.0  # best effort: the server has most likely moved on already
        elif self._stopping_since is not None:
            seconds = min(opts.report_retry_seconds, opts.shutdown_report_retry_seconds)
        else:
            seconds = opts.report_retry_seconds
        self._metrics.on_result(entry.task.task_type, result)
        self._reporter.submit(result, retry_seconds=seconds, poll_count=entry.task.poll_count,
                              task_type=entry.task.task_type)

    def _on_reported(self, outcome: ReportOutcome) -> None:
        if outcome.task_id in self._handing_back:
            self._handing_back.discard(outcome.task_id)
            return
        entry = self._tasks.get(outcome.task_id)
        if entry is None:
            return
        status = outcome.sent_status or entry.result_status  # a bare FAILED if the result was refused
        if outcome.delivered and status is not None:
            log.debug("task %s: reported %s", outcome.task_id, status.value)  # INFO: start, result
        if outcome.saved_to is not None:
            self._undelivered[outcome.task_id] = (outcome.saved_to, undelivered_snapshot(entry))
            while len(self._undelivered) > _UNDELIVERED_SHOWN:
                del self._undelivered[next(iter(self._undelivered))]
        self._forget(entry, status if outcome.delivered else None)

    def _forget(self, entry: InFlight, status: TaskStatus | None) -> None:
        if entry.tracked:
            # Only now do this run's heartbeats stop (never those of the task's next delivery).
            self._engine.reported(entry.task.task_id, poll_count=entry.task.poll_count)
        self._release_slot(entry)
        self._metrics.on_task_done(entry.task.task_type, status, entry.fence)
        del self._tasks[entry.task.task_id]
        self._statuses[entry.index] = status
        if (next_run := self._next_runs.pop(entry.task.task_id, None)) is not None:
            task, polled_at, policy, surplus = next_run
            try:
                self._engine.view(task.task_id)
            except KeyError:
                policy = None  # its lease ended with the previous run's: _on_task starts a new one
            self._on_task(task, polled_at, policy, surplus=surplus)

    def _release_slot(self, entry: InFlight) -> None:
        if entry.slot_held:
            entry.slot_held = False
            self._pollers[entry.plan.poll.task_type].release()
        if entry.report_held:
            entry.report_held = False
            self._pollers[entry.plan.poll.task_type].reported()

    # ------------------------------------------------------------------ stopping

    def _on_shutdown(self, event: ShutdownRequested) -> None:
        if event.signum is not None and self._signum is None:
            self._signum = event.signum
        name = signal.Signals(event.signum).name if event.signum is not None else None
        if event.force or (self._stopping_since is not None and event.signum is not None):
            self._force_stop(name)
        else:
            self._begin_stop(name, reason="stop requested")

    def _begin_stop(self, signame: str | None, *, reason: str) -> None:
        if self._stopping_since is not None:
            return
        now = self._clock.monotonic()
        self._stopping_since = now
        self._stop_polling.set()
        for poller in self._pollers.values():
            poller.wake()
        for task_id in self._gate.held():  # never started: handed back now
            start_at = self._gate.start_at(task_id) or now
            self._gate.drop(task_id)
            self._end_unstarted(self._tasks[task_id], start_at - now)
        running = [e for e in self._tasks.values() if e.child is not None and e.phase is not Phase.REPORTING]
        why = f"received {signame}" if signame else reason
        deadline = now
        if self.options.drain and running:
            deadline = now + self.options.drain_timeout_seconds
            log.warning("%s: stopped polling; letting %d task(s) finish for up to %.0f s", why,
                        len(running), self.options.drain_timeout_seconds)
            self._engine.shutdown(None, drain_deadline=deadline)
        elif running:
            log.warning("%s: stopped polling; terminating %d task(s)", why, len(running))
            self._engine.shutdown(None, drain_deadline=None)
        else:
            log.info("%s: stopping", why)
        grace = max((e.plan.kill_grace_seconds for e in running), default=0.0)
        self._escalate_at = deadline + grace + _STOP_SAFETY_MARGIN_SECONDS

    def _force_stop(self, signame: str | None) -> None:
        self._begin_stop(signame, reason="forced stop")
        self._forced = True
        log.warning("second signal: killing every task now")
        if self._on_force is not None:
            self._on_force()  # calls in flight end now, not at their timeout
        self._reporter.hurry()
        self._engine.shutdown(None, force=True)
        self._kill_all()

    def _kill_all(self) -> None:
        for entry in self._tasks.values():
            if entry.child is not None and entry.phase is not Phase.REPORTING:
                entry.phase = Phase.STOPPING
                try:
                    entry.child.kill_tree()
                except ProcessError as exc:
                    log.error("task %s: could not kill the process tree: %s", entry.task.task_id, exc)

    def _check_deadlines(self) -> None:
        now = self._clock.monotonic()
        opts = self.options
        if (opts.once and not self._statuses and self._stopping_since is None
                and now - self._started_at >= opts.once_wait_seconds):
            self._begin_stop(None, reason=f"--once: no task within {opts.once_wait_seconds:g} s")
        if self._escalate_at is not None and now >= self._escalate_at:
            self._escalate_at = None
            if any(e.child is not None and e.phase is not Phase.REPORTING for e in self._tasks.values()):
                log.error("children still alive past the stop deadline: killing them")
                self._kill_all()

    def _close(self) -> None:
        # Order matters: output first (bounded), then the reports (each bounded by its deadline),
        # then the heartbeats: the engine stops last so no task loses its lease while reported.
        self._stop_polling.set()
        self._logs.stop(timeout_seconds=5.0)
        self._handle_late_events()  # a task from a poll that ended with the loop goes straight back
        self._reporter.close()
        self._handle_late_events()  # reports finished after the loop ended still stop their heartbeats
        self._engine.stop()
        if self._status is not None:
            self._status.remove()

    def _handle_late_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, TaskPolled | ReportDone):
                self._handle(event)

    # ------------------------------------------------------------------ status

    def _publish(self) -> None:
        # The publisher coalesces: it writes at once on a change, else about once a second.
        if self._status is None:
            return
        tasks = [task_snapshot(e, self._engine, self._clock) for e in self._tasks.values()]
        waiting = still_saved([path for path, _ in self._undelivered.values()]) if self._undelivered else ()
        for task_id, (path, snapshot) in list(self._undelivered.items()):
            if path not in waiting:  # delivered or dropped since
                del self._undelivered[task_id]
            elif task_id not in self._tasks:
                tasks.append(snapshot)
        self._status.publish(tasks, server=server_health(self._pollers.values(), self._contact, self._clock))


def _tree_gone(child: Any) -> bool:
    return bool(child.wait_gone(0))


def _spawn_spec(spec: Any, policy: LeasePolicy | None) -> Any:
    """``spec`` with the policy's effective (capped) kill grace: the fork server's own TERM -> KILL of
    a tree's escapees, after its leader exits, follows the cap the lease's fences do."""
    grace = getattr(spec, "kill_grace_seconds", None)
    if policy is None or grace is None or not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    capped = min(grace, policy.effective_kill_grace_seconds)
    return spec if capped == grace else dataclasses.replace(spec, kill_grace_seconds=capped)


def _failed(task: Task, plan: TaskTypePlan, reason: str) -> TaskResult:
    return TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                      reason_for_incompletion=reason, worker_id=plan.worker_id)


def fence_text(fence: FenceReason | None, task: Task, entry: InFlight) -> str | None:
    """The reasonForIncompletion for a task whose tree was fenced (None: not fenced)."""
    if fence is None:
        return None
    if fence is FenceReason.SHUTDOWN:
        return SHUTDOWN_REASON
    if fence is FenceReason.EXEC_TIMEOUT:
        seconds = entry.policy.exec_timeout_seconds if entry.policy else 0
        return f"exec timeout after {seconds:g}s" if seconds else "exec timeout"
    if fence is FenceReason.HARD_TIMEOUT:
        return f"hard timeout: the task's timeoutSeconds ({task.timeout_seconds}s) passed"
    if fence is FenceReason.LEASE_EXPIRED:
        return "lease expired: no heartbeat was acknowledged within the heartbeat timeout"
    return f"fenced: {fence.value}"
