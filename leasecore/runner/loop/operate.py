"""Operating a running runner: pause, resume, reload and drain, on the runner's main thread.

``LiveControl``, one of the runner's parts (``runner.Runner`` builds it, handing it the shared
``table.TaskTable``, the pollers, the reload and the stop). Requests come from the control socket's thread
(``leasecore.state.control``), which calls ``control(request)``: that only puts a ``ControlRequest``
on the main loop's queue and waits for the answer, so the main thread stays the only writer of the
runner's state, as with signals (SIGHUP puts a ``ReloadRequested``).

- pause / resume: the task types' pollers stop (or start) claiming work (``Poller.set_paused``): no
  poll leaves once the one in flight has returned, and what it claims is handed back at once;
  running tasks keep their leases, heartbeats and fences.
- reload: ``reload()`` (the wiring's) loads the configuration again and either refuses it (a
  ``ConfigError``: unparseable, invalid, or a restart-only key changed; nothing changes) or returns
  a ``LiveChange``: new plans for the tasks started from now on, new options. A live pause or resume
  survives a reload unless the file's ``paused`` for that type changed.
- drain: the stop of ``--drain`` (polling ends, the running tasks finish, up to the timeout, then
  ``--drain-timeout``'s rules), asked for without a signal; the run ends as a clean stop.
Main thread, except ``control`` and ``handle_reload_signal`` (any thread, a signal handler).
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any, Protocol

from leasecore.clock import Clock
from leasecore.errors import ConfigError
from leasecore.runner.loop.events import ControlRequest, Event, ReloadRequested
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.ports import LiveChange
from leasecore.runner.upstream.poller import Poller

log = logging.getLogger("conductor_run.runner")

CONTROL_ANSWER_SECONDS = 10.0  # a main loop that does not answer within this is reported as such


class LiveControl:
    """The main thread's side of pause, resume, reload and drain (see the module docstring)."""

    def __init__(
        self, table: TaskTable, *, events: queue.SimpleQueue[Event], clock: Clock,
        pollers: dict[str, Poller], reload: Callable[[], LiveChange] | None, begin_stop: BeginStop,
        escalate_at: Callable[[], float | None],
    ) -> None:
        """``begin_stop``: ``Runner``'s stop (drained); ``escalate_at()``: when that stop kills what
        still runs (None: no stop yet)."""
        self._t, self._events, self._clock, self._pollers = table, events, clock, pollers
        self._reload, self._begin_stop, self._escalate_at = reload, begin_stop, escalate_at
        self.closed = False  # set once the run ends: requests are answered "stopping"
        # Task types polled (not paused from the start, or resumed since) whose poller still runs:
        # when the last one ends (budget spent, or it failed) there is no more work. A paused type's
        # poller only waits for a resume or the stop, so a runner whose every type is paused idles
        # until stopped; a type paused live stays counted (it is coming back).
        self.polling_types = {t for t, p in table.plans.items() if not p.poll.paused}
        self.any_polling = bool(self.polling_types)

    # ------------------------------------------------------------------ any thread

    def control(self, request: dict[str, Any]) -> dict[str, Any]:
        """Hand a checked control request (``leasecore.state.control.parse_request``) to the main
        loop and wait for its answer. Thread-safe; called by the control socket's thread."""
        if self.closed:
            return {"ok": False, "error": "the runner is stopping"}
        answers: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._events.put(ControlRequest(request["command"], tuple(request.get("task_types") or ()),
                                        request.get("timeout_seconds"), answer=answers.put))
        try:
            return answers.get(timeout=CONTROL_ANSWER_SECONDS)
        except queue.Empty:
            return {"ok": False, "error": f"the runner did not answer within {CONTROL_ANSWER_SECONDS:g} s"}

    def handle_reload_signal(self) -> None:
        """SIGHUP's handler: enqueue only (``SimpleQueue.put`` is reentrant)."""
        self._events.put(ReloadRequested())

    def paused_types(self) -> list[str]:
        """The task types not polled now (read by the probes' and metrics' thread too)."""
        return [t for t, poller in self._pollers.items() if poller.paused]

    # ------------------------------------------------------------------ main thread

    def on_control(self, event: ControlRequest) -> None:
        try:
            reply = self._control(event)
        except Exception:  # a bug here must not end the runner: the operator sees it failed
            log.exception("the control request %r failed", event.command)
            reply = {"ok": False, "error": "the request failed: see the runner's log"}
        event.answer(reply)

    def _control(self, event: ControlRequest) -> dict[str, Any]:
        if event.command == "drain":
            return self._drain(event.timeout_seconds)
        if self._t.stopping_since is not None:
            return {"ok": False, "error": "the runner is stopping"}
        if event.command == "reload":
            return self._reload_now("conductor-run reload")
        unknown = [t for t in event.task_types if t not in self._pollers]
        if unknown:
            return {"ok": False, "error": f"this runner does not serve {', '.join(unknown)} "
                                          f"(it serves {', '.join(self._pollers)})"}
        pause = event.command == "pause"
        types = event.task_types or tuple(self._pollers)
        changed = [t for t in types if self._set_paused(t, pause)]
        if changed:
            if pause:
                log.warning("paused %s (conductor-run pause): not polling; running tasks go on",
                            ", ".join(changed))
            else:
                log.warning("resumed %s (conductor-run resume): polling again", ", ".join(changed))
        return {"ok": True, "changed": changed, "paused": self.paused_types()}

    def _set_paused(self, task_type: str, paused: bool) -> bool:
        poller = self._pollers[task_type]
        if not paused and poller.alive:  # polled from now on: its end counts for "no more work"
            self.polling_types.add(task_type)
            self.any_polling = True
        return poller.set_paused(paused)

    def on_reload_signal(self, _event: ReloadRequested) -> None:
        if self._t.stopping_since is not None:
            log.info("SIGHUP while stopping: not reloading")
            return
        try:
            self._reload_now("SIGHUP")
        except Exception:  # a bug here must not end the runner
            log.exception("the reload asked for by SIGHUP failed")

    def _reload_now(self, origin: str) -> dict[str, Any]:
        if self._reload is None:
            return {"ok": False, "error": "this runner cannot reload its configuration"}
        try:
            change = self._reload()
        except ConfigError as exc:
            log.error("reload (%s) refused, nothing changed: %s", origin, exc)
            return {"ok": False, "error": f"reload refused, nothing changed: {exc}"}
        for plan in change.plans:
            task_type = plan.poll.task_type
            self._t.plans[task_type] = plan  # for the tasks started from now on
            self._pollers[task_type].reconfigure(plan.poll)
        for task_type, paused in change.paused:
            self._set_paused(task_type, paused)
        self._t.options = change.options
        for warning in change.warnings:
            log.warning("%s", warning)
        if change.changes:
            log.warning("reloaded the configuration (%s): %s", origin, "; ".join(change.changes))
        else:
            log.info("reloaded the configuration (%s): nothing changed", origin)
        return {"ok": True, "changed": list(change.changes), "paused": self.paused_types()}

    def _drain(self, timeout_seconds: float | None) -> dict[str, Any]:
        running = sum(1 for e in self._t.tasks.values() if e.child is not None)
        if self._t.stopping_since is not None:
            return {"ok": True, "changed": [], "running": running, "already_stopping": True,
                    "exit_within_seconds": self._exit_within()}
        timeout = self._t.options.drain_timeout_seconds if timeout_seconds is None else timeout_seconds
        self._begin_stop(None, reason="drain requested (conductor-run drain)", drain_timeout=timeout)
        return {"ok": True, "changed": ["draining"], "running": running, "drain_timeout_seconds": timeout,
                "exit_within_seconds": self._exit_within()}

    def _exit_within(self) -> float:
        """Seconds until the stop kills whatever still runs (the drain deadline, grace and margin)."""
        now = self._clock.monotonic()
        return max(0.0, (self._escalate_at() or now) - now)


class BeginStop(Protocol):
    """``Runner``'s stop: polling ends, the tasks end (drained for ``drain_timeout``)."""

    def __call__(self, signame: str | None, *, reason: str, drain_timeout: float | None = None) -> None: ...
