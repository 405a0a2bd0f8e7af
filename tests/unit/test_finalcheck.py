"""The pure rules that make a final result stick after a heartbeat of unknown fate
(leasecore.lease.finalcheck): when a beat may still land, how the final update goes out, when to read
the task back, what the read says, and the bounded read / re-send steps. Times are plain numbers: the
caller's clock (a FakeClock in the engine's tests) is the only one."""

from __future__ import annotations

import pytest

from leasecore.lease.finalcheck import (
    CONFIRM_AFTER_SECONDS,
    LATE_BEAT_MARGIN_SECONDS,
    MAX_READS,
    MAX_RESENDS,
    PARK_SETTLE_SECONDS,
    READ_RETRY_SECONDS,
    ReadBack,
    ReadStep,
    beat_may_land_until,
    parked_send_at,
    plan_final_update,
    read_back_at,
    undone,
    unknown_fate,
)
from leasecore.models import TaskOwnership, TaskStatus

OURS = TaskOwnership(TaskStatus.IN_PROGRESS, poll_count=3, worker_id="host-1")


def test_no_answer_or_a_gateways_answer_is_an_unknown_fate_and_the_servers_own_answer_is_not() -> None:
    assert unknown_fate(None) and unknown_fate(502) and unknown_fate(503) and unknown_fate(504)
    assert not unknown_fate(500) and not unknown_fate(404) and not unknown_fate(400)


def test_a_beat_given_up_on_may_land_until_the_margin_has_passed() -> None:
    assert beat_may_land_until(100.0) == 100.0 + LATE_BEAT_MARGIN_SECONDS


def test_the_common_path_sends_at_once_and_reads_nothing() -> None:
    # Given no heartbeat of unknown fate
    plan = plan_final_update(TaskStatus.COMPLETED, None, now=50.0)
    # Then the result goes out now, unparked, and is never read back
    assert not plan.park and plan.send_at == 50.0
    assert read_back_at(None, update_sent_at=50.0) is None


def test_a_beat_that_can_no_longer_land_changes_nothing() -> None:
    plan = plan_final_update(TaskStatus.COMPLETED, late_until=49.0, now=50.0)
    assert not plan.park and plan.send_at == 50.0
    assert read_back_at(49.0, update_sent_at=50.0) is None


@pytest.mark.parametrize("status", [TaskStatus.COMPLETED, TaskStatus.FAILED,
                                    TaskStatus.FAILED_WITH_TERMINAL_ERROR])
def test_a_terminal_result_is_parked_until_the_beat_can_no_longer_land(status: TaskStatus) -> None:
    plan = plan_final_update(status, late_until=52.0, now=50.0)
    assert plan.park and plan.send_at == 52.0
    # sent at 52.0, the beat cannot land after it: no read-back
    assert read_back_at(52.0, update_sent_at=52.0) is None


def test_a_parked_result_waits_for_the_park_to_settle_too() -> None:
    plan = plan_final_update(TaskStatus.COMPLETED, late_until=52.0, now=50.0)
    assert parked_send_at(plan, park_acked_at=50.1) == 52.0  # the late beat's bound is later
    assert parked_send_at(plan, park_acked_at=51.5) == pytest.approx(51.5 + PARK_SETTLE_SECONDS)


def test_a_yield_goes_out_at_once_and_is_read_back_once_the_beat_can_no_longer_land() -> None:
    plan = plan_final_update(TaskStatus.IN_PROGRESS, late_until=52.0, now=50.0)
    assert not plan.park and plan.send_at == 50.0
    assert read_back_at(52.0, update_sent_at=50.0) == 52.0


@pytest.mark.parametrize(("ownership", "expected"), [
    (OURS, True),
    (None, False),  # 404: gone
    (TaskOwnership(TaskStatus.COMPLETED, 3, "host-1"), False),  # the record stands
    (TaskOwnership(TaskStatus.SCHEDULED, 3, "host-1"), False),  # a yield that stands
    (TaskOwnership(TaskStatus.IN_PROGRESS, 4, "host-1"), False),  # polled again since
    (TaskOwnership(TaskStatus.IN_PROGRESS, 3, "host-2"), False),  # someone else's
    (TaskOwnership(TaskStatus.IN_PROGRESS, 0, "host-1"), False),  # pollCount unknown: never ours
])
def test_only_an_in_progress_record_under_this_runner_is_undone(
    ownership: TaskOwnership | None, expected: bool
) -> None:
    assert undone(ownership, poll_count=3, worker_id="host-1") is expected


def test_an_unknown_delivery_or_worker_of_ours_is_never_taken_as_undone() -> None:
    assert not undone(OURS, poll_count=0, worker_id="host-1")
    assert not undone(OURS, poll_count=3, worker_id=None)


def test_a_read_that_finds_the_record_standing_ends_it() -> None:
    check = ReadBack(10.0, poll_count=3, worker_id="host-1")
    assert check.next_at == 10.0
    assert check.on_read(10.0, TaskOwnership(TaskStatus.COMPLETED, 3, "host-1")) is ReadStep.DONE
    assert check.next_at is None and check.resent == 0 and check.outcome == "the record stands"


def test_an_undone_record_is_sent_again_then_confirmed() -> None:
    check = ReadBack(10.0, poll_count=3, worker_id="host-1")
    assert check.on_read(10.0, OURS) is ReadStep.RESEND
    assert check.next_at is None  # nothing to read before the re-send is over
    assert check.on_resent(10.2, ok=True) is ReadStep.WAIT
    assert check.next_at == pytest.approx(10.2 + CONFIRM_AFTER_SECONDS)
    assert check.on_read(11.2, TaskOwnership(TaskStatus.COMPLETED, 3, "host-1")) is ReadStep.DONE
    assert check.resent == 1 and check.outcome == "the record stands after a re-send"


def test_re_sends_are_bounded() -> None:
    check = ReadBack(10.0, poll_count=3, worker_id="host-1", max_reads=10)
    now = 10.0
    for _ in range(MAX_RESENDS):
        assert check.on_read(now, OURS) is ReadStep.RESEND
        check.on_resent(now, ok=True)
        now = check.next_at or now
    assert check.on_read(now, OURS) is ReadStep.DONE
    assert check.resent == MAX_RESENDS and check.outcome == "still undone after the last re-send"


def test_failed_reads_are_retried_then_given_up() -> None:
    check = ReadBack(10.0, poll_count=3, worker_id="host-1")
    now = 10.0
    for _ in range(MAX_READS - 1):
        assert check.on_read_failed(now) is ReadStep.WAIT
        assert check.next_at == pytest.approx(now + READ_RETRY_SECONDS)
        now = check.next_at
    assert check.on_read_failed(now) is ReadStep.DONE
    assert check.next_at is None and check.outcome == "the task could not be read back"


def test_a_failed_re_send_is_read_back_again_while_reads_are_left() -> None:
    check = ReadBack(10.0, poll_count=3, worker_id="host-1", max_reads=2)
    assert check.on_read(10.0, OURS) is ReadStep.RESEND
    assert check.on_resent(10.1, ok=False) is ReadStep.WAIT
    assert check.next_at == pytest.approx(10.1 + READ_RETRY_SECONDS)
    assert check.on_read(11.1, OURS) is ReadStep.RESEND  # the last re-send (MAX_RESENDS = 2)
    assert check.on_resent(11.2, ok=True) is ReadStep.DONE  # no read left to confirm it
    assert check.outcome == "sent again; no read left to confirm it"
