"""The threaded lease engine with a scriptable fake LeasePort, on the real clock.

Timing assertions carry generous margins (the machine is a loaded 2-core box): the goal is well under
100 ms, the assertions allow several hundred. Waits are condition waits with deadlines, never sleeps.
"""

from __future__ import annotations

import itertools
import logging
import queue
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest

from leasecore.backoff import Backoff
from leasecore.checkbudget import CheckBudget
from leasecore.clock import FakeClock
from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.errors import ConductorNotFound, ConductorUnavailable
from leasecore.lease import (
    FENCE_MARGIN_SECONDS,
    FenceAction,
    FenceReason,
    KillTree,
    LeasePolicy,
    LeaseState,
    TerminateTree,
)
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.engine import LeaseEngine
from leasecore.runner.finalupdates import FinalUpdates
from leasecore.runner.reporter import Reporter, ReportOutcome
from leasecore.server import EmbeddedServer

MARGIN = 0.5  # seconds: what "on time" may be off by on a loaded machine


class FakePort:
    """A LeasePort whose answers are scripted per task; records every call with its time."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.beats: dict[str, list[float]] = defaultdict(list)
        self.beat_timeouts: dict[str, list[float]] = defaultdict(list)
        self.checks: dict[str, list[float]] = defaultdict(list)
        self.beat_mode: dict[str, str] = {}  # ok | fail | 404 | hang | stuck | slow
        self.check_mode: dict[str, str] = {}  # ok | stuck (until ``release``)
        self.status: dict[str, TaskStatus | None] = {}
        self.poll_count: dict[str, int] = {}  # what a check reads back (default 1)
        self.release = threading.Event()  # frees "stuck" calls
        self.slow_seconds = 0.4
        self.update_failures = 0  # the next N updates fail
        self.order: list[tuple[str, str]] = []  # (event, task id) in the order they happened

    def note(self, event: str, task_id: str) -> None:
        with self.cv:
            self.order.append((event, task_id))
            self.cv.notify_all()

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        now = time.monotonic()
        with self.cv:
            self.beats[task_id].append(now)
            self.beat_timeouts[task_id].append(timeout_seconds)
            self.order.append(("beat-start", task_id))
            mode = self.beat_mode.get(task_id, "ok")
            self.cv.notify_all()
        try:
            self._answer(mode, timeout_seconds)
        finally:
            self.note("beat-end", task_id)

    def _answer(self, mode: str, timeout_seconds: float) -> None:
        if mode == "slow":  # a slow but working server
            self.release.wait(min(self.slow_seconds, timeout_seconds))
        if mode == "hang":  # a server that never answers: the client times out
            self.release.wait(timeout_seconds)
            raise ConductorUnavailable("read timed out")
        if mode == "stuck":  # a broken client that ignores its own timeout
            self.release.wait()
            raise ConductorUnavailable("finally gave up")
        if mode == "fail":
            raise ConductorUnavailable("connection refused")
        if mode == "404":
            raise ConductorNotFound("No such task found by id", status_code=404)

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        with self.cv:
            self.checks[task_id].append(time.monotonic())
            self.order.append(("check", task_id))
            self.cv.notify_all()
        if self.check_mode.get(task_id) == "stuck":
            self.release.wait()
        with self.cv:
            status = self.status.get(task_id, TaskStatus.IN_PROGRESS)
            return None if status is None else TaskOwnership(status, self.poll_count.get(task_id, 1), "host")

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        """The reporter's call, for FinalUpdates: slow; fails while ``update_failures`` is positive."""
        self.note("update-start", result.task_id)
        try:
            self.release.wait(self.slow_seconds)
            with self.cv:
                self.update_failures -= 1
                if self.update_failures >= 0:
                    raise ConductorUnavailable("server busy")
        finally:
            self.note("update-end", result.task_id)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        with self.cv:
            assert self.cv.wait_for(predicate, timeout), "condition not reached in time"


class Fences:
    """Records on_fence callbacks with their times."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.calls: list[tuple[float, str, FenceAction]] = []

    def __call__(self, task_id: str, action: FenceAction) -> None:
        with self.cv:
            self.calls.append((time.monotonic(), task_id, action))
            self.cv.notify_all()

    def of(self, task_id: str) -> list[tuple[float, FenceAction]]:
        with self.cv:
            return [(t, a) for t, k, a in self.calls if k == task_id]

    def wait_for(self, count: int, task_id: str, timeout: float) -> list[tuple[float, FenceAction]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.of(task_id)) >= count, timeout), self.calls
            return self.of(task_id)


def task(n: int | str, poll_count: int = 0) -> Task:
    return Task(
        task_id=f"t{n}",
        workflow_id=f"w{n}",
        task_type="demo",
        response_timeout_seconds=2,
        poll_count=poll_count,
    )


def policy(r: float = 2.0, **kwargs: object) -> LeasePolicy:
    """R=2 s; no kill grace, no fence margin unless a test sets them: beats every 0.8 R = 1.6 s."""
    values: dict[str, object] = {
        "ownership_check_interval_seconds": 0.0, "kill_grace_seconds": 0.0, "fence_margin_seconds": 0.0,
    }
    values.update(kwargs)
    return LeasePolicy(response_timeout_seconds=r, **values)  # type: ignore[arg-type]


@pytest.fixture
def port() -> FakePort:
    return FakePort()


@pytest.fixture
def fences() -> Fences:
    return Fences()


@pytest.fixture
def engine(port: FakePort, fences: Fences) -> Iterator[LeaseEngine]:
    eng = LeaseEngine(port, fences, senders=4, max_senders=16)
    eng.start()
    yield eng
    port.release.set()
    eng.stop(timeout_seconds=30)


def lateness(calls: list[float], polled_at: float, interval: float) -> list[float]:
    """How late each beat was. Acks are immediate and none fails, so the k-th beat is due k intervals
    after the poll: a late beat keeps the cadence (the next is due one interval after the late one was
    planned), and one more than half an interval late pushes the next later still (counted late)."""
    return [call - (polled_at + k * interval) for k, call in enumerate(calls, start=1)]


@pytest.mark.slow
def test_1000_leases_at_r_2s_are_heartbeated_on_time(port: FakePort, fences: Fences) -> None:
    # Given 1000 leases with R=2 s (a beat every 1.6 s) polled over the last 1.6 s, ownership checks on
    engine = LeaseEngine(port, fences, senders=8)
    engine.start()
    try:
        start = time.monotonic()
        polled = {}
        rng = random.Random(7)
        for n in range(1000):
            polled[f"t{n}"] = start - rng.uniform(0, 1.6)
            engine.track(
                task(n), policy(2.0, ownership_check_interval_seconds=5.0), polled_at=polled[f"t{n}"]
            )
        # When every lease has beaten three times (a few seconds of real time)
        port.wait_for(lambda: all(len(port.beats[k]) >= 3 for k in polled), timeout=60)
        metrics = engine.metrics()
    finally:
        engine.stop(timeout_seconds=30)
    # Then no beat was early, p99 lateness (due -> port call) is far under the lease's margin
    late = [x for k, t0 in polled.items() for x in lateness(port.beats[k][:3], t0, 1.6)]
    p99 = statistics.quantiles(late, n=100)[98]
    print(f"\nlateness over {len(late)} beats: p50 {statistics.median(late) * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {max(late) * 1000:.1f} ms; engine p99 "
          f"{metrics.heartbeat_lateness_p99_seconds * 1000:.1f} ms")  # fmt: skip
    # Against the cadence no beat may be early; the fake stamps a call a little after the engine's
    # own send time, so allow that gap. The engine's own figure is exact.
    assert min(late) > -0.05
    assert p99 < 0.25, f"p99 heartbeat lateness {p99 * 1000:.0f} ms"
    assert metrics.heartbeat_lateness_p99_seconds < 0.25
    assert metrics.heartbeats_sent >= 3000
    assert fences.calls == []  # nobody lost a lease
    assert sum(len(v) for v in port.checks.values()) > 0  # ownership checks ran alongside


@pytest.mark.slow
def test_a_hanging_request_for_one_task_does_not_delay_the_others(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given one task whose heartbeat call never returns (a client ignoring its timeout), and 20 others
    port.beat_mode["t-stuck"] = "stuck"
    t0 = time.monotonic()
    # (grace 0.5 s, margin 0.2 s: its TERM point is poll + 1.3 s, its only beat due at 0.8 x 1.3 s)
    engine.track(task("-stuck"), policy(2.0, kill_grace_seconds=0.5, fence_margin_seconds=0.2), polled_at=t0)
    for n in range(20):
        engine.track(task(n), policy(2.0), polled_at=t0)
    # When the others beat twice more while the stuck call still hangs
    port.wait_for(lambda: all(len(port.beats[f"t{n}"]) >= 3 for n in range(20)), timeout=30)
    # Then each of them beat on time
    for n in range(20):
        assert max(lateness(port.beats[f"t{n}"][:3], t0, 1.6)) < MARGIN
    # And the stuck task was fenced at its TERM point (poll + 1.3 s) although its call still hangs, and
    # killed at deadline - margin (poll + 1.8 s)
    (t_term, term), (t_kill, kill) = fences.wait_for(2, "t-stuck", timeout=10)[:2]
    assert (term, kill) == (TerminateTree(FenceReason.LEASE_EXPIRED), KillTree(FenceReason.LEASE_EXPIRED))
    assert 1.3 - 0.01 <= t_term - t0 < 1.3 + MARGIN
    assert 1.8 - 0.01 <= t_kill - t0 < 1.8 + MARGIN
    assert len(port.beats["t-stuck"]) == 1  # never two beats in flight for one task
    assert port.beat_timeouts["t-stuck"][0] <= 0.26 + 1e-6  # bounded by the time left to the TERM point


def test_failing_heartbeats_fence_at_the_term_point_and_kill_before_the_deadline(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given a task (R=3 s, grace 0.5 s, margin 0.2 s: TERM point 2.3 s) whose server is down
    port.beat_mode["t1"] = "fail"
    t0 = time.monotonic()
    engine.track(task(1), policy(3.0, kill_grace_seconds=0.5, fence_margin_seconds=0.2), polled_at=t0)
    # When the lease runs out
    (t_term, term), (t_kill, kill) = fences.wait_for(2, "t1", timeout=10)
    # Then: beat at 1.84 s, one retry 0.25 s later (the backoff's 1 s would be past the TERM point);
    # TERM at 2.3 s, KILL at 2.8 s, before the server's deadline at 3 s
    assert term == TerminateTree(FenceReason.LEASE_EXPIRED) and kill == KillTree(FenceReason.LEASE_EXPIRED)
    assert 2.3 - 0.01 <= t_term - t0 < 2.3 + MARGIN
    assert 2.8 - 0.01 <= t_kill - t0 < 2.8 + MARGIN
    assert engine.view("t1").consecutive_failures == 2
    assert engine.fence_reason("t1") is FenceReason.LEASE_EXPIRED


def test_a_hanging_server_is_timed_out_by_the_client_and_retried(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given R=10 s: the beat at 8 s gets a 2 s timeout and the server never answers
    port.beat_mode["t1"] = "hang"
    t0 = time.monotonic() - 7.5  # polled 7.5 s ago: the first beat is due in 0.5 s
    engine.track(task(1), policy(10.0, kill_grace_seconds=0.2), polled_at=t0)
    # When the lease runs out
    fences.wait_for(1, "t1", timeout=10)
    # Then the first attempt had (about) 2 s, the retry 1 s after it failed only what was left
    timeouts = port.beat_timeouts["t1"]
    assert len(timeouts) == 1 or timeouts[1] < timeouts[0]
    assert timeouts[0] == pytest.approx(2.0, abs=0.1)


def test_a_404_on_a_heartbeat_fences_for_ownership_lost_at_once(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    port.beat_mode["t1"] = "404"
    t0 = time.monotonic()
    engine.track(task(1), policy(2.0), polled_at=t0)
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term - port.beats["t1"][0] < MARGIN
    assert engine.fence_reason("t1") is FenceReason.OWNERSHIP_LOST


def test_a_cancelled_task_is_fenced_by_the_ownership_check(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given checks every 0.3 s and a task the server reports as CANCELED (its heartbeats still "work")
    port.status["t1"] = TaskStatus.CANCELED
    engine.track(task(1), policy(30.0, ownership_check_interval_seconds=0.3))
    # Then it is terminated right after the first check
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term - port.checks["t1"][0] < MARGIN


def test_after_reported_no_more_heartbeats(engine: LeaseEngine, port: FakePort) -> None:
    # Given a task that beat once, then exited and was reported
    engine.track(task(1), policy(1.5), polled_at=time.monotonic() - 1.1)  # first beat now
    engine.track(task(2), policy(1.5), polled_at=time.monotonic() - 1.1)
    port.wait_for(lambda: len(port.beats["t1"]) >= 1, timeout=10)
    engine.child_exited("t1")
    engine.reported("t1")
    # When another task beats twice more (t1's next beat would have been due in between)
    port.wait_for(lambda: len(port.beats["t2"]) >= 3, timeout=10)
    # Then t1 got no further beat, and the engine forgot it
    assert len(port.beats["t1"]) == 1
    with pytest.raises(KeyError):
        engine.view("t1")


def test_heartbeats_continue_after_the_child_exits_until_reported(
    engine: LeaseEngine, port: FakePort
) -> None:
    t0 = time.monotonic()
    engine.track(task(1), policy(1.5), polled_at=t0)
    engine.child_exited("t1")
    port.wait_for(lambda: len(port.beats["t1"]) >= 2, timeout=10)
    assert engine.view("t1").state is LeaseState.REPORTING


def test_shutdown_terminates_now_and_a_forced_shutdown_kills(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    engine.track(task(1), policy(30.0, kill_grace_seconds=20.0))
    engine.track(task(2), policy(30.0, kill_grace_seconds=20.0))
    engine.shutdown(None)
    assert [a for _, a in fences.of("t1")] == [TerminateTree(FenceReason.SHUTDOWN)]
    engine.shutdown(None, force=True)
    assert [a for _, a in fences.of("t2")] == [
        TerminateTree(FenceReason.SHUTDOWN),
        KillTree(FenceReason.SHUTDOWN),
    ]


def test_a_drain_fences_at_the_drain_deadline(engine: LeaseEngine, fences: Fences) -> None:
    now = time.monotonic()
    engine.track(task(1), policy(30.0))
    engine.shutdown("t1", drain_deadline=now + 0.5)
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.SHUTDOWN)
    assert 0.5 - 0.01 <= t_term - now < 0.5 + MARGIN


def test_the_exec_timeout_counts_from_child_started(engine: LeaseEngine, fences: Fences) -> None:
    engine.track(task(1), policy(30.0, exec_timeout_seconds=0.6))
    started = time.monotonic()
    engine.child_started("t1")
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.EXEC_TIMEOUT)
    assert 0.6 - 0.01 <= t_term - started < 0.6 + MARGIN


def test_a_redelivered_task_keeps_its_lease_and_the_poll_counts_as_an_ack(engine: LeaseEngine) -> None:
    t0 = time.monotonic()
    engine.track(task(1), policy(30.0), polled_at=t0 - 5)
    engine.track(task(1), policy(30.0), polled_at=t0)
    view = engine.view("t1")
    assert view.polled_at == t0 - 5
    assert view.lease_deadline == pytest.approx(t0 + 30)


def test_a_saturated_pool_is_visible_in_the_metrics(port: FakePort, fences: Fences) -> None:
    # Given a pool of one sender that is stuck in a call
    engine = LeaseEngine(port, fences, senders=1, max_senders=1)
    engine.start()
    try:
        port.beat_mode["t0"] = "stuck"
        now = time.monotonic()
        engine.track(task(0), policy(30.0), polled_at=now - 24)  # beat due at once
        port.wait_for(lambda: len(port.beats["t0"]) == 1, timeout=10)
        # When another task's beat comes due
        engine.track(task(1), policy(30.0), polled_at=now - 24)
        # Then it waits in the queue, and the metrics say so
        metrics = engine.metrics()
        assert (metrics.senders, metrics.busy_senders, metrics.queued) == (1, 1, 1)
        assert metrics.saturated_waits >= 1
        assert engine.view("t1").heartbeat_in_flight
        # And once the stuck call ends, the queued beat goes out
        port.release.set()
        port.wait_for(lambda: len(port.beats["t1"]) == 1, timeout=10)
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)


def test_a_free_sender_takes_heartbeats_before_ownership_checks(port: FakePort, fences: Fences) -> None:
    # Given one sender, stuck in a call, and an ownership check queued before two heartbeats
    engine = LeaseEngine(port, fences, senders=1, max_senders=1)
    engine.start()
    try:
        port.beat_mode["t0"] = "stuck"
        now = time.monotonic()
        engine.track(task(0), policy(30.0), polled_at=now - 24)
        port.wait_for(lambda: len(port.beats["t0"]) == 1, timeout=10)
        engine.track(task("c"), policy(30.0, ownership_check_interval_seconds=5.0), polled_at=now - 5)
        engine.track(task(1), policy(30.0), polled_at=now - 24)
        engine.track(task(2), policy(30.0), polled_at=now - 24)
        assert engine.metrics().queued == 3
        # When the sender is free again
        port.release.set()
        port.wait_for(lambda: ("check", "tc") in port.order, timeout=10)
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)
    # Then both heartbeats went out before the check that had waited longer
    check = port.order.index(("check", "tc"))
    assert port.order.index(("beat-start", "t1")) < check
    assert port.order.index(("beat-start", "t2")) < check


@pytest.mark.slow
def test_hanging_ownership_checks_never_hold_up_other_tasks_heartbeats(
    port: FakePort, fences: Fences
) -> None:
    # Given a pool of at most 4 senders and 8 tasks whose ownership checks hang (a slow GET)
    engine = LeaseEngine(port, fences, senders=2, max_senders=4)
    engine.start()
    try:
        now = time.monotonic()
        for n in range(8):
            port.check_mode[f"tc{n}"] = "stuck"
            engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=5.0), polled_at=now - 5)
        port.wait_for(lambda: sum(len(v) for v in port.checks.values()) >= 2, timeout=10)
        # When 10 other tasks need a heartbeat every 1.6 s
        t0 = time.monotonic()
        for n in range(10):
            engine.track(task(n), policy(2.0), polled_at=t0)
        port.wait_for(lambda: all(len(port.beats[f"t{n}"]) >= 3 for n in range(10)), timeout=30)
        calling_checks = sum(len(v) for v in port.checks.values())
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)
    # Then every beat was on time, and the checks never took more than half the pool
    for n in range(10):
        assert max(lateness(port.beats[f"t{n}"][:3], t0, 1.6)) < MARGIN
    assert calling_checks == 2
    assert [c for c in fences.calls if not c[1].startswith("tc")] == []


def test_stop_joins_every_thread(port: FakePort, fences: Fences) -> None:
    engine = LeaseEngine(port, fences, senders=3)
    engine.start()
    for n in range(5):
        engine.track(task(n), policy(1.5), polled_at=time.monotonic() - 1.0)
    port.wait_for(lambda: all(port.beats[f"t{n}"] for n in range(5)), timeout=10)
    engine.stop(timeout_seconds=30)
    assert [t for t in threading.enumerate() if t.name.startswith("lease-")] == []


def test_an_on_fence_that_raises_does_not_stop_the_engine(port: FakePort) -> None:
    # Given a runner callback that fails for t1
    seen: list[str] = []
    cv = threading.Condition()

    def on_fence(task_id: str, action: FenceAction) -> None:
        with cv:
            seen.append(task_id)
            cv.notify_all()
        if task_id == "t1":
            raise RuntimeError("runner bug")

    engine = LeaseEngine(port, on_fence, senders=1)
    engine.start()
    try:
        engine.track(task(1), policy(30.0, lease_extend_enabled=False, heartbeat_timeout_seconds=0.2))
        engine.track(task(2), policy(30.0, lease_extend_enabled=False, heartbeat_timeout_seconds=0.4))
        # Then t2 is still fenced after t1's callback blew up
        with cv:
            assert cv.wait_for(lambda: "t2" in seen, timeout=10)
    finally:
        engine.stop(timeout_seconds=30)


def test_against_the_embedded_server_heartbeats_keep_a_task_past_r_and_a_terminate_fences_it(
    fences: Fences,
) -> None:
    # Given the embedded server on 127.0.0.1 and a task with R=2 s, polled by us
    with EmbeddedServer() as server, ConductorClient(server.url, timeout_seconds=5) as client:
        admin = ConductorAdmin(client)
        admin.register_task_defs([{"name": "lease_demo", "responseTimeoutSeconds": 2, "retryCount": 0}])
        admin.register_workflow(
            {
                "name": "lease_wf",
                "version": 1,
                "schemaVersion": 2,
                "tasks": [{"name": "lease_demo", "taskReferenceName": "a", "type": "SIMPLE"}],
            }
        )
        workflow_id = admin.start_workflow("lease_wf", {})
        polled_at = time.monotonic()
        [polled] = client.poll("lease_demo", count=1, timeout_ms=1000)
        engine = LeaseEngine(client, fences, senders=2)
        engine.start()
        try:
            engine.track(polled, LeasePolicy.from_task(polled, ownership_check_interval_seconds=0.5,
                                                       kill_grace_seconds=0.2))  # fmt: skip
            # When 2.5 R pass (the server's decider would have timed the task out without beats)
            deadline = polled_at + 5.0
            with fences.cv:
                fences.cv.wait_for(lambda: bool(fences.calls), timeout=max(0.0, deadline - time.monotonic()))
            # Then it is still IN_PROGRESS, nothing was fenced, and the lease was extended
            assert fences.calls == []
            assert client.get_task_status(polled.task_id, timeout_seconds=5) is TaskStatus.IN_PROGRESS
            view = engine.view(polled.task_id)
            assert view.last_ack_at > view.polled_at and view.consecutive_failures == 0
            # When the workflow is terminated (the task becomes CANCELED; heartbeats still get 200)
            admin.terminate_workflow(workflow_id, "test")
            # Then an ownership check notices and the tree is fenced, with nothing to report
            [(_, term)] = fences.wait_for(1, polled.task_id, timeout=10)[:1]
            assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
        finally:
            engine.stop(timeout_seconds=30)


# ----- the final update excludes heartbeats ------------------------------------------------------


def intervals(order: list[tuple[str, str]], task_id: str, kind: str) -> list[tuple[int, int]]:
    """(start index, end index) in ``order`` of each ``kind`` call ("beat" / "update") of one task."""
    starts = [i for i, (e, k) in enumerate(order) if k == task_id and e == f"{kind}-start"]
    ends = [i for i, (e, k) in enumerate(order) if k == task_id and e == f"{kind}-end"]
    return list(zip(starts, ends, strict=True))


def test_a_final_update_never_overlaps_a_heartbeat_and_none_follows_it(
    engine: LeaseEngine, port: FakePort
) -> None:
    # Given 4 tasks beating about every 0.3 s, each beat call taking 0.15 s, and the real Reporter
    # delivering their results through FinalUpdates: updates take 0.15 s and the first 8 fail
    port.slow_seconds = 0.15
    fast = policy(1.25, min_heartbeat_interval_seconds=0.1, heartbeat_ratio=0.25)
    ids = [f"t{n}" for n in range(4)]
    for n in range(4):
        port.beat_mode[f"t{n}"] = "slow"
        engine.track(task(n, poll_count=1), fast)
    outcomes: queue.SimpleQueue[ReportOutcome] = queue.SimpleQueue()
    reporter = Reporter(FinalUpdates(port, engine), outcomes.put, backoff_cap_seconds=0.35)
    port.wait_for(lambda: all(len(port.beats[k]) >= 2 for k in ids), timeout=30)
    # When each task's child exits and its result is reported while its heartbeats keep coming
    port.update_failures = 2 * len(ids)
    try:
        for k in ids:
            engine.child_exited(k)
            reporter.submit(TaskResult(k, "w", TaskStatus.COMPLETED), retry_seconds=30)
        assert all(outcomes.get(timeout=60).delivered for _ in ids)
    finally:
        reporter.close()
    engine.stop(timeout_seconds=30)  # every sender done: the order log is complete
    # Then, per task, no beat call overlaps an update call, none starts after the last update began,
    # and the engine forgot the task once its update was acknowledged
    order = list(port.order)
    for k in ids:
        beats, ups = intervals(order, k, "beat"), intervals(order, k, "update")
        for b0, b1 in beats:
            for u0, u1 in ups:
                assert b1 < u0 or u1 < b0, f"{k}: beat {b0}-{b1} overlaps update {u0}-{u1}: {order}"
        assert all(b0 < ups[-1][0] for b0, _ in beats), f"{k}: a beat after the final update: {order}"
        with pytest.raises(KeyError):
            engine.view(k)
    # And heartbeats went on between a failed attempt and its retry (the lease outlives a slow report)
    retried = [k for k in ids if len(intervals(order, k, "update")) >= 2]
    assert retried, order
    assert any(
        intervals(order, k, "update")[0][1] < b0 < intervals(order, k, "update")[-1][0]
        for k in retried
        for b0, _ in intervals(order, k, "beat")
    ), order


def test_begin_final_update_waits_for_the_heartbeat_in_flight(engine: LeaseEngine, port: FakePort) -> None:
    # Given a beat in flight that takes 0.6 s
    port.slow_seconds = 0.6
    port.beat_mode["t1"] = "slow"
    engine.track(task(1), policy(30.0), polled_at=time.monotonic() - 24)  # due at once
    port.wait_for(lambda: ("beat-start", "t1") in port.order, timeout=10)
    # When the final update begins
    assert engine.begin_final_update("t1") is True
    port.note("update-start", "t1")
    # Then it returned only after the beat call had ended
    assert port.order.index(("beat-end", "t1")) < port.order.index(("update-start", "t1"))


def test_a_queued_heartbeat_is_withdrawn_and_sent_only_if_the_update_fails(
    port: FakePort, fences: Fences
) -> None:
    # Given one sender, stuck in another task's call, and t1's beat waiting in the queue
    engine = LeaseEngine(port, fences, senders=1, max_senders=1)
    engine.start()
    try:
        port.beat_mode["t0"] = "stuck"
        now = time.monotonic()
        engine.track(task(0), policy(30.0), polled_at=now - 24)
        port.wait_for(lambda: len(port.beats["t0"]) == 1, timeout=10)
        engine.track(task(1), policy(30.0), polled_at=now - 24)
        assert engine.metrics().queued == 1
        # When t1's final update begins, then the sender is freed
        assert engine.begin_final_update("t1") is True
        view = engine.view("t1")
        assert (engine.metrics().queued, view.heartbeat_in_flight, view.consecutive_failures) == (0, False, 0)
        port.release.set()
        port.wait_for(lambda: len(port.beats["t0"]) >= 2, timeout=10)  # the sender runs again
        assert port.beats["t1"] == []
        # And when the update fails, the overdue beat goes out at once
        engine.final_update_failed("t1")
        port.wait_for(lambda: len(port.beats["t1"]) == 1, timeout=10)
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)


def test_the_wait_for_a_heartbeat_that_ignores_its_timeout_is_bounded(
    engine: LeaseEngine, port: FakePort
) -> None:
    port.beat_mode["t1"] = "stuck"
    engine.track(task(1), policy(30.0), polled_at=time.monotonic() - 24)
    port.wait_for(lambda: len(port.beats["t1"]) == 1, timeout=10)
    started = time.monotonic()
    assert engine.begin_final_update("t1", timeout_seconds=0.3) is False
    assert 0.3 - 0.01 <= time.monotonic() - started < 0.3 + MARGIN


def test_final_update_calls_for_unknown_tasks_do_nothing(engine: LeaseEngine) -> None:
    assert engine.begin_final_update("nope") is True
    engine.final_update_failed("nope")
    engine.reported("nope")


def test_final_updates_needs_an_engine(port: FakePort) -> None:
    with pytest.raises(RuntimeError, match="attach"):
        FinalUpdates(port).update(TaskResult("t", "w", TaskStatus.COMPLETED))


# ----- ownership: status, pollCount ----------------------------------------------------------------


def test_a_requeued_task_is_fenced_by_the_ownership_check(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    port.status["t1"] = TaskStatus.SCHEDULED
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.3))
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term - port.checks["t1"][0] < MARGIN


def test_a_task_polled_again_elsewhere_is_fenced_after_the_confirming_check(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given our delivery had pollCount 1 and the server now says 2 (still IN_PROGRESS, same worker id)
    port.poll_count["t1"] = 2
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.3))
    # Then the tree is terminated at the second check, 0.5 s (the grace) after the first
    [(t_term, term)] = fences.wait_for(1, "t1", timeout=10)[:1]
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    first, second = port.checks["t1"][:2]
    assert 0.5 - 0.01 <= second - first < 0.5 + MARGIN
    assert t_term - second < MARGIN


def test_a_redelivery_to_us_is_not_taken_for_a_lost_task(
    engine: LeaseEngine, port: FakePort, fences: Fences
) -> None:
    # Given a running task, delivered to us again with pollCount 2 (the runner tracks it again)
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.2))
    port.poll_count["t1"] = 2
    engine.track(task(1, poll_count=2), policy(30.0, ownership_check_interval_seconds=0.2))
    # When several checks read pollCount 2
    port.wait_for(lambda: len(port.checks["t1"]) >= 5, timeout=10)
    # Then nothing was fenced
    assert fences.of("t1") == []
    assert engine.fence_reason("t1") is None


def _start_one(client: ConductorClient, name: str, **task_def: object) -> str:
    admin = ConductorAdmin(client)
    admin.register_task_defs([{"name": name, "responseTimeoutSeconds": 30, "retryCount": 0, **task_def}])
    admin.register_workflow(
        {
            "name": f"{name}_wf",
            "version": 1,
            "schemaVersion": 2,
            "tasks": [{"name": name, "taskReferenceName": "a", "type": "SIMPLE"}],
        }
    )
    return admin.start_workflow(f"{name}_wf", {})


def test_against_the_embedded_server_a_task_requeued_and_polled_by_another_worker_is_fenced(
    fences: Fences,
) -> None:
    # Given a task we polled (pollCount 1), then re-queued by a bare IN_PROGRESS update and polled by
    # another runner on the same host (same worker id): IN_PROGRESS again, pollCount 2
    with EmbeddedServer() as server, ConductorClient(server.url, timeout_seconds=5) as client:
        _start_one(client, "repoll_demo")
        [ours] = client.poll("repoll_demo", count=1, timeout_ms=1000, worker_id="host")
        client.update(TaskResult(ours.task_id, ours.workflow_id, TaskStatus.IN_PROGRESS))
        assert client.get_task_status(ours.task_id) is TaskStatus.SCHEDULED
        [theirs] = client.poll("repoll_demo", count=1, timeout_ms=1000, worker_id="host")
        assert (ours.poll_count, theirs.poll_count) == (1, 2)
        read = client.get_task_ownership(ours.task_id)
        assert read == TaskOwnership(TaskStatus.IN_PROGRESS, 2, "host")
        engine = LeaseEngine(client, fences, senders=2)
        engine.start()
        try:
            # When we hold our lease with ownership checks
            engine.track(ours, LeasePolicy.from_task(ours, ownership_check_interval_seconds=0.3))
            # Then the tree is fenced: nothing of ours is reported
            [(_, term)] = fences.wait_for(1, ours.task_id, timeout=10)[:1]
            assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
            # And a task re-delivered to us (tracked again) is not
            client.update(TaskResult(theirs.task_id, theirs.workflow_id, TaskStatus.IN_PROGRESS))
            [again] = client.poll("repoll_demo", count=1, timeout_ms=1000, worker_id="host")
            assert again.poll_count == 3
            engine.reported(ours.task_id)
            engine.track(theirs, LeasePolicy.from_task(theirs, ownership_check_interval_seconds=0.3))
            engine.track(again, LeasePolicy.from_task(again, ownership_check_interval_seconds=0.3))
            deadline = time.monotonic() + 2.0
            with fences.cv:
                fences.cv.wait_for(
                    lambda: len(fences.of(again.task_id)) > 1, timeout=deadline - time.monotonic()
                )
            assert len(fences.of(again.task_id)) == 1  # (same task id) only the first lease's TERM
            assert client.get_task_ownership("no-such-task") is None
        finally:
            engine.stop(timeout_seconds=30)


def test_against_the_embedded_server_the_hard_timeout_counts_from_the_first_start(fences: Fences) -> None:
    # Given a server whose clock is far from ours (a fake one, in 2026) and a task with timeoutSeconds
    # 27, polled, re-queued, and polled again 25 s later on the server's clock (startTime is kept)
    server_clock = FakeClock(start=50.0)
    with (
        EmbeddedServer(clock=server_clock) as server,
        ConductorClient(server.url, timeout_seconds=5) as client,
    ):
        _start_one(client, "hard_demo", timeoutSeconds=27, responseTimeoutSeconds=27, timeoutPolicy="RETRY")
        [first] = client.poll("hard_demo", count=1, timeout_ms=0)
        server_clock.advance(25.0)
        client.update(TaskResult(first.task_id, first.workflow_id, TaskStatus.IN_PROGRESS))
        polled_at = time.monotonic()
        [again] = client.poll("hard_demo", count=1, timeout_ms=0)
        assert again.start_time_ms == first.start_time_ms and again.poll_count == 2
        engine = LeaseEngine(client, fences, senders=2)
        engine.start()
        try:
            policy_ = LeasePolicy.from_task(again, ownership_check_interval_seconds=0.0,
                                            kill_grace_seconds=0.5)  # fmt: skip
            assert policy_.hard_elapsed_seconds == pytest.approx(25.0)
            engine.track(again, policy_, polled_at=polled_at)
            # Then the tree is dead 2 s after the second poll (27 s after the first start), not 27 s:
            # TERM at 2 - grace - margin, KILL at 2 - margin
            term_at, kill_at = 2.0 - 0.5 - FENCE_MARGIN_SECONDS, 2.0 - FENCE_MARGIN_SECONDS
            (t_term, term), (t_kill, kill) = fences.wait_for(2, again.task_id, timeout=10)[:2]
            assert term == TerminateTree(FenceReason.HARD_TIMEOUT)
            assert kill == KillTree(FenceReason.HARD_TIMEOUT)
            assert term_at - 0.01 <= t_term - polled_at < term_at + MARGIN
            assert kill_at - 0.01 <= t_kill - polled_at < kill_at + MARGIN
        finally:
            engine.stop(timeout_seconds=30)


def test_a_failing_heartbeat_is_logged_once_per_outage_and_its_recovery_once(
    engine: LeaseEngine, port: FakePort, caplog: pytest.LogCaptureFixture
) -> None:
    # A line per attempt was, with 300 tasks and the server away, 1349 lines in 25 s (a QA pass).
    logger = logging.getLogger("leasecore.runner.engine")
    logger.addHandler(caplog.handler)  # whatever an earlier CLI run in this process did to propagation
    level = logger.level
    logger.setLevel(logging.DEBUG)  # setLevel, not .level =: it clears isEnabledFor's cache
    propagate, logger.propagate = logger.propagate, False  # and each record once
    try:
        port.beat_mode["t1"] = "fail"
        quick = Backoff(initial_seconds=0.05, multiplier=1.0, max_seconds=0.05)
        engine.track(task(1), policy(30.0, retry_backoff=quick), polled_at=time.monotonic() - 23.9)
        with port.cv:
            assert port.cv.wait_for(lambda: len(port.beats["t1"]) >= 4, timeout=10)
        port.beat_mode["t1"] = "ok"
        deadline = time.monotonic() + 10
        while engine.view("t1").consecutive_failures and time.monotonic() < deadline:
            with port.cv:
                port.cv.wait(0.05)  # woken by the next beat
        assert engine.view("t1").consecutive_failures == 0
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "leasecore.runner.engine"]
    failed = [level for level, text in lines if "heartbeat failed" in text]
    assert failed[0] == "WARNING" and set(failed[1:]) == {"DEBUG"} and len(failed) >= 4
    recovered = [(level, text) for level, text in lines if "acknowledged again" in text]
    assert len(recovered) == 1 and recovered[0][0] == "INFO"
    assert recovered[0][1].startswith("task t1: heartbeat acknowledged again after ")


# -- the ownership checks' budget (#23, leasecore.checkbudget) ----------------------------------


def test_ownership_checks_of_many_tasks_stay_within_the_runners_budget(
    port: FakePort, fences: Fences
) -> None:
    # Given 80 tasks each due for a check every 0.2 s (400 a second), and a budget of 40 a second
    engine = LeaseEngine(port, fences, senders=4, max_senders=16, check_budget=CheckBudget(40.0))
    engine.start()
    try:
        t0 = time.monotonic()
        for n in range(80):
            engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.2), polled_at=t0)
        # When 2.5 s pass
        port.wait_for(lambda: all(len(port.checks[f"tc{n}"]) >= 1 for n in range(80)), timeout=10)
        port.wait_for(lambda: time.monotonic() - t0 >= 2.5, timeout=10)  # the cv is notified per check
        with port.cv:
            times = sorted(t for n in range(80) for t in port.checks[f"tc{n}"])
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)
    # Then the checks started no faster than the budget (its one-second burst, then 40 a second),
    # each task was checked in turn (first come, first served), and nothing was fenced
    in_window = [t for t in times if t - t0 <= 2.5]
    assert len(in_window) <= 40 + 40 * 2.5 + 2, len(in_window)
    assert len(in_window) >= 40 * 2.5 * 0.6, len(in_window)  # the budget was used, not starved
    for n in range(80):
        first = port.checks[f"tc{n}"][0] - t0
        assert first <= 80 / 40 + MARGIN, (n, first)  # every task within tasks / rate seconds
    assert fences.calls == []


def test_a_handful_of_tasks_keep_their_check_interval_under_the_budget(
    port: FakePort, fences: Fences
) -> None:
    # Given 3 tasks checked every 0.3 s under a budget of 20 a second (60 tasks' worth)
    engine = LeaseEngine(port, fences, senders=2, max_senders=8, check_budget=CheckBudget(20.0))
    engine.start()
    try:
        t0 = time.monotonic()
        for n in range(3):
            engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.3), polled_at=t0)
        port.wait_for(lambda: all(len(port.checks[f"tc{n}"]) >= 5 for n in range(3)), timeout=10)
        # When the server cancels one of them
        with port.cv:
            port.status["tc1"] = TaskStatus.CANCELED
            cancelled_at = time.monotonic()
        [(t_term, term)] = fences.wait_for(1, "tc1", timeout=10)[:1]
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)
    # Then each was checked every ~0.3 s, and the cancellation was seen within one interval
    for n in range(3):
        gaps = [b - a for a, b in itertools.pairwise(port.checks[f"tc{n}"][:5])]
        assert max(gaps) < 0.3 + MARGIN, gaps
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term - cancelled_at < 0.3 + MARGIN


def test_a_check_held_by_the_budget_is_bounded_by_the_lease_as_it_is_when_it_starts(
    port: FakePort, fences: Fences
) -> None:
    # Given a budget of one check a second and 4 tasks due at once (R = 30 s, heartbeats working)
    engine = LeaseEngine(port, fences, senders=2, max_senders=8, check_budget=CheckBudget(1.0))
    engine.start()
    try:
        t0 = time.monotonic()
        for n in range(4):
            engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.1), polled_at=t0)
        # When they wait their turn
        port.wait_for(lambda: sum(len(port.checks[f"tc{n}"]) for n in range(4)) >= 3, timeout=10)
        checks = sorted(t for n in range(4) for t in port.checks[f"tc{n}"])
    finally:
        port.release.set()
        engine.stop(timeout_seconds=30)
    # Then they went one a second, each a real call (none given up as too late)
    assert [round(b - a) for a, b in itertools.pairwise(checks[:3])] == [1, 1]
    assert fences.calls == []
