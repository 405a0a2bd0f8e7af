"""What a failed final update means, and what follows it: one table. Pure: no I/O, no clock, no threads.

A final update (a run's result, a yield, a hand-back) can fail in a few ways, and the reporter, the
outbox and update-v2 chaining all act on the answer. The rules live here once:

* ``failure_of(exc)`` / ``failure_of_status(code)``: what kind of failure an attempt had
  (``Failure``), from the client's exception or from an HTTP status (None: no answer at all).
* ``decide(failure, attempt)``: what follows (``Decision``): try again after a delay, read the task
  back first (a yield whose fate is unknown), send a bare FAILED instead, keep the result in the
  outbox, give up, count it delivered, or send it again through v1 (update-v2 refused).
* ``after_read_back(ownership, poll_count)``: what a yield's read-back says (landed, never landed,
  over).
* ``lost_lease_read(ownership, poll_count)``: what the read before a result of a lease that ran out
  says (send it, or drop it: the task may be another runner's delivery now; see
  ``runner.loop.decisions.report_check``).
* ``report_budget(...)``: how long a result may be retried before it goes to the outbox.

The table, by failure kind (``Attempt.saved``: a result the outbox delivers; ``v2``: the attempt
went out as update-v2):

==================  ==========================================================================
kind                decision
==================  ==========================================================================
GARBLED (2xx)       ``Delivered``: the server took it; its answer was unreadable
V2 405              ``FallBackToV1(endpoint_missing=True)``: the same result through v1 at once
V2 404              ``FallBackToV1(endpoint_missing=False)``: v1 tells whether the task is gone
NO_ANSWER           ``ReadBack`` once it can no longer land, if time is left; else ``Save``.
                    Saved: ``Save`` (kept; the next round reads back before it sends)
UNAVAILABLE, AUTH   ``Retry(backoff)`` while time is left; ``Save`` when not (and when saved).
                    A 429 (rate limited: not applied) is UNAVAILABLE
GONE (404)          ``GiveUp``: the task or its workflow is gone
BODY_REFUSED        a terminal result with a body: ``SendBare`` (FAILED without its output, once;
                    the outbox too); otherwise ``GiveUp``
REFUSED (409, 4xx)  ``GiveUp``: the server said no to the task, not to the network
==================  ==========================================================================

Why an update with no answer is read back before anything else is sent: it may still land.
A yield that landed re-queued the task; sent again after another worker polled the next run, it
would re-queue (undo) that run. A terminal result that lands late can be undone by a heartbeat that
loaded the task before it (the lost update of CONDUCTOR_PROTOCOL.md §3), so the task's heartbeats
stay held meanwhile (``leasecore.runner.leasing.finalupdates``). It is read back once it can no
longer land (``LATE_BEAT_MARGIN_SECONDS`` after the give-up: the bound ``leasecore.lease.finalcheck``
applies to heartbeats, the connection being reset the same way) and sent again only if the server
shows it never landed (``after_read_back``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from leasecore.backoff import Backoff
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
)
from leasecore.lease.finalcheck import LATE_BEAT_MARGIN_SECONDS, unknown_fate
from leasecore.lease.ownership import ownership_lost_reason
from leasecore.models import TaskOwnership, TaskResult, TaskStatus

__all__ = [
    "REPORT_BACKOFF",
    "Attempt",
    "Decision",
    "Delivered",
    "Failure",
    "FallBackToV1",
    "GiveUp",
    "ReadBack",
    "Retry",
    "Save",
    "SendBare",
    "after_read_back",
    "bare_result",
    "decide",
    "failure_of",
    "failure_of_status",
    "lost_lease_read",
    "report_backoff",
    "report_budget",
    "saved_result_lost_reason",
]

# The reporter's waits between attempts of one final update: 0.5 s, 1, 2, 4, then the cap (5 s by
# default, ``report_backoff``). No jitter: the heartbeats keep the lease meanwhile, and a fleet's
# results are spread by their tasks' own ends.
REPORT_BACKOFF = Backoff(initial_seconds=0.5, multiplier=2.0, max_seconds=5.0)


def report_backoff(cap_seconds: float) -> Backoff:
    """``REPORT_BACKOFF`` with another cap (a cap below its first delay makes every delay the cap)."""
    initial = min(REPORT_BACKOFF.initial_seconds, cap_seconds)
    return Backoff(initial_seconds=initial, multiplier=REPORT_BACKOFF.multiplier, max_seconds=cap_seconds)


class Failure(Enum):
    """What kind of failure one attempt of a final update had."""

    NO_ANSWER = "no answer"  # timeout, reset, a gateway's 502/503/504: it may still land
    UNAVAILABLE = "unavailable"  # a 5xx the server gave itself, or a 429: not applied, try again
    AUTH = "auth"  # 401/403: our credentials, not the result
    GONE = "gone"  # 404: the task or its workflow
    BODY_REFUSED = "body refused"  # 400, 413, 422, a 5xx marked not retryable: this body
    REFUSED = "refused"  # another 4xx (409...): the task, not the body
    GARBLED = "garbled"  # a 2xx answer we could not read: it was taken


_BODY_REFUSED = frozenset({400, 413, 422})
# 408 Request Timeout (the request never arrived whole) and 429 Too Many Requests (a server's or a
# gateway's limit): about the pace or the wire, not the result, which was not applied.
_TRY_LATER = frozenset({408, 429})
_FINAL = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.FAILED_WITH_TERMINAL_ERROR})


def failure_of_status(status_code: int | None) -> Failure:
    """The kind of a failure from its HTTP status alone (None: no answer came)."""
    if unknown_fate(status_code):
        return Failure.NO_ANSWER
    assert status_code is not None
    if status_code in (401, 403):
        return Failure.AUTH
    if status_code == 404:
        return Failure.GONE
    if status_code in _BODY_REFUSED:
        return Failure.BODY_REFUSED
    if 200 <= status_code < 300:
        return Failure.GARBLED
    if status_code >= 500 or status_code in _TRY_LATER:
        return Failure.UNAVAILABLE
    return Failure.REFUSED


def failure_of(exc: ConductorError) -> Failure:
    """The kind of a failure from the client's exception (its class says what its status cannot:
    a 5xx marked not retryable refuses the body; an auth error may come with no status)."""
    if isinstance(exc, ConductorProtocolError):
        return Failure.GARBLED
    if isinstance(exc, ConductorAuthError):
        return Failure.AUTH
    if isinstance(exc, ConductorNotFound):
        return Failure.GONE
    if isinstance(exc, ConductorRejected):
        code = exc.status_code or 0
        if code in _TRY_LATER:
            return Failure.UNAVAILABLE
        return Failure.BODY_REFUSED if code in _BODY_REFUSED or code >= 500 else Failure.REFUSED
    return Failure.NO_ANSWER if unknown_fate(exc.status_code) else Failure.UNAVAILABLE


@dataclass(frozen=True, eq=False)
class Attempt:
    """One failed attempt of a final update, as the decision needs it."""

    status: TaskStatus  # the result's status
    number: int = 1  # 1 for the first attempt (update-v2 fallbacks do not count)
    left: float = 0.0  # seconds left of the result's retry budget
    v2: bool = False  # the attempt went out as update-v2
    status_code: int | None = None  # the HTTP status (update-v2's 404/405 read apart)
    has_body: bool = True  # the result carries output or logs (a bare FAILED would drop something)
    saved: bool = False  # a result the outbox delivers
    hurry: bool = False  # a forced stop: no more waiting
    backoff: Backoff = REPORT_BACKOFF


@dataclass(frozen=True)
class Retry:
    after: float  # seconds


@dataclass(frozen=True)
class ReadBack:
    after: float  # seconds: when it can no longer land


@dataclass(frozen=True)
class SendBare:
    status: TaskStatus  # FAILED, or FAILED_WITH_TERMINAL_ERROR for a "no retry" result


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class Save:
    """Keep the result in the outbox (save it, or leave it there) for a later delivery."""


@dataclass(frozen=True)
class Delivered:
    """The server took it (a 2xx we could not read; a yield that landed)."""


@dataclass(frozen=True)
class FallBackToV1:
    endpoint_missing: bool  # True: update-v2 is off for good; False: only if v1 takes the result


Decision = Retry | ReadBack | SendBare | GiveUp | Save | Delivered | FallBackToV1


def decide(failure: Failure, attempt: Attempt) -> Decision:
    """What follows a failed attempt (the table in the module docstring)."""
    if failure is Failure.GARBLED:
        return Delivered()
    if attempt.v2 and attempt.status_code in (404, 405):
        return FallBackToV1(endpoint_missing=attempt.status_code == 405)
    if failure is Failure.GONE:
        return GiveUp("the task or its workflow is gone (404)")
    if failure is Failure.BODY_REFUSED:
        if attempt.status in _FINAL and (attempt.has_body or attempt.status is TaskStatus.COMPLETED):
            return SendBare(TaskStatus.FAILED_WITH_TERMINAL_ERROR
                            if attempt.status is TaskStatus.FAILED_WITH_TERMINAL_ERROR else TaskStatus.FAILED)
        return GiveUp("the server refused the result")
    if failure is Failure.REFUSED:
        return GiveUp("the server refused the result")
    # NO_ANSWER, UNAVAILABLE, AUTH: the network, the server's state or our credentials, never the result.
    if attempt.saved or attempt.hurry:
        return Save()
    if failure is Failure.NO_ANSWER:
        if attempt.left > LATE_BEAT_MARGIN_SECONDS:
            return ReadBack(LATE_BEAT_MARGIN_SECONDS)
        return Save()  # the outbox reads it back before it sends it again
    delay = attempt.backoff.delay(max(1, attempt.number))
    return Retry(delay) if attempt.left > delay else Save()


def after_read_back(ownership: TaskOwnership | None, poll_count: int, status: TaskStatus) -> Decision:
    """What the read-back of a final update of unknown fate says, once it can no longer land
    (``status``: the result's). ``Retry(0)``: send it again now; ``Delivered``: it landed;
    ``GiveUp``: the task is no longer ours to report (ended otherwise, gone, polled again).

    A yield (IN_PROGRESS) landed when the server re-queued the task (SCHEDULED) or polled its next run
    (a higher pollCount): sending it again would undo that run. A terminal result landed when the
    server shows that status. Either is sent again while the task is IN_PROGRESS under the poll we held
    (it never landed, or a late heartbeat undid it), and a terminal one also while it is SCHEDULED under
    that poll (its park landed, the result did not). An unknown ``poll_count`` (0) tells no next run."""
    if ownership is None:
        return GiveUp("the task or its workflow is gone (404)")
    repolled = poll_count > 0 and ownership.poll_count > poll_count
    if status is TaskStatus.IN_PROGRESS:
        if ownership.status.is_terminal:
            return GiveUp(f"the task is {ownership.status.value} on the server")
        if ownership.status is TaskStatus.SCHEDULED or repolled:
            return Delivered()
        return Retry(0.0)
    if ownership.status is status:
        return Delivered()
    if ownership.status.is_terminal:
        return GiveUp(f"the task is {ownership.status.value} on the server")
    if repolled:
        return GiveUp(f"the task was polled again (pollCount {ownership.poll_count}, ours {poll_count})")
    return Retry(0.0)


def lost_lease_read(ownership: TaskOwnership | None, poll_count: int) -> Retry | GiveUp:
    """The read before a result of a lease that ran out: ``Retry(0)``, send it now (the server still
    has the task IN_PROGRESS with our pollCount, or the pollCount is unknown: 0); ``GiveUp``, send
    nothing: the task was polled again (our update would land on the other runner's delivery: it
    carries no pollCount), re-queued, ended, or is gone. The outbox's rule for saved results."""
    why = ownership_lost_reason(ownership, poll_count)
    return Retry(0.0) if why is None else GiveUp(why)
def saved_result_lost_reason(ownership: TaskOwnership | None, poll_count: int,
                             result: TaskResult) -> str | None:
    """Why a result kept in the outbox is no longer ours to send (None: send it), as read back before
    its delivery: ``ownership_lost_reason``, except that a terminal result may find its own park
    (``SCHEDULED`` under the pollCount it was saved with, by this worker): the park landed, the
    result did not, and dropping it would run the task again after the park's callback."""
    if (result.status in _FINAL and ownership is not None and ownership.status is TaskStatus.SCHEDULED
            and poll_count > 0 and ownership.poll_count == poll_count
            and result.worker_id is not None and ownership.worker_id == result.worker_id):
        return None
    return ownership_lost_reason(ownership, poll_count)


def bare_result(result: TaskResult, status: TaskStatus, why: str) -> TaskResult:
    """``result`` as a ``status`` without its output and logs (``SendBare``): the server retries the
    task now rather than after its response timeout."""
    return TaskResult(result.task_id, result.workflow_id, status, worker_id=result.worker_id,
                      reason_for_incompletion=f"the server refused the task's result ({why}); "
                      "reported without its output")  # fmt: skip


def report_budget(*, forced: bool, lease_expired: bool, stopping: bool, retry_seconds: float,
                  shutdown_retry_seconds: float) -> float:  # fmt: skip
    """How long a result is retried before it goes to the outbox: none on a forced stop, 5 s after a
    lost lease (best effort: the server most likely moved on), the shorter of the two while stopping."""
    if forced:
        return 0.0
    if lease_expired:
        return 5.0
    if stopping:
        return min(retry_seconds, shutdown_retry_seconds)
    return retry_seconds
