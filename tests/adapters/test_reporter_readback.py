"""An update whose answer was lost is read back before it is sent again (leasecore.runner.upstream.reporter
with the final-update table): a yield sent again after its next run was polled would re-queue (undo)
that run. A scripted port and reader on a FakeClock; the reporter's waits step the clock, nothing sleeps."""

from __future__ import annotations

import threading
from pathlib import Path

from leasecore.clock import FakeClock
from leasecore.errors import ConductorError, ConductorUnavailable
from leasecore.lease.finalcheck import LATE_BEAT_MARGIN_SECONDS
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.state.outbox import Outbox

YIELD = TaskResult("t1", "wf1", TaskStatus.IN_PROGRESS, callback_after_seconds=5, worker_id="w1")
DONE = TaskResult("t1", "wf1", TaskStatus.COMPLETED, worker_id="w1")
LOST = ConductorUnavailable("timed out")  # no answer: it may have landed


class Port:
    def __init__(self, clock: FakeClock, answers: list[ConductorError | None]) -> None:
        self.clock, self.answers = clock, list(answers)
        self.sent: list[float] = []

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.sent.append(self.clock.monotonic())
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer


class Reader:
    def __init__(self, clock: FakeClock, reads: list[TaskOwnership | ConductorError | None]) -> None:
        self.clock, self.reads = clock, list(reads)
        self.at: list[float] = []

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self.at.append(self.clock.monotonic())
        answer = self.reads.pop(0)
        if isinstance(answer, ConductorError):
            raise answer
        return answer


def report(result: TaskResult, answers: list[ConductorError | None],
           reads: list[TaskOwnership | ConductorError | None]) -> tuple[ReportOutcome, Port, Reader]:
    clock = FakeClock(start=100.0)
    port, reader = Port(clock, answers), Reader(clock, reads)
    outcomes: list[ReportOutcome] = []
    done = threading.Event()

    def on_done(outcome: ReportOutcome) -> None:
        outcomes.append(outcome)
        done.set()

    reporter = Reporter(port, on_done, clock=clock, reader=reader, wait=clock.advance)
    reporter.submit(result, retry_seconds=60.0, poll_count=3)
    assert done.wait(10), "no outcome"
    reporter.close()
    return outcomes[0], port, reader


def test_a_lost_yield_whose_next_run_was_polled_is_not_sent_again() -> None:
    outcome, port, reader = report(YIELD, [LOST], [TaskOwnership(TaskStatus.IN_PROGRESS, 4, "w2")])
    assert port.sent == [100.0]  # once: a second send would re-queue the run of pollCount 4
    assert reader.at == [100.0 + LATE_BEAT_MARGIN_SECONDS]  # read once it can no longer land
    assert outcome.delivered


def test_a_lost_yield_the_server_re_queued_landed() -> None:
    outcome, port, _ = report(YIELD, [LOST], [TaskOwnership(TaskStatus.SCHEDULED, 3)])
    assert len(port.sent) == 1 and outcome.delivered


def test_a_lost_yield_that_never_landed_is_sent_again() -> None:
    outcome, port, _ = report(YIELD, [LOST, None], [TaskOwnership(TaskStatus.IN_PROGRESS, 3, "w1")])
    assert port.sent == [100.0, 100.0 + LATE_BEAT_MARGIN_SECONDS]
    assert outcome.delivered


def test_a_failed_read_is_tried_again_then_judged() -> None:
    outcome, port, reader = report(YIELD, [LOST], [ConductorUnavailable("down"),
                                                   TaskOwnership(TaskStatus.SCHEDULED, 3)])
    assert len(reader.at) == 2 and len(port.sent) == 1 and outcome.delivered


def test_a_lost_yield_of_a_task_that_ended_meanwhile_is_dropped() -> None:
    outcome, port, _ = report(YIELD, [LOST], [TaskOwnership(TaskStatus.CANCELED, 3)])
    assert len(port.sent) == 1 and not outcome.delivered and outcome.saved_to is None


def test_a_terminal_result_of_unknown_fate_that_landed_is_not_sent_again() -> None:
    outcome, port, reader = report(DONE, [LOST], [TaskOwnership(TaskStatus.COMPLETED, 3)])
    assert port.sent == [100.0] and reader.at == [100.0 + LATE_BEAT_MARGIN_SECONDS] and outcome.delivered


def test_a_terminal_result_of_unknown_fate_that_never_landed_is_sent_again() -> None:
    outcome, port, _ = report(DONE, [LOST, None], [TaskOwnership(TaskStatus.IN_PROGRESS, 3, "w1")])
    assert port.sent == [100.0, 100.0 + LATE_BEAT_MARGIN_SECONDS] and outcome.delivered


def test_a_terminal_result_refused_by_a_5xx_is_retried_without_a_read() -> None:
    outcome, port, reader = report(DONE, [ConductorUnavailable("server error", status_code=500), None], [])
    assert port.sent == [100.0, 100.5] and reader.at == [] and outcome.delivered


def test_a_forced_stop_during_the_wait_leaves_the_result_to_the_outbox_unread(tmp_path: Path) -> None:
    clock = FakeClock(start=100.0)
    port, reader = Port(clock, [LOST]), Reader(clock, [])
    outbox = Outbox(tmp_path / "outbox", server="http://127.0.0.1:1/api", clock=clock)
    outcomes: list[ReportOutcome] = []
    reporter: Reporter

    def wait(seconds: float) -> None:  # the stop comes while the reporter waits to read back
        reporter.hurry()
        clock.advance(seconds)

    reporter = Reporter(port, outcomes.append, clock=clock, reader=reader, wait=wait, outbox=outbox)
    reporter.close()  # (after close, submit delivers on this thread)
    reporter.submit(YIELD, retry_seconds=60.0, poll_count=3)
    (outcome,) = outcomes
    assert reader.at == [] and len(port.sent) == 1  # nothing read early, nothing sent again
    assert not outcome.delivered and outcome.saved_to is not None and outcome.saved_to.exists()
