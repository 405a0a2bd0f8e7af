"""A result of a lease that ran out is read back before it is sent (``Reporter.submit(read_first=True)``):
Conductor's update carries no pollCount, so once the server re-delivered the task to another runner
our FAILED would end that runner's delivery. Scripted port and reader on a FakeClock; nothing sleeps."""

from __future__ import annotations

import threading
from pathlib import Path

from leasecore.clock import FakeClock
from leasecore.errors import ConductorError, ConductorUnavailable
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.state.outbox import Outbox
from tests.adapters.test_reporter_readback import Port, Reader

EXPIRED = TaskResult("t1", "wf1", TaskStatus.FAILED, reason_for_incompletion="lease expired", worker_id="w1")
IP = TaskStatus.IN_PROGRESS
DOWN = ConductorUnavailable("connection refused")


def report(reads: list[TaskOwnership | ConductorError | None], *, read_first: bool = True,
           outbox: Outbox | None = None, budget: float = 5.0) -> tuple[ReportOutcome, Port, Reader]:
    clock = FakeClock(start=100.0)
    port, reader = Port(clock, []), Reader(clock, reads)
    outcomes: list[ReportOutcome] = []
    done = threading.Event()

    def on_done(outcome: ReportOutcome) -> None:
        outcomes.append(outcome)
        done.set()

    reporter = Reporter(port, on_done, clock=clock, reader=reader, wait=clock.advance, outbox=outbox)
    reporter.submit(EXPIRED, retry_seconds=budget, poll_count=3, read_first=read_first)
    assert done.wait(10), "no outcome"
    reporter.close()
    return outcomes[0], port, reader


def test_a_task_polled_again_by_another_runner_gets_no_failed_from_us() -> None:
    outcome, port, reader = report([TaskOwnership(IP, 4, "other")])
    assert port.sent == []  # it would have ended the other runner's delivery
    assert reader.at == [100.0]
    assert not outcome.delivered and outcome.saved_to is None
    assert outcome.error is not None and "polled again" in outcome.error


def test_a_task_the_server_timed_out_gets_nothing_either() -> None:
    outcome, port, _ = report([TaskOwnership(TaskStatus.TIMED_OUT, 3)])
    assert port.sent == [] and not outcome.delivered


def test_a_task_still_ours_gets_its_failed_at_once() -> None:
    outcome, port, reader = report([TaskOwnership(IP, 3, "w1")])
    assert reader.at == [100.0] and port.sent == [100.0]
    assert outcome.delivered


def test_a_failed_read_is_tried_again_with_the_backoff_then_the_result_is_sent() -> None:
    outcome, port, reader = report([DOWN, DOWN, TaskOwnership(IP, 3, "w1")])
    assert reader.at == [100.0, 100.5, 101.5]  # 0.5 s, then 1 s (the report backoff)
    assert port.sent == [101.5] and outcome.delivered


def test_no_answer_within_the_budget_keeps_it_in_the_outbox_which_reads_back_before_it_sends(
    tmp_path: Path,
) -> None:
    outbox = Outbox(tmp_path / "outbox", server="test")
    outcome, port, reader = report([DOWN] * 10, outbox=outbox)
    assert port.sent == [] and not outcome.delivered
    assert outcome.saved_to is not None and outbox.has_saved("t1")
    assert reader.at[-1] <= 105.0  # within the 5 s budget of a lost lease's result


def test_without_read_first_nothing_is_read() -> None:
    outcome, port, reader = report([], read_first=False)
    assert reader.at == [] and port.sent == [100.0] and outcome.delivered
