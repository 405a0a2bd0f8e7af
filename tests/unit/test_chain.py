"""The pure decisions of update-v2 chaining (leasecore.runner.chain): when a final update may claim
the next task, how a refusal of update-v2 is read, and what hands a claimed task back."""

from __future__ import annotations

import pytest

from leasecore.handover import YIELD_MARKER, follows_our_yield
from leasecore.lease import FenceReason
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.chain import Refusal, hand_back, may_chain, refusal


def result(status: TaskStatus) -> TaskResult:
    return TaskResult("t1", "wf1", status, worker_id="w1")


@pytest.mark.parametrize("status", [TaskStatus.COMPLETED, TaskStatus.FAILED,
                                    TaskStatus.FAILED_WITH_TERMINAL_ERROR])
@pytest.mark.parametrize("fence", [None, FenceReason.EXEC_TIMEOUT, FenceReason.HARD_TIMEOUT])
def test_a_terminal_result_of_a_sound_lease_may_claim_the_next_task(
    status: TaskStatus, fence: FenceReason | None
) -> None:
    assert may_chain(result(status), stopping=False, fence=fence, enabled=True)


@pytest.mark.parametrize("status", [TaskStatus.IN_PROGRESS])
def test_a_yield_never_claims(status: TaskStatus) -> None:
    # The server claims only after a terminal update; a yield's update-v2 would answer 204 anyway.
    assert not may_chain(result(status), stopping=False, fence=None, enabled=True)


@pytest.mark.parametrize("fence", [FenceReason.LEASE_EXPIRED, FenceReason.SHUTDOWN,
                                   FenceReason.OWNERSHIP_LOST])
def test_after_a_lost_lease_or_a_stop_nothing_is_claimed(fence: FenceReason) -> None:
    assert not may_chain(result(TaskStatus.FAILED), stopping=False, fence=fence, enabled=True)


def test_stopping_or_switched_off_never_claims() -> None:
    assert not may_chain(result(TaskStatus.COMPLETED), stopping=True, fence=None, enabled=True)
    assert not may_chain(result(TaskStatus.COMPLETED), stopping=False, fence=None, enabled=False)


def test_405_means_no_endpoint_404_is_unsure_anything_else_is_the_results() -> None:
    assert refusal(405) is Refusal.MISSING
    assert refusal(404) is Refusal.UNSURE
    for code in (None, 400, 401, 403, 409, 413, 500):
        assert refusal(code) is None


def task(poll_count: int, output: dict[str, object] | None = None) -> Task:
    raw = {"outputData": output} if output is not None else {}
    return Task("t1", "wf1", "job", poll_count=poll_count, raw=raw)


def test_a_first_delivery_goes_back_marked_so_its_next_holder_starts_at_once() -> None:
    back = hand_back(task(1), "w1")
    assert (back.status, back.callback_after_seconds, back.worker_id) == (TaskStatus.IN_PROGRESS, 0, "w1")
    assert back.output_data == {YIELD_MARKER: 1}
    # Its next delivery (pollCount 2, carrying the marker) follows our yield: nobody waits for us.
    assert follows_our_yield(task(2, dict(back.output_data)))


def test_a_delivery_another_holder_may_still_run_goes_back_unmarked() -> None:
    # pollCount 3 without our marker for 2: someone else may still run it; its next holder must wait.
    back = hand_back(task(3), "w1")
    assert (back.status, back.callback_after_seconds) == (TaskStatus.IN_PROGRESS, 0)
    assert YIELD_MARKER not in back.output_data


def test_a_delivery_after_our_yield_goes_back_marked_again() -> None:
    back = hand_back(task(3, {YIELD_MARKER: 2}), "w1")
    assert back.output_data[YIELD_MARKER] == 3
