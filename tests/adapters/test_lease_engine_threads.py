"""The lease engine on real threads and the real clock: what only concurrency can show.

The sender pool (a hanging call never delays the other leases, checks never take the senders a
heartbeat needs, a saturated pool shows in the metrics, stop joins every thread), a heartbeat call in
flight against a final update, the lateness of 1000 leases, and heartbeats against the embedded server.
Everything else about the engine runs stepped on a FakeClock (``test_lease_engine.py``).

Timing assertions carry generous margins (the machine is a loaded 2-core box): the goal is well under
100 ms, the assertions allow several hundred. Waits are condition waits with deadlines, never sleeps.
"""

from __future__ import annotations

import queue
import random
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.lease import FenceReason, KillTree, LeasePolicy, TerminateTree
from leasecore.models import TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.server import EmbeddedServer
from tests.adapters.engine_support import FakePort, Fences, lateness, policy, task

MARGIN = 0.5  # seconds: what "on time" may be off by on a loaded machine


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


def test_the_wait_for_a_heartbeat_that_ignores_its_timeout_is_bounded(
    engine: LeaseEngine, port: FakePort
) -> None:
    port.beat_mode["t1"] = "stuck"
    engine.track(task(1), policy(30.0), polled_at=time.monotonic() - 24)
    port.wait_for(lambda: len(port.beats["t1"]) == 1, timeout=10)
    started = time.monotonic()
    assert engine.begin_final_update("t1", timeout_seconds=0.3) is False
    assert 0.3 - 0.01 <= time.monotonic() - started < 0.3 + MARGIN
