"""Stopping a run, on the runner's main thread: the order of a stop and its escalation.

``RunStop``, one of the runner's parts (``runner.Runner`` builds it, handing it the shared
``table.TaskTable``, the pollers and their stop flag, the start gate, the engine, the reporter and the
end side). A stop keeps the order of STYLE.md 2.4: polling (and chaining) stops at once; tasks held
and never started are handed back; the engine fences every running task (now, or at the drain
deadline); the children die and their results are reported (``task_end``); heartbeats stop last
(the runner's close). Past the fence's TERM, grace and a safety margin, what still runs is killed
here. A second signal (``force``) kills every tree at once and stops waiting between report
retries (undelivered results go to the outbox).

When the run ends is a pure decision, ``run_end`` over a ``RunView``: carry on, stop (no more work:
the task limit is reached, or every polled type's poller ended), or finished (nothing in flight once
a stop began, and every poller gone or the last poll past its timeout and abandoned).

Main thread only.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

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

__all__ = ["Carry", "Finished", "RunStop", "RunView", "StopFor", "run_end"]

log = logging.getLogger("conductor_run.runner")

STOP_SAFETY_MARGIN_SECONDS = 5.0  # past TERM + grace, the runner kills leftovers itself
# A long poll in flight when a stop starts is waited for up to its poll timeout (<= 5 s) + this, so
# that a task it brings can be handed straight back; a poll stuck past that (a server that accepted
# the connection but does not answer) is abandoned rather than allowed to delay the exit.
POLLER_JOIN_SLACK_SECONDS = 0.5


@dataclass(frozen=True, eq=False)
class RunView:
    """What ``run_end`` reads of the run, once per turn of the main loop."""

    in_flight: int  # tasks the runner holds (polled, running, reporting)
    stopping_for: float | None  # seconds since the stop began (None: no stop yet)
    pollers_alive: int
    longest_poll_seconds: float  # the longest poll timeout of the task types
    started: int  # tasks started so far
    task_limit: int | None  # --once (1) or max_tasks; None: no limit
    polled_any: bool  # some task type was polled at all (not every one paused from the start)
    polling: bool  # some polled task type's poller still runs


@dataclass(frozen=True)
class Carry:
    """The run goes on."""


@dataclass(frozen=True)
class StopFor:
    """No more work: begin the stop, for ``reason``."""

    reason: str


@dataclass(frozen=True)
class Finished:
    """The run is over; ``abandoned_poll``: a poll still in flight past its timeout is not waited for."""

    abandoned_poll: bool = False


def run_end(view: RunView) -> Carry | StopFor | Finished:
    """Whether the run goes on, must begin its stop, or is over (see the module docstring)."""
    if view.in_flight:
        return Carry()
    if view.stopping_for is not None:
        if view.pollers_alive == 0:
            return Finished()
        if view.stopping_for > view.longest_poll_seconds + POLLER_JOIN_SLACK_SECONDS:
            return Finished(abandoned_poll=True)
        return Carry()
    if view.task_limit is not None and view.started >= view.task_limit:
        return StopFor("no more work to do")
    if view.polled_any and not view.polling:
        return StopFor("no more work to do")
    return Carry()


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
