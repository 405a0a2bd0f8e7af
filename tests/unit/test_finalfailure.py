"""The one table of what a failed final update means (leasecore.lease.finalfailure), row by row:
the reporter, the outbox and update-v2 chaining all act on these decisions."""

from __future__ import annotations

import pytest

from leasecore.backoff import Backoff
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
)
from leasecore.lease.finalcheck import LATE_BEAT_MARGIN_SECONDS
from leasecore.lease.finalfailure import (
    REPORT_BACKOFF,
    Attempt,
    Delivered,
    Failure,
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
    failure_of_status,
    lost_lease_read,
    report_backoff,
    report_budget,
    saved_result_lost_reason,
    transport_may_resend,
)
from leasecore.models import TaskOwnership, TaskResult, TaskStatus

C, F, FT, IP = (TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.FAILED_WITH_TERMINAL_ERROR,
                TaskStatus.IN_PROGRESS)


@pytest.mark.parametrize(("exc", "kind"), [
    (ConductorUnavailable("timed out"), Failure.NO_ANSWER),
    (ConductorUnavailable("reset", status_code=None), Failure.NO_ANSWER),
    (ConductorUnavailable("gateway", status_code=502), Failure.NO_ANSWER),
    (ConductorUnavailable("gateway", status_code=504), Failure.NO_ANSWER),
    (ConductorUnavailable("server error", status_code=500), Failure.UNAVAILABLE),
    (ConductorAuthError("refused", status_code=401), Failure.AUTH),
    (ConductorAuthError("no credentials"), Failure.AUTH),
    (ConductorNotFound("gone", status_code=404), Failure.GONE),
    (ConductorRejected("bad", status_code=400), Failure.BODY_REFUSED),
    (ConductorRejected("too big", status_code=413), Failure.BODY_REFUSED),
    (ConductorRejected("not retryable", status_code=500), Failure.BODY_REFUSED),
    (ConductorRejected("conflict", status_code=409), Failure.REFUSED),
    (ConductorRejected("no such endpoint", status_code=405), Failure.REFUSED),
    (ConductorProtocolError("garbled", status_code=200), Failure.GARBLED),
])  # fmt: skip
def test_each_exception_has_one_kind(exc: ConductorError, kind: Failure) -> None:
    assert failure_of(exc) is kind


@pytest.mark.parametrize(("code", "kind"), [
    (None, Failure.NO_ANSWER), (503, Failure.NO_ANSWER), (500, Failure.UNAVAILABLE), (401, Failure.AUTH),
    (403, Failure.AUTH), (404, Failure.GONE), (422, Failure.BODY_REFUSED), (409, Failure.REFUSED),
    (200, Failure.GARBLED),
])  # fmt: skip
def test_a_status_alone_has_the_same_kinds(code: int | None, kind: Failure) -> None:
    assert failure_of_status(code) is kind


GONE = GiveUp("the task or its workflow is gone (404)")
NO = GiveUp("the server refused the result")
# The table: (kind, attempt) -> decision. Time left 60 s unless the row says otherwise.
TABLE = [
    ("garbled 2xx: taken", Failure.GARBLED, Attempt(C, left=60), Delivered()),
    ("update-v2 405: v1, v2 off", Failure.REFUSED, Attempt(C, left=60, v2=True, status_code=405),
     FallBackToV1(endpoint_missing=True)),
    ("update-v2 404: v1 tells", Failure.GONE, Attempt(C, left=60, v2=True, status_code=404),
     FallBackToV1(endpoint_missing=False)),
    ("v1 404: gone", Failure.GONE, Attempt(C, left=60, status_code=404), GONE),
    ("409: refused", Failure.REFUSED, Attempt(C, left=60, status_code=409), NO),
    ("update-v2 409: as v1's", Failure.REFUSED, Attempt(C, left=60, v2=True, status_code=409),
     NO),
    ("body refused, COMPLETED: bare FAILED", Failure.BODY_REFUSED, Attempt(C, left=60, has_body=False),
     SendBare(F)),
    ("body refused, FAILED with output", Failure.BODY_REFUSED, Attempt(F, left=60), SendBare(F)),
    ("body refused, no-retry stays no-retry", Failure.BODY_REFUSED, Attempt(FT, left=60), SendBare(FT)),
    ("body refused, a bare FAILED already", Failure.BODY_REFUSED, Attempt(F, left=60, has_body=False),
     NO),
    ("body refused, a yield: no FAILED", Failure.BODY_REFUSED, Attempt(IP, left=60),
     NO),
    ("body refused, saved: bare too", Failure.BODY_REFUSED, Attempt(C, saved=True), SendBare(F)),
    ("5xx, first attempt", Failure.UNAVAILABLE, Attempt(C, number=1, left=60), Retry(0.5)),
    ("5xx, third attempt", Failure.UNAVAILABLE, Attempt(C, number=3, left=60), Retry(2.0)),
    ("5xx, capped", Failure.UNAVAILABLE, Attempt(C, number=9, left=60), Retry(5.0)),
    ("auth: retried like 5xx", Failure.AUTH, Attempt(C, number=2, left=60), Retry(1.0)),
    ("no answer, terminal: read back", Failure.NO_ANSWER, Attempt(F, number=1, left=60),
     ReadBack(LATE_BEAT_MARGIN_SECONDS)),
    ("no time left: outbox", Failure.UNAVAILABLE, Attempt(C, number=3, left=2.0), Save()),
    ("hurry: outbox", Failure.UNAVAILABLE, Attempt(C, left=60, hurry=True), Save()),
    ("auth, saved: kept", Failure.AUTH, Attempt(C, saved=True), Save()),
    ("unreachable, saved: kept", Failure.NO_ANSWER, Attempt(IP, saved=True), Save()),
    ("a yield of unknown fate: read back", Failure.NO_ANSWER, Attempt(IP, left=60),
     ReadBack(LATE_BEAT_MARGIN_SECONDS)),
    ("a yield of unknown fate, no time: outbox", Failure.NO_ANSWER,
     Attempt(IP, left=LATE_BEAT_MARGIN_SECONDS), Save()),
    ("a yield refused by a 5xx: retried", Failure.UNAVAILABLE, Attempt(IP, left=60), Retry(0.5)),
]  # fmt: skip


@pytest.mark.parametrize(("kind", "attempt", "decision"), [row[1:] for row in TABLE],
                         ids=[row[0] for row in TABLE])  # fmt: skip
def test_the_table(kind: Failure, attempt: Attempt, decision: object) -> None:
    assert decide(kind, attempt) == decision


def test_every_kind_has_a_row() -> None:
    assert {row[1] for row in TABLE} == set(Failure)


def test_the_backoff_is_injected() -> None:
    slow = Backoff(initial_seconds=3.0, multiplier=3.0, max_seconds=30.0)
    assert decide(Failure.UNAVAILABLE, Attempt(C, number=2, left=60, backoff=slow)) == Retry(9.0)
    assert decide(Failure.UNAVAILABLE, Attempt(C, number=2, left=9.0, backoff=slow)) == Save()


def test_the_report_backoff_doubles_from_half_a_second_to_its_cap() -> None:
    assert [REPORT_BACKOFF.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert [report_backoff(0.2).delay(n) for n in (1, 2)] == [0.2, 0.2]
    assert report_backoff(60).delay(8) == 60.0


@pytest.mark.parametrize(("ownership", "decision"), [
    (TaskOwnership(IP, 3, "w1"), Retry(0.0)),  # never landed: sent again
    (TaskOwnership(TaskStatus.SCHEDULED, 3), Delivered()),  # landed: re-queued
    (TaskOwnership(IP, 4, "w2"), Delivered()),  # landed, and its next run was polled: do not undo it
    (TaskOwnership(TaskStatus.SCHEDULED, 4), Delivered()),
    (TaskOwnership(TaskStatus.COMPLETED, 4), GiveUp("the task is COMPLETED on the server")),
    (TaskOwnership(TaskStatus.CANCELED, 3), GiveUp("the task is CANCELED on the server")),
    (None, GiveUp("the task or its workflow is gone (404)")),
])  # fmt: skip
def test_a_yields_read_back(ownership: TaskOwnership | None, decision: object) -> None:
    assert after_read_back(ownership, 3, IP) == decision


@pytest.mark.parametrize(("ownership", "decision"), [
    (TaskOwnership(IP, 3, "w1"), Retry(0.0)),  # never landed (or a late beat undid it): sent again
    (TaskOwnership(TaskStatus.SCHEDULED, 3), Retry(0.0)),  # its park landed, the result did not
    (TaskOwnership(C, 3), Delivered()),  # landed
    (TaskOwnership(TaskStatus.TIMED_OUT, 3), GiveUp("the task is TIMED_OUT on the server")),
    (TaskOwnership(IP, 4, "w2"), GiveUp("the task was polled again (pollCount 4, ours 3)")),
    (None, GONE),
])  # fmt: skip
def test_a_terminal_results_read_back(ownership: TaskOwnership | None, decision: object) -> None:
    assert after_read_back(ownership, 3, C) == decision


@pytest.mark.parametrize(("ownership", "decision"), [
    (TaskOwnership(IP, 3, "w1"), Retry(0.0)),  # still ours: report it (the server retries at once)
    (TaskOwnership(IP, 4, "w2"), GiveUp("the task was polled again by worker 'w2' (pollCount 4, ours 3)")),
    (TaskOwnership(TaskStatus.SCHEDULED, 3),
     GiveUp("the task was re-queued (SCHEDULED) and will be handed out again")),
    (TaskOwnership(TaskStatus.TIMED_OUT, 3), GiveUp("the task is TIMED_OUT on the server")),
    (None, GiveUp("the server no longer knows the task (404)")),
])  # fmt: skip
def test_the_read_before_a_lost_leases_result(ownership: TaskOwnership | None, decision: object) -> None:
    assert lost_lease_read(ownership, 3) == decision


def test_a_lost_leases_result_with_an_unknown_poll_count_is_sent_while_in_progress() -> None:
    assert lost_lease_read(TaskOwnership(IP, 9), 0) == Retry(0.0)


def test_an_unknown_poll_count_cannot_tell_a_next_run() -> None:
    assert after_read_back(TaskOwnership(IP, 9), 0, IP) == Retry(0.0)
    assert after_read_back(TaskOwnership(IP, 9), 0, C) == Retry(0.0)


SCHED = TaskStatus.SCHEDULED


@pytest.mark.parametrize(("status", "ownership", "kept"), [
    (C, TaskOwnership(SCHED, 3, "w1"), True),  # its own park: the park landed, the result did not
    (F, TaskOwnership(SCHED, 3, "w1"), True),
    (C, TaskOwnership(SCHED, 3, "w2"), False),  # parked by another worker: not ours
    (C, TaskOwnership(SCHED, 3, None), False),  # no worker on record: not certainly ours
    (C, TaskOwnership(SCHED, 4, "w1"), False),  # re-queued under a later delivery
    (IP, TaskOwnership(SCHED, 3, "w1"), False),  # a saved yield that landed: sent again it re-queues
    (C, TaskOwnership(IP, 3, "w1"), True),  # still ours, as before
    (C, TaskOwnership(IP, 4, "w2"), False),  # polled again since
    (C, TaskOwnership(C, 3, "w1"), False),
    (C, None, False),
])  # fmt: skip
def test_a_saved_result_finds_its_own_park_still_ours(
    status: TaskStatus, ownership: TaskOwnership | None, kept: bool
) -> None:
    result = TaskResult("t", "wf", status, worker_id="w1")
    assert (saved_result_lost_reason(ownership, 3, result) is None) is kept
    assert saved_result_lost_reason(TaskOwnership(SCHED, 3, "w1"), 0, result) is not None  # unknown poll


def test_a_bare_result_drops_output_and_says_why() -> None:
    full = TaskResult("t", "wf", C, output_data={"big": "x"}, worker_id="w")
    bare = bare_result(full, F, "413 too large")
    assert (bare.status, bare.output_data, bare.worker_id) == (F, {}, "w")
    assert bare.reason_for_incompletion is not None and "413 too large" in bare.reason_for_incompletion


@pytest.mark.parametrize(("forced", "expired", "stopping", "seconds"), [
    (False, False, False, 300.0), (False, False, True, 30.0), (False, True, False, 5.0),
    (False, True, True, 5.0), (True, True, True, 0.0), (True, False, False, 0.0),
])  # fmt: skip
def test_report_budget(forced: bool, expired: bool, stopping: bool, seconds: float) -> None:
    assert report_budget(forced=forced, lease_expired=expired, stopping=stopping, retry_seconds=300.0,
                         shutdown_retry_seconds=30.0) == seconds


def test_a_final_update_rate_limited_by_a_429_is_retried_not_dropped() -> None:
    # 429 Too Many Requests (a gateway's or a server's rate limit) says nothing about the task or the
    # result: it was not applied. Read as a refusal, the result was dropped and the task waited for its
    # response timeout, to be retried with its output lost.
    limited = ConductorRejected("POST /tasks -> HTTP 429 rejected", status_code=429)
    assert failure_of(limited) is Failure.UNAVAILABLE
    assert failure_of_status(429) is Failure.UNAVAILABLE
    assert decide(failure_of(limited), Attempt(C, number=1, left=60.0)) == Retry(REPORT_BACKOFF.delay(1))
    assert decide(failure_of(limited), Attempt(C, left=60.0, saved=True)) == Save()  # the outbox keeps it


@pytest.mark.parametrize("code", [408, 429])
def test_a_request_timeout_or_rate_limit_is_retried_like_an_unavailable_server(code: int) -> None:
    # 408: the server gave up waiting for the request itself, so nothing was applied; like a 429 it
    # says to try again, not that the result is refused.
    refused = ConductorRejected(f"POST /tasks -> HTTP {code} rejected", status_code=code)
    assert failure_of(refused) is failure_of_status(code) is Failure.UNAVAILABLE
    assert failure_of_status(409) is Failure.REFUSED  # (another 4xx still refuses)


@pytest.mark.parametrize("status", list(TaskStatus))
def test_the_transport_may_resend_a_terminal_update_only(status: TaskStatus) -> None:
    # a second terminal update is ignored by the server; a second IN_PROGRESS one (a yield, a park)
    # re-queues the task again, which after its next run was polled re-queues that run
    assert transport_may_resend(status) is (status not in (TaskStatus.SCHEDULED, TaskStatus.IN_PROGRESS))
