"""The runner: wires pollers, the lease engine, the process supervisor, the log streamer and the reporter.

Threads only produce events (``leasecore.runner.ports``) onto one queue; the main thread consumes them
and is the only writer of per-task state. Per task the order is fixed:

    poll -> engine.track -> spawn -> (heartbeats, fences) -> child exits -> engine.child_exited
         -> result (by fence reason) -> report (retried) -> engine.reported -> forget

A final update may claim the next task (update-v2, ``leasecore.runner.chain``): that task takes the
finished one's slot and follows the same order from ``engine.track``, its lease counted from the
update's send time. This module owns the loop, the event dispatch, stopping and the status
snapshots. It is composed of parts, each with one job, handed the shared ``table.TaskTable`` (the
tasks in flight, their next runs, the tally of outcomes, whether a stop began) and the ports they
use: ``task_start.TaskStarts`` (a delivery up to its running child, by ``decisions.admit``),
``task_end.TaskEnds`` (fences, exits and reports, by ``decisions.exit_meaning``) and
``operate.LiveControl`` (pause, resume, reload and drain while it runs), ``stopping.RunStop`` (the
order of a stop and its escalation) and ``publishing.SnapshotPublisher`` (the status snapshots).

Shutdown keeps that order (STYLE.md 2.4; ``stopping``): stop polling (and chaining) at once; the engine
fences every task; the children die; their results are reported; heartbeats stop last
(``engine.reported`` per task, ``engine.stop`` at the very end, in ``_close``).
Main thread, except ``request_stop``/``handle_signal``/``handle_reload_signal``/``control`` and the
probes' reads (any thread).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from leasecore.clock import Clock, SystemClock
from leasecore.handover import DyingTrees, StartGate
from leasecore.lease import FenceAction
from leasecore.masking import Masker
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.runner.loop.checkpoints import CheckpointScan, resume_port
from leasecore.runner.loop.events import (
    ChainEnded,
    ChildExited,
    ControlRequest,
    Event,
    Fence,
    HeldRead,
    PollerExited,
    ReloadRequested,
    ReportDone,
    ShutdownRequested,
    TaskPolled,
    Tick,
)
from leasecore.runner.loop.operate import LiveControl
from leasecore.runner.loop.publishing import SnapshotPublisher
from leasecore.runner.loop.signals import capture_signals
from leasecore.runner.loop.status import NextRun, Phase, progress_of_entry
from leasecore.runner.loop.stopping import Finished, RunStop, RunView, StopFor, run_end
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.loop.task_end import ChainUpdates, TaskEnds, ToResult, _tree_gone
from leasecore.runner.loop.task_start import TaskStarts
from leasecore.runner.ports import (
    ChainPort,
    ConductorPort,
    EnginePort,
    LiveChange,
    RunOptions,
    RunOutcome,
    StatusPort,
    SupervisorPort,
    TaskReader,
    TaskTypePlan,
    UpdatePort,
)
from leasecore.runner.secretbook import SecretBook
from leasecore.runner.upstream.logsink import LogStreamer
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.runner.upstream.server_contact import RecordedCalls, ServerContact

__all__ = ["Runner", "ToResult"]

log = logging.getLogger("conductor_run.runner")

_DYING_POLL_SECONDS = 0.05  # how often a task held for an earlier attempt's dying tree looks again


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
        reload: Callable[[], LiveChange] | None = None,
        secrets: SecretBook | None = None,
    ) -> None:
        """``reporter(updates, on_done)`` builds the reporter around ``updates``: the conductor's
        ``update`` guarded by the engine (``FinalUpdates``: no heartbeat overlaps or follows a final
        update), so no caller can forget the guard. ``server_contact`` records the outcome of every call to
        the server for the status snapshots; pass the one that records the engine's calls too
        (``leasecore.runner.upstream.server_contact.RecordedLeaseCalls``). ``on_force()``: called on the main
        thread at a forced stop (the second signal), before the trees are killed: the worker cuts the HTTP
        calls in flight there (``ConductorClient.abort``). ``metrics``: the hooks of ``leasecore.metrics``
        (the runner's own, and its pollers' and default reporter's). ``reload()``: the configuration
        loaded again, as a ``LiveChange``, or a ``ConfigError`` refusing it
        (``leasecore.runner.loop.operate``); None: this runner cannot reload. ``secrets``: the values masked
        in the runner's own log (each task's runtime metadata is added while the task is here)."""
        if not plans:
            raise ValueError("a runner needs at least one task type")
        self._metrics = metrics
        self.loop_at: float | None = None  # monotonic time the main loop last turned (liveness probe)
        self._t = TaskTable(options or RunOptions(), {p.poll.task_type: p for p in plans})
        self._clock = clock or SystemClock()
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._status = status
        self._contact = contact or ServerContact(self._clock)
        # update-v2 chaining: allowed (update_v2 = true) and the call on the port (the client has it;
        # small fakes may not)
        chaining = self.options.update_v2 and isinstance(conductor, ChainPort)
        self._checkpoint_scan = CheckpointScan(self._clock.monotonic())
        self.task_progress: dict[str, tuple[str, float]] = {}  # task id -> (type, 0..1): the metrics' read
        # A final update's read-back after a late heartbeat (docs/final-results.md), and a held task's
        # before its start, read the task with the client's own call; a small fake without it is not read.
        reader = conductor if isinstance(conductor, TaskReader) else None
        resume = resume_port(conductor)  # where a retry finds its earlier attempt's checkpoint
        conductor = RecordedCalls(conductor, self._contact)  # every call counts as server contact
        self._engine = make_engine(lambda task_id, action: self._events.put(Fence(task_id, action)))
        updates: UpdatePort = (
            ChainUpdates(conductor, self._engine, reader=reader, clock=self._clock, observer=metrics)
            if chaining else
            FinalUpdates(conductor, self._engine, reader=reader, clock=self._clock, observer=metrics))
        make_reporter = reporter or (lambda port, done: Reporter(port, done, clock=self._clock,
                                                                 observer=metrics))
        self._reporter = make_reporter(updates, lambda outcome: self._events.put(ReportDone(outcome)))
        self._logs = logs or LogStreamer(conductor, clock=self._clock)
        self._stop_polling = threading.Event()
        self._budget = WorkBudget(self._task_limit())
        self._pollers: dict[str, Poller] = {}  # (filled below: each poller calls into the start side)
        # Tasks polled but not started yet: a re-delivery whose previous holder may still run it, or a
        # retry whose earlier attempt's tree is still dying here (leasecore.handover).
        self._gate = StartGate(DyingTrees(_tree_gone))
        secrets = secrets or SecretBook()
        # The end side calls back into the start side (an update-v2's claimed task, a next run): bound
        # late, once both exist.
        self._ends = TaskEnds(self._t, clock=self._clock, metrics=metrics, engine=self._engine,
                              reporter=self._reporter, logs=self._logs, pollers=self._pollers,
                              gate=self._gate, to_result=to_result, chaining=chaining, secrets=secrets,
                              chained=self._on_chained, replay=self._replay)
        self._starts = TaskStarts(self._t, self._ends, events=self._events, clock=self._clock,
                                  metrics=metrics, engine=self._engine, supervisor=supervisor,
                                  reporter=self._reporter, logs=self._logs, pollers=self._pollers,
                                  budget=self._budget, gate=self._gate, secrets=secrets, resume=resume,
                                  reader=reader)
        self._pollers.update({
            t: Poller(conductor, p.poll, functools.partial(self._starts.on_polled, poller=t),
                      budget=self._budget, stop=self._stop_polling,
                      on_exit=lambda tt: self._events.put(PollerExited(tt, self._pollers[tt].failed,
                                                                       self._pollers[tt].refused)),
                      clock=self._clock, on_surplus=functools.partial(self._starts.on_surplus, poller=t),
                      end_on_refusal_at_start=True, observer=metrics)
            for t, p in self._t.plans.items()
        })
        self._stop = RunStop(self._t, clock=self._clock, engine=self._engine, reporter=self._reporter,
                             pollers=self._pollers, stop_polling=self._stop_polling, gate=self._gate,
                             ends=self._ends, on_force=on_force)
        self._live = LiveControl(self._t, events=self._events, clock=self._clock, pollers=self._pollers,
                                 reload=reload, begin_stop=self._stop.begin,
                                 escalate_at=lambda: self._stop.escalate_at)
        self._snapshots = SnapshotPublisher(self._t, clock=self._clock, engine=self._engine, status=status,
                                            pollers=self._pollers, contact=self._contact,
                                            paused_types=self.paused_types)
        self._pollers_alive = len(self._pollers)
        self._poller_failed = False
        self._refused: Exception | None = None  # a poller's first polls were refused (see Poller)
        self._started_at = self._clock.monotonic()

    def _on_chained(self, task: Task | None, sent_at: float, *, from_task: str, poller: str) -> None:
        self._starts.on_chained(task, sent_at, from_task=from_task, poller=poller)

    def _replay(self, run: NextRun) -> None:
        self._starts.replay(run)

    @property
    def options(self) -> RunOptions:
        """The options in force (a reload may replace them)."""
        return self._t.options

    # ------------------------------------------------------------------ public

    @property
    def stopping(self) -> bool:
        """A stop has begun (read by the readiness probe's thread)."""
        return self._t.stopping_since is not None

    def failed_pollers(self) -> list[str]:
        """Task types whose poller ended on an unexpected error (the liveness probe's)."""
        return [t for t, p in self._pollers.items() if p.failed]

    def paused_types(self) -> list[str]:
        """The task types not polled now (read by the probes' and metrics' thread too)."""
        return self._live.paused_types()

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """An operator's checked request (``LiveControl.control``); thread-safe."""
        return self._live.control(request)

    def handle_reload_signal(self) -> None:
        """SIGHUP's handler: enqueue only (``SimpleQueue.put`` is reentrant)."""
        self._live.handle_reload_signal()

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
        handlers = (capture_signals(self.handle_signal, on_reload=self.handle_reload_signal)
                    if install_signal_handlers else None)
        with handlers or contextlib.nullcontext():
            self._engine.start()
            self._logs.start()
            try:
                for poller in self._pollers.values():
                    poller.start()
                self._loop()
            finally:
                self._close()
        tally = self._t.tally
        return RunOutcome(signum=self._stop.signum, started=tally.started, statuses=tally.statuses(),
                          folded_not_completed=tally.folded_not_completed,
                          poller_failed=self._poller_failed, refused=self._refused,
                          forced=self._t.forced)  # fmt: skip

    # ------------------------------------------------------------------ main loop

    def _loop(self) -> None:
        self._snapshots.publish()
        while not self._done():
            try:  # an event waiting already (say a report behind a claimed task) needs no wait worked out
                event: Event = self._events.get_nowait()
            except queue.Empty:
                event = self._next_event()
            self.loop_at = self._clock.monotonic()
            self._handle(event)
            self._ends.report_yields()
            self._starts.start_released()
            self._check_deadlines()
            self._scan_checkpoints()
            self._snapshots.maybe_publish()

    def _next_event(self) -> Event:
        """The next event, waited for no longer than the next thing due (a publish, a held task's
        start, a dying tree's look); a Tick if none came by then."""
        wait = self._snapshots.wait_seconds(min(0.5, self._t.options.status_interval_seconds))
        now = self._clock.monotonic()
        if (start_at := self._gate.next_at(now, poll_seconds=_DYING_POLL_SECONDS)) is not None:
            wait = max(0.0, min(wait, start_at - now))
        if self._ends.holding():
            wait = min(wait, _DYING_POLL_SECONDS)
        try:
            return self._events.get(timeout=wait)
        except queue.Empty:
            return Tick()

    def _scan_checkpoints(self) -> None:
        if not self._checkpoint_scan.due(self._clock.monotonic()):
            return
        CheckpointScan.look(
            (e.checkpoint, functools.partial(_send_line, e.log_lines, e.masker))
            for e in self._t.tasks.values()
            if e.checkpoint is not None and e.log_lines is not None and e.phase is not Phase.REPORTING
        )
        # Replaced whole (the scrape thread reads it): bounded by the tasks in flight.
        self.task_progress = {
            task_id: (e.task.task_type, progress) for task_id, e in self._t.tasks.items()
            if (progress := progress_of_entry(e)) is not None
        }

    def _task_limit(self) -> int | None:
        return 1 if self._t.options.once else self._t.options.max_tasks

    def _done(self) -> bool:
        if self._t.tasks:  # run_end's first rule (nothing ends while a task is here), without its view:
            return False  # the usual turn pays a dict's truth instead of building one
        stopping_since = self._t.stopping_since
        end = run_end(RunView(
            in_flight=len(self._t.tasks),
            stopping_for=None if stopping_since is None else self._clock.monotonic() - stopping_since,
            pollers_alive=self._pollers_alive,
            longest_poll_seconds=max(p.poll.timeout_ms for p in self._t.plans.values()) / 1000.0,
            started=self._t.tally.started, task_limit=self._task_limit(),
            polled_any=self._live.any_polling, polling=bool(self._live.polling_types)))  # fmt: skip
        if isinstance(end, StopFor):
            self._stop.begin(None, reason=end.reason)
        elif isinstance(end, Finished) and end.abandoned_poll:
            log.warning("a poll is still in flight past its timeout: not waiting for it (a task it "
                        "brings now is retried by the server after its response timeout)")
        return isinstance(end, Finished)

    def _handle(self, event: Event) -> None:
        # (a task's three events first: its exit, its report's outcome, its delivery)
        if isinstance(event, ChildExited):
            self._ends.on_child_exited(event.task_id, event.exit)
        elif isinstance(event, ReportDone):
            self._ends.on_reported(event.outcome)
        elif isinstance(event, TaskPolled) and event.chained_from:  # it takes the slot that task kept
            self._ends.take_chain_slot(event.chained_from)
            self._starts.admit(event.task, event.polled_at, event.policy, chained=True)
        elif isinstance(event, TaskPolled):
            try:
                self._starts.admit(event.task, event.polled_at, event.policy, surplus=event.surplus)
            finally:  # the poller that claimed it (its plan is found by the task's own type)
                poller = self._pollers.get(event.poller) or next(iter(self._pollers.values()))
                poller.taken_up()
        elif isinstance(event, ChainEnded):
            self._ends.on_chain_ended(event.task_id)
        elif isinstance(event, HeldRead):
            self._starts.on_held_read(event)
        elif isinstance(event, Fence):
            self._ends.on_fence(event.task_id, event.action)
        elif isinstance(event, ShutdownRequested):
            self._stop.on_shutdown(event)
        elif isinstance(event, ControlRequest):
            self._live.on_control(event)
        elif isinstance(event, ReloadRequested):
            self._live.on_reload_signal(event)
        elif isinstance(event, PollerExited):
            self._pollers_alive -= 1
            self._poller_failed |= event.failed
            self._live.polling_types.discard(event.task_type)
            if event.refused is not None and self._refused is None:
                self._refused = event.refused
                self._stop.begin(None, reason=f"the server refused the first poll of {event.task_type}")

    # ------------------------------------------------------------------ stopping

    def _check_deadlines(self) -> None:
        opts = self._t.options
        if (opts.once and not self._t.tally.started and self._t.stopping_since is None
                and self._clock.monotonic() - self._started_at >= opts.once_wait_seconds):
            self._stop.begin(None, reason=f"--once: no task within {opts.once_wait_seconds:g} s")
        self._stop.escalate_if_due()

    def _close(self) -> None:
        # Order matters: output first (bounded), then the reports (each bounded by its deadline),
        # then the heartbeats: the engine stops last so no task loses its lease while reported.
        self._live.closed = True  # control requests are answered "stopping" from now on
        self._stop_polling.set()
        self._logs.stop(timeout_seconds=5.0)
        self._handle_late_events()  # a task from a poll that ended with the loop goes straight back
        self._reporter.close()
        self._handle_late_events()  # reports finished after the loop ended still stop their heartbeats
        self._starts.close()
        self._engine.stop()
        if self._status is not None:
            self._status.remove()

    def _handle_late_events(self) -> None:
        while True:
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return
            if isinstance(event, TaskPolled | ChainEnded | ReportDone):
                self._handle(event)
            elif isinstance(event, ControlRequest):
                event.answer({"ok": False, "error": "the runner is stopping"})


def _send_line(send: Callable[[str, list[str]], None], masker: Masker | None, line: str) -> None:
    # Unprefixed: a marked line must start the log line. A checkpoint is the child's data, masked
    # like its output (it does not pass the output's stream masker).
    send("stdout", [masker.mask(line) if masker else line])
