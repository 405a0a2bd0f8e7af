"""A final result sticks after a heartbeat of unknown fate (``FinalUpdates`` over the real
``LeaseEngine``, stepped on a FakeClock; docs/final-results.md).

The server is ``FakePort``: a "hang" beat times out (no answer: its fate is unknown), a "fail" beat
is refused with an answer of the server's own, ``get_task_ownership`` says what the server shows.
Given/When/Then: the common path (no such beat) sends the result at once and reads nothing; a
terminal result after such a beat is parked first and sent once the beat can no longer land; a yield
is sent at once and read back then, and sent again (v1, bounded, counted, logged once) while the
server shows it undone.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from leasecore.clock import FakeClock
from leasecore.errors import ConductorUnavailable
from leasecore.lease import LeasePolicy
from leasecore.lease.finalcheck import (
    LATE_BEAT_MARGIN_SECONDS,
    MAX_RESENDS,
    PARK_CALLBACK_SECONDS,
    PARK_SETTLE_SECONDS,
)
from leasecore.metrics.prom import PrometheusObserver
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import FinalUpdates, make_result_stick
from leasecore.runner.leasing.senders import InlineSenders
from leasecore.runner.loop.task_end import ChainUpdates
from leasecore.runner.upstream.reporter import Reporter
from leasecore.state.outbox import Outbox, OutboxEntry
from tests.adapters.engine_support import T0, FakePort, Fences, step_until
from tests.adapters.test_metrics_endpoint import value

# No ownership checks (0: never; a long interval is cut down to fit the ownership window): the reads
# these tests count are the final update's own read-backs.
POLICY = LeasePolicy(response_timeout_seconds=10, kill_grace_seconds=1.0,
                     ownership_check_interval_seconds=0)


class Server(FakePort):
    """FakePort that also records every update's result and its time, and reads back ``shown``."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.slow_seconds = 0.01
        self.updates: list[tuple[float, TaskResult, str]] = []
        self.reads: list[float] = []
        self.shown: list[TaskOwnership | None] = []  # what each read returns, in order (the last repeats)

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.updates.append((self.clock.monotonic(), result, "v1"))
        super().update(result, timeout_seconds=timeout_seconds)

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        self.updates.append((self.clock.monotonic(), result, "v2"))
        return None

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self.reads.append(self.clock.monotonic())
        return self.shown.pop(0) if len(self.shown) > 1 else self.shown[0]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


@pytest.fixture
def server(clock: FakeClock) -> Server:
    return Server(clock)


@pytest.fixture
def observer() -> PrometheusObserver:
    return PrometheusObserver(["demo"])


def start(server: Server, clock: FakeClock, beat: str, observer: PrometheusObserver) -> LeaseEngine:
    """Track task t1 (pollCount 3) and step until its first heartbeat has ended as ``beat`` says."""
    engine = LeaseEngine(server, Fences(clock), clock=clock, executor=InlineSenders())
    server.beat_mode["t1"] = beat
    engine.track(Task(task_id="t1", workflow_id="w1", task_type="demo", response_timeout_seconds=10,
                      poll_count=3), POLICY)  # fmt: skip
    step_until(engine, clock, lambda: ("beat-end", "t1") in server.order, within_seconds=30)
    return engine


def updates_of(server: Server, engine: LeaseEngine, clock: FakeClock, observer: PrometheusObserver,
               ) -> FinalUpdates:  # fmt: skip
    return FinalUpdates(server, engine, reader=server, clock=clock, sleep=clock.advance, observer=observer)


def result(status: TaskStatus = TaskStatus.COMPLETED, callback: int = 0) -> TaskResult:
    return TaskResult("t1", "w1", status, output_data={"answer": 42}, callback_after_seconds=callback,
                      worker_id="host")  # fmt: skip


def undone() -> TaskOwnership:
    return TaskOwnership(TaskStatus.IN_PROGRESS, 3, "host")


def test_the_common_path_sends_at_once_and_reads_nothing(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    # Given a heartbeat that was acknowledged
    engine = start(server, clock, "ok", observer)
    assert engine.late_beats("t1") is None
    # When the result is reported
    sent_at = clock.monotonic()
    updates_of(server, engine, clock, observer).update(result())
    # Then it went out at once, once, and nothing was read back
    assert [(t, r.status) for t, r, _ in server.updates] == [(sent_at, TaskStatus.COMPLETED)]
    assert server.reads == []


def test_a_beat_the_server_answered_is_not_of_unknown_fate(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    server.beat_mode["t1"] = "ok"
    engine = start(server, clock, "404", observer)  # the server's own answer: it was handled
    assert engine.late_beats("t1") is None


def test_a_terminal_result_after_a_beat_of_unknown_fate_is_parked_then_sent(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    # Given a heartbeat that timed out (no answer: it may still reach the server)
    engine = start(server, clock, "hang", observer)
    gave_up_at = server.order.index(("beat-end", "t1")) and clock.monotonic()
    late = engine.late_beats("t1")
    assert late is not None and late.until == pytest.approx(gave_up_at + LATE_BEAT_MARGIN_SECONDS)
    assert late.poll_count == 3 and late.task_type == "demo"
    # When the COMPLETED result is reported
    updates_of(server, engine, clock, observer).update(result())
    # Then the task was parked first (IN_PROGRESS, a long callback, the output kept), and the result
    # went out once the beat could no longer land and the park had settled; no read-back after
    (park_at, park, _), (final_at, final, _) = server.updates
    assert park.status is TaskStatus.IN_PROGRESS and park.callback_after_seconds == PARK_CALLBACK_SECONDS
    assert park.output_data == {"answer": 42} and park.worker_id == "host"
    assert final == result()
    assert final_at >= late.until and final_at >= park_at + PARK_SETTLE_SECONDS
    assert server.reads == []
    assert engine.late_beats("t1") is None  # reported: the engine forgot the task


def test_a_parked_update_v2_final_update_goes_through_v1_and_claims_nothing(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    engine = start(server, clock, "hang", observer)
    chain = ChainUpdates(server, engine, reader=server, clock=clock, sleep=clock.advance, observer=observer)
    # (a claimed task's lease counts from the update-v2's send: the park's wait would come off it)
    assert chain.update_v2(result()) is None
    assert [(r.status, via) for _, r, via in server.updates] == [
        (TaskStatus.IN_PROGRESS, "v1"), (TaskStatus.COMPLETED, "v1")]


def test_an_update_v2_final_update_on_the_common_path_still_claims(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    engine = start(server, clock, "ok", observer)
    chain = ChainUpdates(server, engine, reader=server, clock=clock, sleep=clock.advance, observer=observer)
    chain.update_v2(result())
    assert [(r.status, via) for _, r, via in server.updates] == [(TaskStatus.COMPLETED, "v2")]


def test_a_yield_after_a_beat_of_unknown_fate_is_read_back_and_sent_again_while_undone(
    server: Server, clock: FakeClock, observer: PrometheusObserver, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a heartbeat that timed out, and a server that shows the yield undone once
    engine = start(server, clock, "hang", observer)
    late = engine.late_beats("t1")
    assert late is not None
    server.shown = [undone(), TaskOwnership(TaskStatus.SCHEDULED, 3, "host")]
    # When the yield is reported
    caplog.set_level(logging.INFO, logger="conductor_run.report")
    sent_at = clock.monotonic()
    updates_of(server, engine, clock, observer).update(result(TaskStatus.IN_PROGRESS, callback=30))
    # Then it went out at once, was read back once the beat could no longer land, sent again (v1),
    # and read back again: the record stands
    times = [t for t, _, _ in server.updates]
    assert times[0] == sent_at and len(times) == 2
    assert server.reads[0] == pytest.approx(late.until) and len(server.reads) == 2
    assert [r for _, r, _ in server.updates] == [result(TaskStatus.IN_PROGRESS, 30)] * 2
    assert value(observer, "conductor_run_final_results_resent_total", taskType="demo") == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([w for w in warnings if "undid it" in w]) == 1
    assert any("the record stands after a re-send" in r.getMessage() for r in caplog.records)


def test_re_sends_are_bounded_and_logged_once(
    server: Server, clock: FakeClock, observer: PrometheusObserver, caplog: pytest.LogCaptureFixture
) -> None:
    engine = start(server, clock, "hang", observer)
    server.shown = [undone()]  # the server keeps showing it undone
    caplog.set_level(logging.INFO, logger="conductor_run.report")
    updates_of(server, engine, clock, observer).update(result(TaskStatus.IN_PROGRESS, callback=30))
    assert len(server.updates) == 1 + MAX_RESENDS
    assert value(observer, "conductor_run_final_results_resent_total", taskType="demo") == MAX_RESENDS
    assert len([r for r in caplog.records if "undid it" in r.getMessage()]) == 1
    assert any("still undone after the last re-send" in r.getMessage() for r in caplog.records)


def test_a_record_that_stands_or_moved_on_is_left_alone(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    engine = start(server, clock, "hang", observer)
    server.shown = [TaskOwnership(TaskStatus.IN_PROGRESS, 4, "other")]  # polled again since
    updates_of(server, engine, clock, observer).update(result(TaskStatus.IN_PROGRESS, callback=0))
    assert len(server.updates) == 1 and len(server.reads) == 1


def test_a_failed_park_is_a_failed_attempt_and_the_beats_resume(
    server: Server, clock: FakeClock, observer: PrometheusObserver
) -> None:
    engine = start(server, clock, "hang", observer)
    server.update_failures = 1  # the park is refused
    with pytest.raises(ConductorUnavailable):
        updates_of(server, engine, clock, observer).update(result())
    assert [r.status for _, r, _ in server.updates] == [TaskStatus.IN_PROGRESS]
    assert engine.view("t1").state.value != "done"  # still tracked: the reporter retries


# ----- the outbox's deliveries -------------------------------------------------------------------


def test_the_outbox_hands_each_delivered_entry_to_its_hook_and_a_failing_hook_loses_nothing(
    tmp_path: Path,
) -> None:
    outbox = Outbox(tmp_path, server="http://127.0.0.1:1/api")
    outbox.save(result(), poll_count=3)
    outbox.save(TaskResult("t2", "w2", TaskStatus.COMPLETED, worker_id="host"), poll_count=1)
    shown = {"t1": undone(), "t2": TaskOwnership(TaskStatus.IN_PROGRESS, 2, "other")}  # t2: polled since
    sent: list[TaskResult] = []
    seen: list[str] = []

    def hook(entry: OutboxEntry) -> None:
        seen.append(entry.result.task_id)
        raise RuntimeError("a bug in the read-back")

    report = outbox.deliver(sent.append, read_task=shown.get, delivered=hook)
    assert (report.delivered, report.dropped) == (1, 1)
    assert seen == ["t1"] and [r.task_id for r in sent] == ["t1"]  # delivered once, hook once
    assert not outbox.any_saved()


def test_a_saved_result_delivered_while_a_beat_may_land_is_read_back_and_sent_again(
    clock: FakeClock, server: Server, observer: PrometheusObserver
) -> None:
    # Given a saved yield delivered at once, and a server that shows it undone once
    server.shown = [undone(), TaskOwnership(TaskStatus.SCHEDULED, 3, "host")]
    sent: list[TaskResult] = []
    read_at = clock.monotonic() + 12.0
    # When it is made to stick (what the wiring's hook does for an outbox delivery)
    make_result_stick(result(TaskStatus.IN_PROGRESS, 30), read_at=read_at, poll_count=3, reader=server,
                      resend=lambda r: bool(sent.append(r)) or True, clock=clock, sleep=clock.advance,
                      on_resent=lambda: observer.on_final_result_resent("demo"))  # fmt: skip
    # Then it was read back at read_at, sent again once, and read back again
    assert server.reads[0] == read_at and len(server.reads) == 2
    assert sent == [result(TaskStatus.IN_PROGRESS, 30)]
    assert value(observer, "conductor_run_final_results_resent_total", taskType="demo") == 1


class WaitingGuard:
    """The engine side of the guard, with a heartbeat in flight that ``begin_final_update`` waits out
    (``wait_seconds`` of the clock)."""

    def __init__(self, clock: FakeClock, wait_seconds: float) -> None:
        self.clock, self.wait_seconds = clock, wait_seconds

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool:
        self.clock.advance(self.wait_seconds)
        return True

    def late_beats(self, task_id: str) -> None:
        return None

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        pass

    def final_update_failed(self, task_id: str) -> None:
        pass


def test_a_claimed_tasks_lease_counts_from_the_send_after_the_wait_for_a_beat_in_flight(
    server: Server, clock: FakeClock
) -> None:
    # Given a heartbeat of the finished task in flight for 4 s when its update-v2 is due
    claimed = Task(task_id="t2", workflow_id="w2", task_type="demo", poll_count=1)
    server.update_v2 = lambda result, *, timeout_seconds=None: (  # type: ignore[method-assign]
        server.updates.append((clock.monotonic(), result, "v2")) or claimed)
    chain = ChainUpdates(server, WaitingGuard(clock, 4.0), clock=clock)  # type: ignore[arg-type]
    chained: list[tuple[str | None, float]] = []
    done = threading.Event()
    reporter = Reporter(chain, lambda outcome: done.set(), clock=clock)
    # When the reporter sends the result, claiming the next task
    submitted_at = clock.monotonic()
    reporter.submit(result(), retry_seconds=30.0,
                    on_chained=lambda task, at: chained.append((task.task_id if task else None, at)))
    assert done.wait(10)
    reporter.close()
    # Then the claimed task's lease counts from the request's send, 4 s after the attempt began (from
    # the attempt's start, 4 s of the new task's lease would be gone before it was claimed)
    assert chained == [("t2", submitted_at + 4.0)]
    assert server.updates[0][0] == submitted_at + 4.0
