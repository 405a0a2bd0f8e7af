"""Deliver final results (``POST /api/tasks``, or update-v2 to claim the next task) with retries.

What each failed attempt means is ``leasecore.lease.finalfailure``'s table (``decide``); this module
carries it out: a result is retried on ``ConductorUnavailable`` (and on ``ConductorAuthError``:
refused credentials say nothing about the result) with the capped ``REPORT_BACKOFF`` until its
deadline (the runner keeps the task's heartbeats going meanwhile, so the server keeps waiting for it).
An update whose answer was lost is read back first (``reader``), once it can no longer land, and sent
again only if it never landed. A result of a lease that ran out (``submit(read_first=True)``) is
sent only if the task read back is still ours (``finalfailure.lost_lease_read``): otherwise it could
land on another runner's delivery of the same task.
A 4xx is final: 404 means the task or workflow is gone. A result still undelivered at its deadline is
saved to the outbox and delivered on the next start. Each outcome is handed to ``on_done`` (the
runner enqueues it), after which the runner tells the lease engine to stop heartbeating that task.

Chaining (``submit(on_chained=...)``, ``leasecore.runner.chain``): the first attempt goes out as
update-v2 and ``on_chained(task or None, sent_at)`` is called exactly once, before ``on_done``, with
the task the server claimed (its lease counts from ``sent_at``, the attempt's send time). Every
retry is v1: update-v2 is never resent (a second one claims again, even for a task already
terminal). 405, or a 404 that v1 then takes, turns update-v2 off for good (``chaining``).

Must not: decide what a result says (the runner does) or touch the lease engine itself (its port,
``runner.ports.UpdatePort``, is the runner's guarded update, ``engine.FinalUpdates``).
Threads: a small ``reporter`` pool (``senderpool.SenderPool``) delivers; ``submit`` and ``close`` from
the main thread; ``chaining`` and ``hurry`` from any.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorError
from leasecore.lease.finalfailure import (
    Attempt,
    Delivered,
    FallBackToV1,
    GiveUp,
    ReadBack,
    Retry,
    Save,
    SendBare,
    after_read_back,
    bare_result,
    decide,
    failure_of,
    lost_lease_read,
    report_backoff,
)
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.ports import ChainPort, TaskReader, TimedChainPort, UpdatePort
from leasecore.runner.upstream.senderpool import SenderPool
from leasecore.state.outbox import Outbox

log = logging.getLogger("conductor_run.report")


OnChained = Callable[[Task | None, float], None]  # (the task update-v2 claimed or None, its send time)


@dataclass(frozen=True, eq=False)
class ReportOutcome:
    task_id: str
    delivered: bool
    saved_to: Path | None = None  # the outbox file, when kept for the next start
    error: str | None = None
    sent_status: TaskStatus | None = None  # what was delivered instead of the result (see _bare_failure)
    via: str = ""  # the endpoint that took it: "v1" (POST /api/tasks) or "v2" (update-v2); "": none


class _Chain:
    """One submission's chaining: ``on_chained`` is called exactly once (``end``)."""

    def __init__(self, on_chained: OnChained | None) -> None:
        self._on_chained = on_chained
        self.pending = on_chained is not None  # the next attempt goes out as update-v2

    def end(self, task: Task | None, sent_at: float) -> None:
        self.pending = False
        callback, self._on_chained = self._on_chained, None
        if callback is not None:
            callback(task, sent_at)


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
        reader: TaskReader | None = None,
        wait: Callable[[float], object] | None = None,
    ) -> None:
        """``observer.on_update`` after every attempt (metrics). ``reader`` reads a task back after
        its update's answer was lost (None: the port's ``reader``, if it has one; else never read back).
        ``wait(seconds)`` waits between attempts (default: until ``hurry``; tests step a clock)."""
        self._observer = observer
        self._port = port
        self._on_done = on_done
        self._outbox = outbox
        self._clock = clock or SystemClock()
        self._timeout = request_timeout_seconds
        self._backoff = report_backoff(backoff_cap_seconds)
        self._reader: TaskReader | None = reader if reader is not None else getattr(port, "reader", None)
        self._hurry = threading.Event()
        self._wait = wait or self._hurry.wait
        self._pool = SenderPool(senders, "reporter")
        self._closed = False
        # update-v2 is used while the port has it and the server has not refused it (405, or a 404
        # that v1 took): a plain bool, written by sender threads, read by the runner's main thread.
        self._v2_port = cast(ChainPort, port) if callable(getattr(port, "update_v2", None)) else None
        self._v2 = self._v2_port is not None
        timed = callable(getattr(port, "update_v2_timed", None))
        self._timed_port = cast(TimedChainPort, port) if timed else None

    @property
    def chaining(self) -> bool:
        """Final updates may claim the next task (update-v2): the port has the call, the server did
        not refuse it."""
        return self._v2

    def submit(self, result: TaskResult, *, retry_seconds: float, poll_count: int = 0,
               task_type: str = "", on_chained: OnChained | None = None, read_first: bool = False) -> None:
        """Deliver ``result`` in the background, retrying for up to ``retry_seconds``.

        ``poll_count`` (the task's newest pollCount delivered to us) is kept with the result if it
        goes to the outbox: the next start delivers it only if nobody polled the task since.
        ``task_type`` labels the attempts' metrics. ``on_chained``: send the first attempt as
        update-v2 (if ``chaining``) and call it once with what it claimed (see the module doc).
        ``read_first``: read the task back before the first attempt and send nothing unless the server
        still has it IN_PROGRESS with ``poll_count`` (``_read_first``).
        After ``close`` the delivery runs on the calling thread (a late hand-back at exit).
        """
        deadline = self._clock.monotonic() + retry_seconds
        chain = _Chain(on_chained)
        if self._closed:
            self._deliver_safely(result, deadline, poll_count, task_type, chain, read_first)
            return
        self._pool.submit(self._deliver_safely, result, deadline, poll_count, task_type, chain, read_first)

    def hurry(self) -> None:
        """Stop waiting between retries: one more attempt each, then to the outbox (a forced stop)."""
        self._hurry.set()

    def close(self) -> None:
        """Wait for the deliveries in progress (each is bounded by its deadline)."""
        self._pool.close()
        self._closed = True

    def _deliver_safely(self, result: TaskResult, deadline: float, poll_count: int = 0,
                        task_type: str = "", chain: _Chain | None = None, read_first: bool = False) -> None:
        chain = chain or _Chain(None)
        try:
            outcome = self._read_first(result, deadline, poll_count) if read_first else None
            if outcome is None:
                outcome = self._deliver(result, deadline, poll_count, task_type, chain)
        except Exception as exc:  # a thread's top level: never lose the outcome
            log.exception("reporting task %s failed unexpectedly", result.task_id)
            outcome = ReportOutcome(result.task_id, delivered=False, error=repr(exc))
        finally:
            chain.end(None, self._clock.monotonic())  # (a no-op once ended)
        self._on_done(outcome)

    def _update(self, result: TaskResult, timeout_seconds: float, task_type: str,
                chain: _Chain | None = None) -> Task | None:
        """One attempt, timed for the metrics (``task_update_time_seconds``): update-v2 while
        ``chain.pending`` (ending the chain with what it claimed), else v1."""
        v2 = chain is not None and chain.pending and self._v2
        if chain is not None and chain.pending and not v2:
            chain.end(None, self._clock.monotonic())  # switched off meanwhile
        started = self._clock.monotonic()
        try:
            if v2:
                assert chain is not None and self._v2_port is not None
                timeout = timeout_seconds
                if self._timed_port is not None:  # the lease counts from the send, after the guard's wait
                    claimed, sent_at = self._timed_port.update_v2_timed(result, timeout_seconds=timeout)
                else:
                    claimed, sent_at = self._v2_port.update_v2(result, timeout_seconds=timeout), started
                chain.end(claimed if isinstance(claimed, Task) else None, sent_at)
            else:
                self._port.update(result, timeout_seconds=timeout_seconds)
                claimed = None
        except Exception as exc:
            if v2 and chain is not None:
                chain.end(None, started)
            if self._observer.enabled:
                self._observer.on_update(task_type, self._clock.monotonic() - started, exc)
            raise
        if self._observer.enabled:
            self._observer.on_update(task_type, self._clock.monotonic() - started, None)
        return claimed

    def _deliver(
        self, result: TaskResult, deadline: float, poll_count: int = 0, task_type: str = "",
        chain: _Chain | None = None,
    ) -> ReportOutcome:
        """Attempts until one is taken; each failure's meaning is ``finalfailure.decide``'s."""
        attempt = 0
        unsure_v2 = False  # update-v2 answered 404: if v1 takes the result, the endpoint is missing
        has_body = bool(result.output_data or result.logs)
        while True:
            attempt += 1
            left = deadline - self._clock.monotonic()
            v2 = chain is not None and chain.pending and self._v2
            try:
                self._update(result, max(1.0, min(self._timeout, left)), task_type, chain)
                if unsure_v2:
                    self._v2_off("answered 404 to update-v2 but took the same result through v1")
                return ReportOutcome(result.task_id, delivered=True, via="v2" if v2 else "v1")
            except ConductorError as exc:
                failure = failure_of(exc)
                decision = decide(failure, Attempt(
                    result.status, number=attempt, left=deadline - self._clock.monotonic(), v2=v2,
                    status_code=exc.status_code, has_body=has_body, hurry=self._hurry.is_set(),
                    backoff=self._backoff))
                match decision:
                    case Delivered():  # a 2xx we could not parse: the server took it
                        log.warning("task %s: unexpected answer to the final update: %s", result.task_id, exc)
                        return ReportOutcome(result.task_id, delivered=True, via="v2" if v2 else "v1")
                    case FallBackToV1(endpoint_missing=missing):
                        # No such endpoint (or no such task): the same result through v1, at once.
                        if missing:
                            self._v2_off(f"answered {exc.status_code} to update-v2")
                        unsure_v2 = not missing
                        attempt -= 1
                    case SendBare(status=status):
                        log.warning("task %s: the server rejected the result (%s); not retrying",
                                    result.task_id, exc)
                        return self._bare_failure(result, exc, status, deadline, task_type)
                    case GiveUp():
                        log.warning("task %s: the server rejected the result (%s); not retrying",
                                    result.task_id, exc)
                        return ReportOutcome(result.task_id, delivered=False, error=str(exc))
                    case Save():
                        return self._give_up(result, exc, attempt, poll_count)
                    case Retry(after=delay):
                        self._note_retry(result, exc, attempt, deadline)
                        self._wait(delay)
                    case ReadBack(after=delay):
                        self._note_retry(result, exc, attempt, deadline)
                        landed = self._read_back(result, exc, delay, deadline, poll_count, attempt)
                        if landed is not None:
                            return landed

    def _note_retry(self, result: TaskResult, exc: ConductorError, attempt: int, deadline: float) -> None:
        if attempt == 1:
            log.warning("task %s: could not report %s yet: %s (retrying for %.0f s)", result.task_id,
                        result.status.value, exc, deadline - self._clock.monotonic())

    def _read_back(self, result: TaskResult, exc: ConductorError, wait: float, deadline: float,
                   poll_count: int, attempt: int) -> ReportOutcome | None:  # fmt: skip
        """An update whose answer was lost may still land (a yield's next run may be polled already):
        read the task back once it can no longer land (``wait``), and send it again (None) only if it
        never did (``finalfailure.after_read_back``). A read that fails is tried again with the
        backoff, up to the deadline; then the result goes to the outbox, which reads back too."""
        if self._reader is None:  # nothing to read with: retried as any other failure
            self._wait(wait)
            return None
        reads = 0
        while True:
            self._wait(wait)
            if self._hurry.is_set():  # a forced stop: to the outbox, which reads back before it sends
                return self._give_up(result, exc, attempt, poll_count)
            reads += 1
            try:
                timeout = max(1.0, min(self._timeout, deadline - self._clock.monotonic()))
                ownership = self._reader.get_task_ownership(result.task_id, timeout_seconds=timeout)
            except ConductorError as err:
                wait = self._backoff.delay(reads)
                if self._hurry.is_set() or deadline - self._clock.monotonic() <= wait:
                    return self._give_up(result, err, attempt, poll_count)
                continue
            break
        match after_read_back(ownership, poll_count, result.status):
            case Delivered():
                how = "gone" if ownership is None else (
                    f"{ownership.status.value}, pollCount {ownership.poll_count}")
                log.info("task %s: read back after its %s went unanswered: it had landed (%s); not "
                         "sending it again", result.task_id, result.status.value, how)
                return ReportOutcome(result.task_id, delivered=True, via="v1")
            case GiveUp(reason=why):
                log.warning("task %s: read back after its %s went unanswered: %s; not sending it again",
                            result.task_id, result.status.value, why)
                return ReportOutcome(result.task_id, delivered=False, error=f"{exc} ({why})")
            case _:
                return None  # it never landed: send it again

    def _read_first(self, result: TaskResult, deadline: float, poll_count: int) -> ReportOutcome | None:
        """A result of a lease that ran out: None (send it) only if the task read back is still ours;
        else the outcome without sending (dropped, or saved when no read got an answer in time: the
        outbox reads back before it sends). The update can still land on a re-delivery made in the
        read's round trip (between the server's answer and the update's arrival). With no reader
        (small test ports) it is sent as before."""
        if self._reader is None:
            return None
        reads = 0
        while True:
            reads += 1
            try:
                timeout = max(1.0, min(self._timeout, deadline - self._clock.monotonic()))
                ownership = self._reader.get_task_ownership(result.task_id, timeout_seconds=timeout)
            except ConductorError as err:
                wait = self._backoff.delay(reads)
                if self._hurry.is_set() or deadline - self._clock.monotonic() <= wait:
                    return self._give_up(result, err, 0, poll_count)
                self._wait(wait)
                continue
            break
        match lost_lease_read(ownership, poll_count):
            case GiveUp(reason=why):
                log.warning("task %s: its lease ran out and the task is no longer ours (%s): not reporting "
                            "%s", result.task_id, why, result.status.value)
                return ReportOutcome(result.task_id, delivered=False, error=f"not reported: {why}")
            case _:
                return None

    def _v2_off(self, why: str) -> None:
        if self._v2:
            self._v2 = False
            log.warning("the server %s: final updates use v1 POST /api/tasks from now on (each next "
                        "task is polled)", why)

    def _bare_failure(self, result: TaskResult, exc: ConductorError, status: TaskStatus, deadline: float,
                      task_type: str = "") -> ReportOutcome:  # fmt: skip
        """The server refused the result itself (400, 413, a 500 marked not retryable: too big, too
        deep, a value it cannot take), not the task: report the task ``status`` (FAILED) without its
        output and logs, once, so that the server retries it now rather than after its response
        timeout (``finalfailure.SendBare``); if that is refused too, nothing more is sent."""
        bare = bare_result(result, status, _short(exc))
        try:
            left = deadline - self._clock.monotonic()
            self._update(bare, max(1.0, min(self._timeout, left)), task_type)
        except ConductorError as again:
            log.warning("task %s: the server refused a bare FAILED too (%s)", result.task_id, again)
            return ReportOutcome(result.task_id, delivered=False, error=str(exc))
        log.warning("task %s: reported %s without its output instead", result.task_id, status.value)
        return ReportOutcome(result.task_id, delivered=True, error=str(exc), sent_status=status, via="v1")

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



def _short(exc: Exception, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[: limit - 3] + "..."
