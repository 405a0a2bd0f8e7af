"""Stopping a run, on the runner's main thread: the order of a stop and its escalation.

``RunStop``, one of the runner's parts (``runner.Runner`` builds it, handing it the shared
``table.TaskTable``, the pollers and their stop flag, the start gate, the engine, the reporter and the
end side). A stop keeps the order of STYLE.md 2.4: polling (and chaining) stops at once; tasks held
and never started are handed back; the engine fences every running task (now, or at the drain
deadline); the children die and their results are reported (``task_end``); heartbeats stop last
(the runner's close). Past the fence's TERM, grace and a safety margin, what still runs is killed
here. A second signal (``force``) kills every tree at once and stops waiting between report
retries (undelivered results go to the outbox).

Main thread only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from leasecore.clock import Clock
from leasecore.errors import ProcessError
from leasecore.handover import StartGate
from leasecore.runner.loop.events import ShutdownRequested
from leasecore.runner.loop.status import Phase
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.loop.task_end import TaskEnds
from leasecore.runner.ports import EnginePort
from leasecore.runner.upstream.poller import Poller
from leasecore.runner.upstream.reporter import Reporter

__all__ = ["RunStop"]

log = logging.getLogger("conductor_run.runner")

STOP_SAFETY_MARGIN_SECONDS = 5.0  # past TERM + grace, the runner kills leftovers itself


class RunStop:
    """Begins, forces and escalates the run's stop (see the module docstring)."""

    def __init__(
        self, table: TaskTable, *, clock: Clock, engine: EnginePort, reporter: Reporter,
        pollers: dict[str, Poller], stop_polling: threading.Event, gate: StartGate, ends: TaskEnds,
        on_force: Callable[[], None] | None,
    ) -> None:  # fmt: skip
        """``on_force()``: called at a forced stop, before the trees are killed (the worker cuts the
        HTTP calls in flight there)."""
        self._t, self._clock, self._engine, self._reporter = table, clock, engine, reporter
        self._pollers, self._stop_polling, self._gate, self._ends = pollers, stop_polling, gate, ends
        self._on_force = on_force
        self.signum: int | None = None  # the first signal that asked for the stop
        self.escalate_at: float | None = None  # when what still runs is killed (None: no stop yet)

    def on_shutdown(self, event: ShutdownRequested) -> None:
        """A signal or ``request_stop``: a second one while stopping forces the stop."""
        if event.signum is not None and self.signum is None:
            self.signum = event.signum
        name = signal.Signals(event.signum).name if event.signum is not None else None
        if event.force or (self._t.stopping_since is not None and event.signum is not None):
            self.force(name)
        else:
            self.begin(name, reason="stop requested")

    def begin(self, signame: str | None, *, reason: str, drain_timeout: float | None = None) -> None:
        """Stop polling and end every task: drained (``--drain``, or ``drain_timeout`` given: a drain
        asked for by ``conductor-run drain``) or terminated now."""
        if self._t.stopping_since is not None:
            return
        now = self._clock.monotonic()
        self._t.stopping_since = now
        self._stop_polling.set()
        for poller in self._pollers.values():
            poller.wake()
        for task_id in self._gate.held():  # never started: handed back now
            start_at = self._gate.start_at(task_id) or now
            self._gate.drop(task_id)
            self._ends.end_unstarted(self._t.tasks[task_id], start_at - now)
        for entry in [e for e in self._t.tasks.values() if e.phase is Phase.WAITING and e.child is None]:
            self._ends.end_unstarted(entry, 0.0)  # its hold over, its read-back in flight: never started
        running = [e for e in self._t.tasks.values()
                   if e.child is not None and e.phase is not Phase.REPORTING]
        why = f"received {signame}" if signame else reason
        deadline = now
        drain = self._t.options.drain or drain_timeout is not None
        timeout = self._t.options.drain_timeout_seconds if drain_timeout is None else drain_timeout
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
        self.escalate_at = deadline + grace + STOP_SAFETY_MARGIN_SECONDS

    def force(self, signame: str | None) -> None:
        """The second signal: every tree is killed now, reports stop waiting between retries."""
        self.begin(signame, reason="forced stop")
        self._t.forced = True
        log.warning("second signal: killing every task now")
        if self._on_force is not None:
            self._on_force()  # calls in flight end now, not at their timeout
        self._reporter.hurry()
        self._engine.shutdown(None, force=True)
        self._kill_all()

    def escalate_if_due(self) -> None:
        """Past the stop's deadline, kill the trees still alive (once)."""
        if self.escalate_at is None or self._clock.monotonic() < self.escalate_at:
            return
        self.escalate_at = None
        if any(e.child is not None and e.phase is not Phase.REPORTING for e in self._t.tasks.values()):
            log.error("children still alive past the stop deadline: killing them")
            self._kill_all()

    def _kill_all(self) -> None:
        for entry in self._t.tasks.values():
            if entry.child is not None and entry.phase is not Phase.REPORTING:
                entry.phase = Phase.STOPPING
                try:
                    entry.child.kill_tree()
                except ProcessError as exc:
                    log.error("task %s: could not kill the process tree: %s", entry.task.task_id, exc)
