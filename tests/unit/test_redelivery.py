"""What becomes of a saved result at redelivery, as a table: pure values, no file, no server."""

from __future__ import annotations

import pytest

from leasecore.lease.finalfailure import (
    Attempt,
    Decision,
    Delivered,
    Failure,
    FallBackToV1,
    GiveUp,
    ReadBack,
    Retry,
    Save,
    SendBare,
    decide,
)
from leasecore.models import TaskStatus
from leasecore.state.redelivery import Done, Drop, KeepRest, Send, after_failure, before_send

DAY = 24 * 3600.0


@pytest.mark.parametrize(
    ("age", "not_ours", "fate"),
    [
        (10.0, None, Send()),
        (DAY, None, Send()),  # at the limit: still sent
        (DAY + 1, None, Drop(f"older than {DAY:.0f} s")),
        (10.0, "it is COMPLETED on the server", Drop("no longer ours: it is COMPLETED on the server")),
        (DAY + 1, "re-queued", Drop(f"older than {DAY:.0f} s")),  # age first: its read is not needed
    ],
)
def test_before_send(age: float, not_ours: str | None, fate: Send | Drop) -> None:
    assert before_send(age_seconds=age, max_age_seconds=DAY, not_ours=not_ours) == fate


@pytest.mark.parametrize(
    ("decision", "sent", "fate"),
    [
        (Save(), True, KeepRest()),
        (Save(), False, KeepRest()),
        (Delivered(), True, Done()),
        # The read-back before the send failed: nothing went out, so an unreadable answer is no delivery.
        (Delivered(), False, KeepRest()),
        (SendBare(TaskStatus.FAILED), True, Drop("the server rejected it", bare=TaskStatus.FAILED)),
        # ... and a refused read never sends a bare status: there was no body to refuse.
        (SendBare(TaskStatus.FAILED), False, Drop("the server rejected it")),
        (GiveUp("refused"), True, Drop("the server rejected it")),
        (GiveUp("refused"), False, Drop("the server rejected it")),
        # Decisions the table never gives a saved result still drop it rather than retry for ever.
        (Retry(1.0), True, Drop("the server rejected it")),
        (ReadBack(1.0), True, Drop("the server rejected it")),
        (FallBackToV1(endpoint_missing=True), True, Drop("the server rejected it")),
    ],
)
def test_after_failure(decision: Decision, sent: bool, fate: KeepRest | Done | Drop) -> None:
    assert after_failure(decision, sent=sent) == fate


KEEP, DROP, DONE = KeepRest(), Drop("the server rejected it"), Done()
BARE = Drop("the server rejected it", bare=TaskStatus.FAILED)


@pytest.mark.parametrize(
    ("failure", "status", "sent", "fate"),
    [
        # Unreachable or our credentials: kept, sent or not.
        (Failure.NO_ANSWER, TaskStatus.COMPLETED, True, KEEP),
        (Failure.UNAVAILABLE, TaskStatus.COMPLETED, True, KEEP),
        (Failure.AUTH, TaskStatus.COMPLETED, True, KEEP),
        (Failure.NO_ANSWER, TaskStatus.COMPLETED, False, KEEP),
        (Failure.AUTH, TaskStatus.IN_PROGRESS, False, KEEP),
        # The task is gone, or the server refuses it: dropped.
        (Failure.GONE, TaskStatus.COMPLETED, True, DROP),
        (Failure.REFUSED, TaskStatus.COMPLETED, True, DROP),
        (Failure.BODY_REFUSED, TaskStatus.IN_PROGRESS, True, DROP),  # a yield: no bare FAILED
        (Failure.GONE, TaskStatus.COMPLETED, False, DROP),
        # A terminal result whose body was refused: FAILED bare first, as the reporter does ...
        (Failure.BODY_REFUSED, TaskStatus.COMPLETED, True, BARE),
        # ... but not when what was refused is the read before it.
        (Failure.BODY_REFUSED, TaskStatus.COMPLETED, False, DROP),
        # A 2xx we could not read: delivered when it was the send, kept when it was the read.
        (Failure.GARBLED, TaskStatus.COMPLETED, True, DONE),
        (Failure.GARBLED, TaskStatus.COMPLETED, False, KEEP),
    ],
)
def test_a_failed_delivery_through_the_final_update_table(
    failure: Failure, status: TaskStatus, sent: bool, fate: KeepRest | Drop | Done
) -> None:
    assert after_failure(decide(failure, Attempt(status, saved=True)), sent=sent) == fate
