"""Deliver final results (``POST /api/tasks``) with retries while they can still matter.

A result is retried on ``ConductorUnavailable`` (and on ``ConductorAuthError``: refused credentials
say nothing about the result) with capped backoff until its deadline (the runner
keeps the task's heartbeats going meanwhile, so the server keeps waiting for it). A 4xx is final:
404 means the task or workflow is gone. A result still undelivered at its deadline is saved to the
outbox and delivered on the next start. Each outcome is handed to ``on_done`` (the runner enqueues
it), after which the runner tells the lease engine to stop heartbeating that task.

Must not: decide what a result says (the runner does) or touch the lease engine itself (its port,
``runner.ports.UpdatePort``, is the runner's guarded update, ``engine.FinalUpdates``).
Threads: a small ``reporter`` pool delivers; ``submit`` and ``close`` from the main thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from leasecore.clock import Clock, SystemClock
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
)
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import TaskResult, TaskStatus
from leasecore.runner.ports import UpdatePort
from leasecore.state.outbox import Outbox

log = logging.getLogger("conductor_run.report")


@dataclass(frozen=True)
class ReportOutcome:
    task_id: str
    delivered: bool
    saved_to: Path | None = None  # the outbox file, when kept for the next start
    error: str | None = None
    sent_status: TaskStatus | None = None  # what was delivered instead of the result (see _bare_failure)


class Reporter:
    """A small pool that delivers final results; see the module docstring."""

    def __init__(
        self,
        port: UpdatePort,
        on_done: Callable[[ReportOutcome], None],
        *,
        outbox: Outbox | None = None,
        clock: Clock | None = None,
        senders: int = 4,
        request_timeout_seconds: float = 10.0,
        backoff_cap_seconds: float = 5.0,
        observer: Observer = NO_METRICS,
    ) -> None:
        """``observer.on_update`` after every attempt (metrics)."""
        self._observer = observer
        self._port = port
        self._on_done = on_done
        self._outbox = outbox
        self._clock = clock or SystemClock()
        self._timeout = request_timeout_seconds
        self._cap = backoff_cap_seconds
        self._hurry = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=senders, thread_name_prefix="reporter")

    def submit(self, result: TaskResult, *, retry_seconds: float, poll_count: int = 0,
               task_type: str = "") -> None:
        """Deliver ``result`` in the background, retrying for up to ``retry_seconds``.

        ``poll_count`` (the task's newest pollCount delivered to us) is kept with the result if it
        goes to the outbox: the next start delivers it only if nobody polled the task since.
        ``task_type`` labels the attempts' metrics.
        """
        deadline = self._clock.monotonic() + retry_seconds
        self._pool.submit(self._deliver_safely, result, deadline, poll_count, task_type)

    def hurry(self) -> None:
        """Stop waiting between retries: one more attempt each, then to the outbox (a forced stop)."""
        self._hurry.set()

    def close(self) -> None:
        """Wait for the deliveries in progress (each is bounded by its deadline)."""
        self._pool.shutdown(wait=True)

    def _deliver_safely(self, result: TaskResult, deadline: float, poll_count: int = 0,
                        task_type: str = "") -> None:
        try:
            outcome = self._deliver(result, deadline, poll_count, task_type)
        except Exception as exc:  # a thread's top level: never lose the outcome
            log.exception("reporting task %s failed unexpectedly", result.task_id)
            outcome = ReportOutcome(result.task_id, delivered=False, error=repr(exc))
        self._on_done(outcome)

    def _update(self, result: TaskResult, timeout_seconds: float, task_type: str) -> None:
        """One attempt, timed for the metrics (``task_update_time_seconds``)."""
        if not self._observer.enabled:
            self._port.update(result, timeout_seconds=timeout_seconds)
            return
        started = self._clock.monotonic()
        try:
            self._port.update(result, timeout_seconds=timeout_seconds)
        except Exception as exc:
            self._observer.on_update(task_type, self._clock.monotonic() - started, exc)
            raise
        self._observer.on_update(task_type, self._clock.monotonic() - started, None)

    def _deliver(
        self, result: TaskResult, deadline: float, poll_count: int = 0, task_type: str = ""
    ) -> ReportOutcome:
        delay = 0.5
        attempt = 0
        while True:
            attempt += 1
            left = deadline - self._clock.monotonic()
            try:
                self._update(result, max(1.0, min(self._timeout, left)), task_type)
                return ReportOutcome(result.task_id, delivered=True)
            except ConductorProtocolError as exc:  # a 2xx we could not parse: the server took it
                log.warning("task %s: unexpected answer to the final update: %s", result.task_id, exc)
                return ReportOutcome(result.task_id, delivered=True)
            except ConductorRejected as exc:
                if not isinstance(exc, ConductorAuthError):
                    log.warning("task %s: the server rejected the result (%s); not retrying",
                                result.task_id, exc)
                    return self._bare_failure(result, exc, deadline, task_type)
                # Refused credentials (rotated, expired) say nothing about the result: retry it, and
                # keep it in the outbox at the deadline rather than drop it.
                if (outcome := self._retry_or_give_up(result, exc, attempt, deadline, delay,
                                                      poll_count)) is not None:
                    return outcome
                delay = min(self._cap, delay * 2)
            except ConductorError as exc:
                if (outcome := self._retry_or_give_up(result, exc, attempt, deadline, delay,
                                                      poll_count)) is not None:
                    return outcome
                delay = min(self._cap, delay * 2)

    def _bare_failure(
        self, result: TaskResult, exc: ConductorRejected, deadline: float, task_type: str = ""
    ) -> ReportOutcome:
        """The server refused the result itself (400, 413, a 500 marked not retryable: too big, too
        deep, a value it cannot take), not the task (404: gone). Report the task FAILED without its
        output and logs, once, so that the server retries it now rather than after its response
        timeout; if that is refused too, nothing more is sent."""
        refused = ReportOutcome(result.task_id, delivered=False, error=str(exc))
        # Only for a run's final result (never an IN_PROGRESS yield or a hand-back: a FAILED there would
        # spend a retry of a task that did not fail), only for what says "this body" (not a 404: gone;
        # not a 409 or a redirect), and only if it would change anything.
        terminal = result.status in _FINAL
        body_refused = exc.status_code in _BODY_REFUSED or (exc.status_code or 0) >= 500
        already_bare = result.status is not TaskStatus.COMPLETED and not (result.output_data or result.logs)
        if not terminal or not body_refused or already_bare or isinstance(exc, ConductorNotFound):
            return refused
        no_retry = result.status is TaskStatus.FAILED_WITH_TERMINAL_ERROR  # a "no retry" result stays one
        status = TaskStatus.FAILED_WITH_TERMINAL_ERROR if no_retry else TaskStatus.FAILED
        bare = TaskResult(result.task_id, result.workflow_id, status, worker_id=result.worker_id,
                          reason_for_incompletion=f"the server refused the task's result ({_short(exc)}); "
                          "reported without its output")  # fmt: skip
        try:
            left = deadline - self._clock.monotonic()
            self._update(bare, max(1.0, min(self._timeout, left)), task_type)
        except ConductorError as again:
            log.warning("task %s: the server refused a bare FAILED too (%s)", result.task_id, again)
            return refused
        log.warning("task %s: reported %s without its output instead", result.task_id, status.value)
        return ReportOutcome(result.task_id, delivered=True, error=str(exc), sent_status=status)

    def _retry_or_give_up(
        self, result: TaskResult, exc: ConductorError, attempt: int, deadline: float, delay: float,
        poll_count: int = 0,
    ) -> ReportOutcome | None:
        """Wait ``delay`` before the next attempt (None), or give up when there is no time left."""
        left = deadline - self._clock.monotonic()
        if self._hurry.is_set() or left <= delay:
            return self._give_up(result, exc, attempt, poll_count)
        if attempt == 1:
            log.warning("task %s: could not report %s yet: %s (retrying for %.0f s)",
                        result.task_id, result.status.value, exc, left)
        self._hurry.wait(delay)
        return None

    def _give_up(
        self, result: TaskResult, exc: ConductorError, attempts: int, poll_count: int = 0
    ) -> ReportOutcome:
        saved: Path | None = None
        if self._outbox is not None:
            try:
                saved = self._outbox.save(result, poll_count=poll_count)
            except OSError as err:
                log.error("task %s: could not save the undelivered result: %s", result.task_id, err)
        where = f"saved to {saved} for the next start" if saved else "lost"
        log.error("task %s: result %s not delivered after %d attempt(s) (%s); %s",
                  result.task_id, result.status.value, attempts, exc, where)
        return ReportOutcome(result.task_id, delivered=False, saved_to=saved, error=str(exc))


_FINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.FAILED_WITH_TERMINAL_ERROR})
_BODY_REFUSED = frozenset({400, 413, 422})  # and a 5xx marked not retryable (a parse error on Conductor)


def _short(exc: Exception, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."
