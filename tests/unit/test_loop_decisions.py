"""The runner's pure decisions (admission, a held start, what an exit means) as tables, and the
bounded tally of outcomes and the next-runs book of its task table. No threads, no sleeping."""

from __future__ import annotations

import random

import pytest

from leasecore.lease import FenceReason, LeasePolicy
from leasecore.models import Task, TaskOwnership, TaskStatus
from leasecore.runner.loop.decisions import (
    AckDuplicate,
    BackUnstarted,
    ChainedBack,
    Delivery,
    Earlier,
    EndUnstarted,
    ExitMeaning,
    HandBack,
    HeldStart,
    HeldView,
    Hold,
    HoldOver,
    LeaseNow,
    Read,
    ReportCheck,
    ReportMeaning,
    Start,
    Unstarted,
    WaitBehind,
    admit,
    exit_meaning,
    held_start,
    hold_over,
    report_check,
    report_meaning,
    unstarted_meaning,
)
from leasecore.runner.loop.status import NextRun
from leasecore.runner.loop.table import _RUNNING, NextRuns, Tally

RUNNING = Earlier(poll_count=1, reporting=False, ownership_lost=False, yield_waiting=False)
REPORTING = Earlier(poll_count=1, reporting=True, ownership_lost=False, yield_waiting=False)
KILLED = Earlier(poll_count=1, reporting=False, ownership_lost=True, yield_waiting=False)
KILLED_YIELD_WAITS = Earlier(poll_count=1, reporting=False, ownership_lost=True, yield_waiting=True)

ADMISSIONS = [
    # (what the main thread sees, what it decides)
    (Delivery(1, lease=LeaseNow.LIVE), Start(track=False)),
    (Delivery(1), Start(track=True)),  # not tracked at poll time: its lease starts now
    (Delivery(2, lease=LeaseNow.LIVE, start_delay=7.5), Hold(waits=True, dying=False, track=False)),
    (Delivery(1, lease=LeaseNow.LIVE, dying_here=True), Hold(waits=False, dying=True, track=False)),
    (Delivery(2, start_delay=3.0, dying_here=True), Hold(waits=True, dying=True, track=True)),
    # a next run polled while the run here is reported, or killed for a lost ownership
    (Delivery(2, earlier=REPORTING, lease=LeaseNow.LIVE), WaitBehind("reporting")),
    (Delivery(2, earlier=KILLED, lease=LeaseNow.LIVE), WaitBehind("killed")),
    # ... not while that run's yield waits to go out (it would reach the new delivery): a duplicate
    (Delivery(2, earlier=KILLED_YIELD_WAITS), AckDuplicate(newer=True, give_back=True)),
    # the run here delivered again: its lease is acked, never a second copy
    (Delivery(1, earlier=RUNNING, lease=LeaseNow.LIVE), AckDuplicate(newer=False, give_back=True)),
    (Delivery(2, earlier=RUNNING), AckDuplicate(newer=True, give_back=True)),
    (Delivery(1, earlier=REPORTING), AckDuplicate(newer=False, give_back=True)),  # not newer: the same run
    (Delivery(1, earlier=RUNNING, surplus=True), AckDuplicate(newer=False, give_back=False)),
    (Delivery(1, surplus=True, lease=LeaseNow.LIVE), HandBack()),
    (Delivery(1, surplus=True, stopping=True), HandBack()),
    (Delivery(1, stopping=True, lease=LeaseNow.LIVE), BackUnstarted()),
    (Delivery(1, stopping=True, chained=True, lease=LeaseNow.LIVE), ChainedBack()),
    (Delivery(2, stopping=True, start_delay=9.0), BackUnstarted()),
    # never started on a lease that is over: fenced already, or its TERM point passed unfenced
    (Delivery(1, lease=LeaseNow.FENCED), EndUnstarted("its lease was fenced before its command started")),
    (Delivery(2, lease=LeaseNow.PAST_TERM, start_delay=5.0),
     EndUnstarted("its lease ran out before the runner handled it")),
]


@pytest.mark.parametrize(("view", "expected"), ADMISSIONS)
def test_admission_table(view: Delivery, expected: object) -> None:
    assert admit(view) == expected


def test_admission_never_starts_a_second_copy_of_a_task_here() -> None:
    """Whatever else holds, a delivery of a task whose run is still here never starts a child."""
    for earlier in (RUNNING, REPORTING, KILLED, KILLED_YIELD_WAITS):
        for poll_count in (1, 2, 3):
            for lease in LeaseNow:
                for surplus in (False, True):
                    view = Delivery(poll_count, earlier=earlier, surplus=surplus, lease=lease)
                    assert not isinstance(admit(view), Start | Hold), view


def _own(status: TaskStatus, poll_count: int = 2) -> TaskOwnership:
    return TaskOwnership(status, poll_count, "someone")


HELD = [
    # (lease, read-back, answer) -> step
    (LeaseNow.LIVE, Read.NOT_SENT, None, HeldStart.READ_BACK),
    (LeaseNow.LIVE, Read.IN_FLIGHT, None, HeldStart.WAIT),
    (LeaseNow.LIVE, Read.FAILED, None, HeldStart.READ_AGAIN),
    (LeaseNow.LIVE, Read.NO_READER, None, HeldStart.START),
    (LeaseNow.LIVE, Read.ANSWERED, _own(TaskStatus.IN_PROGRESS), HeldStart.START),
    # the previous holder's late FAILED landed on our delivery: the server created a retry already
    (LeaseNow.LIVE, Read.ANSWERED, _own(TaskStatus.FAILED), HeldStart.NOT_OURS),
    (LeaseNow.LIVE, Read.ANSWERED, _own(TaskStatus.COMPLETED), HeldStart.NOT_OURS),
    (LeaseNow.LIVE, Read.ANSWERED, _own(TaskStatus.SCHEDULED), HeldStart.NOT_OURS),  # re-queued
    (LeaseNow.LIVE, Read.ANSWERED, _own(TaskStatus.IN_PROGRESS, 3), HeldStart.NOT_OURS),  # polled again
    (LeaseNow.LIVE, Read.ANSWERED, None, HeldStart.NOT_OURS),  # 404
    # the lease is over: its fence ends the task, never a start
    (LeaseNow.FENCED, Read.ANSWERED, _own(TaskStatus.IN_PROGRESS), HeldStart.WAIT),
    (LeaseNow.PAST_TERM, Read.NO_READER, None, HeldStart.WAIT),
    (LeaseNow.PAST_TERM, Read.NOT_SENT, None, HeldStart.WAIT),
]


@pytest.mark.parametrize(("lease", "read", "answer", "step"), HELD)
def test_held_start_table(lease: LeaseNow, read: Read, answer: TaskOwnership | None, step: HeldStart) -> None:
    got, why = held_start(HeldView(2, lease, read, answer))
    assert got is step
    assert (why is not None) == (step is HeldStart.NOT_OURS)
    if answer is not None and step is HeldStart.NOT_OURS:
        assert answer.status.value in why or "polled again" in why  # type: ignore[operator]


@pytest.mark.parametrize(("lost", "start_error", "meaning"), [
    (False, False, ExitMeaning.RESULT),
    (False, True, ExitMeaning.NOT_STARTED),
    (True, False, ExitMeaning.FORGET),
    (True, True, ExitMeaning.FORGET),  # no longer ours: nothing is reported, whatever happened
])
def test_exit_meaning_table(lost: bool, start_error: bool, meaning: ExitMeaning) -> None:
    assert exit_meaning(ownership_lost=lost, start_error=start_error) is meaning


@pytest.mark.parametrize(("status", "gone", "meaning"), [
    (TaskStatus.COMPLETED, True, ReportMeaning.REPORT),
    (TaskStatus.COMPLETED, False, ReportMeaning.REPORT),  # nothing is retried: escapees die on their own
    (TaskStatus.FAILED_WITH_TERMINAL_ERROR, False, ReportMeaning.REPORT),  # no retry follows it
    (TaskStatus.FAILED, True, ReportMeaning.REPORT),
    (TaskStatus.FAILED, False, ReportMeaning.HOLD),  # its retry would start next to the escapees
    (TaskStatus.IN_PROGRESS, True, ReportMeaning.REPORT_YIELD),
    (TaskStatus.IN_PROGRESS, False, ReportMeaning.HOLD),  # a yield is marked only once nothing runs
])
def test_report_meaning_table(status: TaskStatus, gone: bool, meaning: ReportMeaning) -> None:
    assert report_meaning(status, tree_gone=gone) is meaning


@pytest.mark.parametrize(("fence", "check"), [
    (None, ReportCheck.SEND),  # the lease held to the end
    (FenceReason.LEASE_EXPIRED, ReportCheck.READ_FIRST),  # beats or checks lost, a stall: re-delivered?
    (FenceReason.HARD_TIMEOUT, ReportCheck.READ_FIRST),  # the server's ceiling: it may have moved on
    (FenceReason.OWNERSHIP_LOST, ReportCheck.READ_FIRST),  # (forgotten anyway: never reported)
    (FenceReason.EXEC_TIMEOUT, ReportCheck.SEND),  # our own limit, the lease still held
    (FenceReason.SHUTDOWN, ReportCheck.SEND),
])  # fmt: skip
def test_report_check_table(fence: FenceReason | None, check: ReportCheck) -> None:
    assert report_check(fence) is check


def test_every_fence_has_a_report_check() -> None:
    assert {f for f in FenceReason if report_check(f) is ReportCheck.READ_FIRST} == {
        FenceReason.LEASE_EXPIRED, FenceReason.HARD_TIMEOUT, FenceReason.OWNERSHIP_LOST}


@pytest.mark.parametrize(("status", "gone", "over"), [
    (TaskStatus.IN_PROGRESS, True, HoldOver.REPORT_YIELD),
    (TaskStatus.IN_PROGRESS, False, HoldOver.REPORT_UNMARKED),  # its next holder waits instead
    (TaskStatus.FAILED, True, HoldOver.REPORT),
    (TaskStatus.FAILED, False, HoldOver.REPORT_ANYWAY),
])
def test_hold_over_table(status: TaskStatus, gone: bool, over: HoldOver) -> None:
    assert hold_over(status, tree_gone=gone) is over


@pytest.mark.parametrize(("lost", "elsewhere", "meaning"), [
    (True, True, Unstarted.FORGET),
    (True, False, Unstarted.FORGET),
    (False, True, Unstarted.HAND_BACK),  # never FAILED: its retry would start next to the previous holder
    (False, False, Unstarted.FAIL),
])
def test_unstarted_meaning_table(lost: bool, elsewhere: bool, meaning: Unstarted) -> None:
    assert unstarted_meaning(ownership_lost=lost, may_run_elsewhere=elsewhere) is meaning


# ----- the task table's bounded parts -------------------------------------------------------------


def test_tally_keeps_the_newest_statuses_and_counts_the_rest_exactly() -> None:
    tally = Tally(kept=3)
    first = tally.start()  # still running while 10 others start and end
    for i in range(10):
        index = tally.start()
        tally.end(index, TaskStatus.FAILED if i == 1 else TaskStatus.COMPLETED)
    assert tally.started == 11
    assert len(tally) == 3  # the one still running is never folded
    assert tally.statuses() == (None, TaskStatus.COMPLETED, TaskStatus.COMPLETED)
    assert tally.folded == 8 and tally.folded_not_completed == 1  # the FAILED is still counted
    tally.end(first, TaskStatus.COMPLETED)
    assert tally.statuses() == (TaskStatus.COMPLETED,) * 3 and tally.folded == 8


def test_a_long_run_outcome_stays_bounded_and_exact() -> None:
    from leasecore.runner.ports import RunOutcome

    tally = Tally(kept=100)
    for i in range(5000):
        tally.end(tally.start(), None if i == 7 else TaskStatus.COMPLETED)
    outcome = RunOutcome(started=tally.started, statuses=tally.statuses(),
                         folded_not_completed=tally.folded_not_completed)
    assert len(outcome.statuses) == 100 and outcome.started == 5000
    assert not outcome.all_completed  # the one unreported task, long folded, still counts


class _CopyingTally(Tally):
    """The fold as it was first written (a copy of every slot, then deletes until within the bound):
    the reference the walk that stops early must match."""

    def _fold(self) -> None:
        for index, status in list(self._slots.items()):
            if len(self._slots) <= self._kept:
                return
            if status is _RUNNING:
                continue
            del self._slots[index]
            self.folded += 1
            if status not in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
                self.folded_not_completed += 1


def test_tally_folds_exactly_as_the_reference_under_random_starts_and_ends() -> None:
    rng = random.Random(11)
    for kept in (1, 3, 10):
        ours, reference = Tally(kept=kept), _CopyingTally(kept=kept)
        running: list[int] = []
        for _ in range(3000):
            if running and (len(running) > 12 or rng.random() < 0.5):
                index = running.pop(rng.randrange(len(running)))  # ends out of start order
                status = rng.choice([TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.IN_PROGRESS, None])
                ours.end(index, status)
                reference.end(index, status)
            else:
                index = ours.start()
                assert reference.start() == index
                running.append(index)
            assert ours.statuses() == reference.statuses()
            assert ours.folded == reference.folded
            assert ours.folded_not_completed == reference.folded_not_completed
        assert ours.folded > 0


def _task(poll_count: int) -> Task:
    return Task.from_json({"taskId": "t", "taskType": "x", "workflowInstanceId": "w", "pollCount": poll_count,
                           "status": "IN_PROGRESS", "responseTimeoutSeconds": 30})


def _run(poll_count: int, surplus: bool = False) -> NextRun:
    return NextRun(_task(poll_count), 0.0, LeasePolicy(response_timeout_seconds=30), surplus, False)


def test_next_runs_keep_one_per_task_and_give_back_the_second_slot() -> None:
    runs = NextRuns()
    assert runs.keep(_run(2)) == 0
    assert runs.keep(_run(3)) == 1  # both took a slot: one goes back
    assert runs.keep(_run(2)) == 1  # an older one arriving late does not replace the newer
    kept = runs.pop("t")
    assert kept is not None and kept.task.poll_count == 3 and runs.pop("t") is None
    assert runs.keep(_run(2)) == 0 and runs.keep(_run(3, surplus=True)) == 0
    kept = runs.pop("t")  # the surplus (newer) one takes over the slot of the one it replaced
    assert kept is not None and kept.task.poll_count == 3 and not kept.surplus
