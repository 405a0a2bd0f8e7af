"""A saved result is delivered at the next start only while the task is still ours (review issue).

Real files in a temporary outbox; the server's view of the task is a scripted ``read_task``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.errors import ConductorUnavailable
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.state.outbox import DeliveryReport, Outbox, still_saved

URL = "http://conductor.example/api"
FAILED = TaskResult("t1", "w1", TaskStatus.FAILED, reason_for_incompletion="lease expired")


@pytest.fixture
def outbox_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The outbox's log lines, whether or not a CLI run in this process stopped propagation."""
    logger = logging.getLogger("conductor_run.outbox")
    logger.addHandler(caplog.handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        with caplog.at_level(logging.INFO, logger="conductor_run.outbox"):
            yield caplog
    finally:
        logger.propagate = propagate
        logger.removeHandler(caplog.handler)


def test_the_poll_count_is_saved_with_the_result(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL)
    path = outbox.save(FAILED, poll_count=3)
    assert json.loads(path.read_text())["poll_count"] == 3
    assert [e.poll_count for e in outbox.entries()] == [3]


@pytest.mark.parametrize(
    ("on_server", "why"),
    [
        (TaskOwnership(TaskStatus.IN_PROGRESS, 2, "thief"),
         "polled again by worker 'thief' (pollCount 2, ours 1)"),
        (TaskOwnership(TaskStatus.SCHEDULED, 1), "re-queued (SCHEDULED)"),
        (TaskOwnership(TaskStatus.TIMED_OUT, 1), "TIMED_OUT on the server"),
        (TaskOwnership(TaskStatus.COMPLETED, 2), "COMPLETED on the server"),
        (None, "no longer knows the task (404)"),
    ],
)
def test_a_task_no_longer_ours_is_dropped_with_one_line_saying_why(
    tmp_path: Path, outbox_log: pytest.LogCaptureFixture, on_server: TaskOwnership | None, why: str
) -> None:
    # Given a FAILED saved while we held pollCount 1, and the task since moved on
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(FAILED, poll_count=1)
    sent: list[TaskResult] = []
    # When the next start delivers saved results
    report = outbox.deliver(sent.append, read_task=lambda task_id: on_server)
    # Then nothing is sent over the other run, the file is gone, and the log says why
    assert sent == []
    assert (report.delivered, report.dropped, report.kept) == (0, 1, 0)
    assert outbox.entries() == []
    [line] = [r.getMessage() for r in outbox_log.records]
    assert line.startswith("dropping the saved result of task t1 (FAILED): no longer ours: ") and why in line


@pytest.mark.parametrize("saved_poll_count", [1, 0])  # 0: a file saved before pollCounts were kept
def test_a_task_still_ours_gets_its_saved_result(tmp_path: Path, saved_poll_count: int) -> None:
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(FAILED, poll_count=saved_poll_count)
    asked: list[str] = []
    sent: list[TaskResult] = []

    def read_task(task_id: str) -> TaskOwnership:
        asked.append(task_id)
        return TaskOwnership(TaskStatus.IN_PROGRESS, 1, "host")

    report = outbox.deliver(sent.append, read_task=read_task)
    assert asked == ["t1"] and sent == [FAILED]
    assert report.delivered == 1 and outbox.entries() == []


def test_a_parked_result_finds_its_own_park_and_is_sent(tmp_path: Path) -> None:
    # A result parked first (IN_PROGRESS with a long callback, by this worker), then saved when its
    # own update failed: the task reads SCHEDULED under our pollCount, the park, not a re-queue.
    parked = TaskResult("t1", "w1", TaskStatus.COMPLETED, output_data={"n": 1}, worker_id="host")
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(parked, poll_count=1)
    sent: list[TaskResult] = []
    report = outbox.deliver(sent.append, read_task=lambda _id: TaskOwnership(TaskStatus.SCHEDULED, 1, "host"))
    assert sent == [parked] and report.delivered == 1 and outbox.entries() == []


def test_a_read_that_fails_keeps_every_result_for_the_next_start(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(FAILED, poll_count=1)
    outbox.save(TaskResult("t2", "w2", TaskStatus.COMPLETED), poll_count=1)
    sent: list[TaskResult] = []

    def unreachable(task_id: str) -> TaskOwnership:
        raise ConductorUnavailable("connection refused")

    report = outbox.deliver(sent.append, read_task=unreachable)
    assert sent == [] and report.kept == 2 and len(outbox.entries()) == 2


def test_the_reporter_saves_the_poll_count_it_was_given(tmp_path: Path) -> None:
    class Unreachable:
        def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
            raise ConductorUnavailable("connection refused")

    outbox = Outbox(tmp_path, server=URL)
    done: list[ReportOutcome] = []
    reporter = Reporter(Unreachable(), done.append, outbox=outbox)
    reporter.submit(FAILED, retry_seconds=0.0, poll_count=4)  # no time to retry: saved at once
    reporter.close()
    assert done[0].saved_to is not None
    assert [(e.result.task_id, e.poll_count) for e in outbox.entries()] == [("t1", 4)]


def test_a_save_in_progress_is_neither_read_nor_dropped(tmp_path: Path) -> None:
    # The runner delivers saved results while its reporter may be saving one (a temp file, then a
    # rename): a half-written temp file read as "unreadable" was deleted under the writer's feet.
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(FAILED, poll_count=1)
    in_progress = tmp_path / ".tmp-abc123.json"
    in_progress.write_text('{"version": 1, "serv')
    assert [e.result.task_id for e in outbox.entries()] == ["t1"]
    assert in_progress.exists()
    assert outbox.any_saved()
    (tmp_path / next(p.name for p in tmp_path.glob("*.json") if not p.name.startswith("."))).unlink()
    assert not outbox.any_saved()  # only the temp file is left


def test_a_newer_result_saved_while_an_older_one_is_delivered_is_kept(tmp_path: Path) -> None:
    # The redelivery thread reads the old result of a task that has since been polled again here; while
    # it asks the server, the reporter saves the new run's result at the same path (a rename). The old
    # one is dropped (no longer ours), and its deletion used to take the new file with it.
    outbox = Outbox(tmp_path, server=URL)
    outbox.save(FAILED, poll_count=1)
    newer = TaskResult("t1", "w1", TaskStatus.COMPLETED)

    def read_task(task_id: str) -> TaskOwnership:
        outbox.save(newer, poll_count=2)  # the reporter, meanwhile
        return TaskOwnership(TaskStatus.IN_PROGRESS, 2, "us")

    report = outbox.deliver(lambda result: None, read_task=read_task)
    assert (report.delivered, report.dropped) == (0, 1)
    assert [(e.result.status, e.poll_count) for e in outbox.entries()] == [(TaskStatus.COMPLETED, 2)]


def test_any_saved_looks_only_at_this_servers_results(tmp_path: Path) -> None:
    # The redelivery thread asks every 10 s: another server's results (which entries() reads and
    # skips) must not make it read every file again each time.
    Outbox(tmp_path, server="http://other.example/api").save(FAILED, poll_count=1)
    ours = Outbox(tmp_path, server=URL)
    assert not ours.any_saved()
    ours.save(FAILED, poll_count=1)
    assert ours.any_saved()


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_two_runners_sharing_a_state_directory_deliver_a_saved_result_once(tmp_path: Path) -> None:
    # Each runner's redelivery reads the outbox; both found the same file and both sent it (a saved
    # IN_PROGRESS re-queued the task twice). The second delivery runs while the first one's update
    # is on its way: it must find nothing to send.
    first, second = Outbox(tmp_path, server=URL), Outbox(tmp_path, server=URL)
    first.save(FAILED, poll_count=1)
    sent: list[str] = []
    inner: list[DeliveryReport] = []

    def update_first(result: TaskResult) -> None:
        inner.append(second.deliver(lambda r: sent.append(f"second {r.task_id}"), read_task=ours))
        sent.append(f"first {result.task_id}")

    report = first.deliver(update_first, read_task=ours)
    assert sent == ["first t1"]
    assert (report.delivered, inner[0].delivered) == (1, 0)
    assert list(tmp_path.iterdir()) == []  # the claim is gone with the delivery


def ours(task_id: str) -> TaskOwnership:
    return TaskOwnership(TaskStatus.IN_PROGRESS, 1, "us")


def test_a_result_whose_delivery_failed_is_back_under_its_name(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL)
    path = outbox.save(FAILED, poll_count=1)

    def unreachable(result: TaskResult) -> None:
        assert not path.exists() and outbox.any_saved()  # claimed, and still counted as waiting
        assert still_saved([path]) == {path}
        raise ConductorUnavailable("connection refused")

    assert outbox.deliver(unreachable, read_task=ours).kept == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert outbox.deliver(lambda r: None, read_task=ours).delivered == 1
    assert still_saved([path]) == set()


def test_a_newer_save_during_a_failed_delivery_wins(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL)
    path = outbox.save(FAILED, poll_count=1)
    newer = TaskResult("t1", "w1", TaskStatus.COMPLETED)

    def unreachable(result: TaskResult) -> None:
        outbox.save(newer, poll_count=2)  # the reporter, meanwhile
        raise ConductorUnavailable("connection refused")

    outbox.deliver(unreachable, read_task=ours)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    assert [(e.result.status, e.poll_count) for e in outbox.entries()] == [(TaskStatus.COMPLETED, 2)]


def test_a_claim_of_a_dead_runner_is_delivered_and_a_live_ones_is_left_alone(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL)
    dead = outbox.save(FAILED, poll_count=1)
    dead_claim = dead.with_name(f".claim-{_dead_pid()}-1-{dead.name}")
    dead.rename(dead_claim)
    live = outbox.save(TaskResult("t2", "w1", TaskStatus.COMPLETED), poll_count=1)
    with open(f"/proc/{os.getpid()}/stat") as stat:
        start_time = int(stat.read().rsplit(")", 1)[1].split()[19])
    live_claim = live.with_name(f".claim-{os.getpid()}-{start_time}-{live.name}")
    live.rename(live_claim)
    assert outbox.any_saved()
    sent: list[str] = []
    report = outbox.deliver(lambda r: sent.append(r.task_id), read_task=ours)
    assert sent == ["t1"] and report.delivered == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [live_claim.name]  # being sent by someone else


def test_without_hard_links_a_failed_delivery_is_renamed_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    outbox = Outbox(tmp_path, server=URL)
    path = outbox.save(FAILED, poll_count=1)

    def unreachable(result: TaskResult) -> None:
        raise ConductorUnavailable("connection refused")

    assert outbox.deliver(unreachable, read_task=ours).kept == 1
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_result_claimed_by_a_runner_that_died_is_still_saved_for_its_task(tmp_path: Path) -> None:
    # The next start saves a FAILED for each task of the dead runner's trees unless a result of the
    # task is saved already: one its redelivery had claimed when it died counts, or the put-back would
    # then lose to that FAILED ("the newer save wins") and the real result would be gone.
    outbox = Outbox(tmp_path, server=URL)
    path = outbox.save(FAILED, poll_count=1)
    path.rename(path.with_name(f".claim-{_dead_pid()}-1-{path.name}"))
    assert outbox.has_saved("t1")
    assert not outbox.has_saved("t2")
