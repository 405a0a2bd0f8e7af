"""The runner: wires pollers, the lease engine, the process supervisor, the log streamer and the reporter.

Threads only produce events (``leasecore.runner.ports``) onto one queue; the main thread consumes them
and is the only writer of per-task state. Per task the order is fixed:

    poll -> engine.track -> spawn -> (heartbeats, fences) -> child exits -> engine.child_exited
         -> result (by fence reason) -> report (retried) -> engine.reported -> forget

A final update may claim the next task (update-v2, ``leasecore.runner.chain``): that task takes the
finished one's slot and follows the same order from ``engine.track``, its lease counted from the
update's send time. This module owns the loop, the event dispatch, stopping and the status
snapshots; a task's start is ``task_start``' and its end ``task_end``'
(``leasecore.runner.loop.runner_base``); pause, resume, reload and drain while it runs are ``operate``'s.

Shutdown keeps that order (STYLE.md 2.4): stop polling (and chaining) at once; ask the engine to fence
every task (now, or at the drain deadline); the children die; their results are reported; heartbeats
stop last (``engine.reported`` per task, ``engine.stop`` at the very end). A second signal kills
every tree at once and stops waiting between report retries (undelivered results go to the outbox).
Main thread, except ``request_stop``/``handle_signal``/``handle_reload_signal``/``control`` and the
probes' reads (any thread).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import signal
import threading
from collections.abc import Callable
from typing import cast

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ProcessError
from leasecore.handover import DyingTrees, StartGate, YieldHold
from leasecore.lease import FenceAction
from leasecore.masking import Masker
from leasecore.metrics import NO_METRICS, Observer
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.runner.loop.checkpoints import CheckpointScan, resume_port
from leasecore.runner.loop.events import (
    ChainEnded,
    ChildExited,
    ControlRequest,
    Event,
    Fence,
    PollerExited,
    ReloadRequested,
    ReportDone,
    ShutdownRequested,
    TaskPolled,
    Tick,
)
from leasecore.runner.loop.operate import LiveControl
from leasecore.runner.loop.runner_base import ToResult
from leasecore.runner.loop.signals import capture_signals
from leasecore.runner.loop.status import Phase, progress_of_entry, server_health, task_snapshot
from leasecore.runner.loop.task_end import ChainUpdates, _tree_gone
from leasecore.runner.loop.task_start import TaskStarts
from leasecore.runner.ports import (
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
from leasecore.state.outbox import still_saved

__all__ = ["Runner", "ToResult"]

log = logging.getLogger("conductor_run.runner")

# A long poll in flight when a stop starts is waited for up to its poll timeout (<= 5 s) + this, so
# that a task it brings can be handed straight back; a poll stuck past that (a server that accepted
# the connection but does not answer) is abandoned rather than allowed to delay the exit.
_POLLER_JOIN_SLACK_SECONDS = 0.5
_STOP_SAFETY_MARGIN_SECONDS = 5.0  # past TERM + grace, the runner kills leftovers itself
_DYING_POLL_SECONDS = 0.05  # how often a task held for an earlier attempt's dying tree looks again


class Runner(LiveControl, TaskStarts):
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
        self._on_force = on_force
        self._reload = reload
        self._closed = False
        self._secrets = secrets or SecretBook()
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
        # update-v2 chaining: allowed (update_v2 = true) and the call on the port (the client has it;
        # small fakes may not)
        self._chaining = self.options.update_v2 and callable(getattr(conductor, "update_v2", None))
        self._resume_port = resume_port(conductor)  # where a retry finds its earlier attempt's checkpoint
        self._checkpoint_scan = CheckpointScan(self._clock.monotonic())
        self.task_progress: dict[str, tuple[str, float]] = {}  # task id -> (type, 0..1): the metrics' read
        # A final update's read-back after a late heartbeat (docs/final-results.md) reads the task with
        # the client's own call; a small fake without it is never read back.
        readable = callable(getattr(conductor, "get_task_ownership", None))
        reader = cast(TaskReader, conductor) if readable else None
        conductor = RecordedCalls(conductor, self._contact)  # every call counts as server contact
        self._engine = make_engine(lambda task_id, action: self._events.put(Fence(task_id, action)))
        updates: UpdatePort = (
            ChainUpdates(conductor, self._engine, reader=reader, clock=self._clock, observer=metrics)
            if self._chaining else
            FinalUpdates(conductor, self._engine, reader=reader, clock=self._clock, observer=metrics))
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
        self._tasks = {}
        # Tasks polled but not started yet: a re-delivery whose previous holder may still run it, or a
        # retry whose earlier attempt's tree is still dying here (leasecore.handover).
        self._gate = StartGate(DyingTrees(_tree_gone))
        self._handing_back: set[str] = set()  # surplus tasks whose hand-back update is in flight
        # A task's next delivery polled while its previous run's result is reported: started after it.
        self._next_runs = {}
        self._yields = YieldHold(_tree_gone)  # IN_PROGRESS results waiting for their tree to be gone
        self._pollers_alive = len(self._pollers)
        # Task types polled (not paused from the start, or resumed since) whose poller still runs:
        # when the last one ends (budget spent, or it failed) there is no more work. A paused type's
        # poller only waits for a resume or the stop, so a runner whose every type is paused idles
        # until stopped; a type paused live stays counted (it is coming back).
        self._polling_types = {t for t, p in self._plans.items() if not p.poll.paused}
        self._any_polling = bool(self._polling_types)
        self._poller_failed = False
        self._refused: Exception | None = None  # a poller's first polls were refused (see Poller)
        # Tasks whose result the reporter saved to the outbox, shown by ``status`` as undelivered
        # until the file is gone (delivered or dropped by the outbox's redelivery); the newest 100.
        self._undelivered = {}
        self._statuses = []  # per started task, in start order
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
        return RunOutcome(signum=self._signum, started=len(self._statuses), statuses=tuple(self._statuses),
                          poller_failed=self._poller_failed, refused=self._refused,
                          forced=self._forced)  # fmt: skip

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
            self._scan_checkpoints()
            self._maybe_publish()

    def _scan_checkpoints(self) -> None:
        if not self._checkpoint_scan.due(self._clock.monotonic()):
            return
        CheckpointScan.look(
            (e.checkpoint, functools.partial(_send_line, e.log_lines, e.masker))
            for e in self._tasks.values()
            if e.checkpoint is not None and e.log_lines is not None and e.phase is not Phase.REPORTING
        )
        # Replaced whole (the scrape thread reads it): bounded by the tasks in flight.
        self.task_progress = {
            task_id: (e.task.task_type, progress) for task_id, e in self._tasks.items()
            if (progress := progress_of_entry(e)) is not None
        }

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
        # 5 of them a second starved the spawns and heartbeats.
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
        if isinstance(event, TaskPolled) and event.chained_from:  # it takes the slot that task kept
            self._take_chain_slot(event.chained_from)
            self._on_task(event.task, event.polled_at, event.policy, chained=True)
        elif isinstance(event, TaskPolled):
            try:
                self._on_task(event.task, event.polled_at, event.policy, surplus=event.surplus)
            finally:  # the poller that claimed it (its plan is found by the task's own type)
                poller = self._pollers.get(event.poller) or next(iter(self._pollers.values()))
                poller.taken_up()
        elif isinstance(event, ChainEnded):
            self._on_chain_ended(event.task_id)
        elif isinstance(event, ChildExited):
            self._on_child_exited(event.task_id, event.exit)
        elif isinstance(event, Fence):
            self._on_fence(event.task_id, event.action)
        elif isinstance(event, ReportDone):
            self._on_reported(event.outcome)
        elif isinstance(event, ShutdownRequested):
            self._on_shutdown(event)
        elif isinstance(event, ControlRequest):
            self._on_control(event)
        elif isinstance(event, ReloadRequested):
            self._on_reload_signal(event)
        elif isinstance(event, PollerExited):
            self._pollers_alive -= 1
            self._poller_failed |= event.failed
            self._polling_types.discard(event.task_type)
            if event.refused is not None and self._refused is None:
                self._refused = event.refused
                self._begin_stop(None, reason=f"the server refused the first poll of {event.task_type}")

    # ------------------------------------------------------------------ stopping

    def _on_shutdown(self, event: ShutdownRequested) -> None:
        if event.signum is not None and self._signum is None:
            self._signum = event.signum
        name = signal.Signals(event.signum).name if event.signum is not None else None
        if event.force or (self._stopping_since is not None and event.signum is not None):
            self._force_stop(name)
        else:
            self._begin_stop(name, reason="stop requested")

    def _begin_stop(self, signame: str | None, *, reason: str, drain_timeout: float | None = None) -> None:
        """Stop polling and end every task: drained (``--drain``, or ``drain_timeout`` given: a drain
        asked for by ``conductor-run drain``) or terminated now."""
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
        drain = self.options.drain or drain_timeout is not None
        timeout = self.options.drain_timeout_seconds if drain_timeout is None else drain_timeout
        if drain and running:
            deadline = now + timeout
            log.warning("%s: stopped polling; letting %d task(s) finish for up to %.0f s", why,
                        len(running), timeout)
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
        self._closed = True  # control requests are answered "stopping" from now on
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
            if isinstance(event, TaskPolled | ChainEnded | ReportDone):
                self._handle(event)
            elif isinstance(event, ControlRequest):
                event.answer({"ok": False, "error": "the runner is stopping"})

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
        self._status.publish(tasks, server=server_health(self._pollers.values(), self._contact, self._clock),
                             paused=self.paused_types(), stopping=self._stopping_since is not None)


def _send_line(send: Callable[[str, list[str]], None], masker: Masker | None, line: str) -> None:
    # Unprefixed: a marked line must start the log line. A checkpoint is the child's data, masked
    # like its output (it does not pass the output's stream masker).
    send("stdout", [masker.mask(line) if masker else line])
