"""The lease engine, stepped: a FakeClock, ``InlineSenders`` and ``run_due``, so no thread and no wait.

Every request is carried out in the test's own thread when the engine's wake-up comes due
(``engine_support.run_until`` / ``step_until`` move the clock from one wake-up to the next), so the
times asserted are exact: the TERM at the TERM point, not "within half a second of it". A scripted
``FakePort`` answers (a hanging server moves the fake clock on by the call's timeout); two tests run
the engine against the embedded server over real HTTP. What needs real concurrency (the sender pool,
a call in flight, lateness under load) is in ``test_lease_engine_threads.py``.
"""

from __future__ import annotations

import itertools
import logging

import pytest

from leasecore.backoff import Backoff
from leasecore.checkbudget import CheckBudget
from leasecore.clock import FakeClock
from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.lease import (
    FENCE_MARGIN_SECONDS,
    FenceAction,
    FenceReason,
    KillTree,
    LeasePolicy,
    LeaseState,
    TerminateTree,
)
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.runner.leasing.senders import InlineSenders
from leasecore.server import EmbeddedServer
from tests.adapters.engine_support import T0, FakePort, Fences, policy, run_until, step_until, task

EXACT = 1e-6  # seconds: stepped, the engine acts at the very wake-up time


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start=T0)


@pytest.fixture
def port(clock: FakeClock) -> FakePort:
    return FakePort(clock)


@pytest.fixture
def fences(clock: FakeClock) -> Fences:
    return Fences(clock)


def stepped(port: FakePort, fences: Fences, clock: FakeClock, **kwargs: object) -> LeaseEngine:
    """An engine that carries its requests out in the test's thread (a pool of 16 at most)."""
    senders = kwargs.pop("executor", None) or InlineSenders(capacity=16)
    return LeaseEngine(port, fences, clock=clock, executor=senders, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def engine(port: FakePort, fences: Fences, clock: FakeClock) -> LeaseEngine:
    return stepped(port, fences, clock)


# ----- heartbeats and the lease deadline ---------------------------------------------------------


def test_failing_heartbeats_fence_at_the_term_point_and_kill_before_the_deadline(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given a task (R=3 s, grace 0.5 s, margin 0.2 s: TERM point 2.3 s) whose server is down
    port.beat_mode["t1"] = "fail"
    engine.track(task(1), policy(3.0, kill_grace_seconds=0.5, fence_margin_seconds=0.2), polled_at=T0)
    # When the lease runs out
    run_until(engine, clock, T0 + 3.0)
    # Then: beat at 1.84 s, one retry 0.25 s later (the backoff's 1 s would be past the TERM point);
    # TERM at 2.3 s, KILL at 2.8 s, before the server's deadline at 3 s
    assert [t - T0 for t in port.beats["t1"]] == pytest.approx([1.84, 2.09], abs=EXACT)
    (t_term, term), (t_kill, kill) = fences.of("t1")
    assert term == TerminateTree(FenceReason.LEASE_EXPIRED) and kill == KillTree(FenceReason.LEASE_EXPIRED)
    assert t_term - T0 == pytest.approx(2.3, abs=EXACT)
    assert t_kill - T0 == pytest.approx(2.8, abs=EXACT)
    assert engine.view("t1").consecutive_failures == 2
    assert engine.fence_reason("t1") is FenceReason.LEASE_EXPIRED


def test_a_hanging_server_is_timed_out_by_the_client_and_retried(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given R=10 s: the beat at 7.84 s gets (about) 2 s, what is left to the TERM point at 9.8 s, and
    # the server never answers (the call takes its whole timeout)
    port.beat_mode["t1"] = "hang"
    engine.track(task(1), policy(10.0, kill_grace_seconds=0.2), polled_at=T0 - 7.5)  # first beat in 0.34 s
    # When the lease runs out
    run_until(engine, clock, T0 + 3.0)
    # Then the first attempt had (about) 2 s, a retry only what was left, and the lease was fenced
    timeouts = port.beat_timeouts["t1"]
    assert len(timeouts) == 1 or timeouts[1] < timeouts[0]
    assert timeouts[0] == pytest.approx(2.0, abs=0.1)
    assert [a for _, a in fences.of("t1")][:1] == [TerminateTree(FenceReason.LEASE_EXPIRED)]


def test_a_404_on_a_heartbeat_fences_for_ownership_lost_at_once(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    port.beat_mode["t1"] = "404"
    engine.track(task(1), policy(2.0), polled_at=T0)
    run_until(engine, clock, T0 + 1.9)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term == pytest.approx(port.beats["t1"][0], abs=EXACT)  # at the 404, not later
    assert engine.fence_reason("t1") is FenceReason.OWNERSHIP_LOST


def test_after_reported_no_more_heartbeats(engine: LeaseEngine, port: FakePort, clock: FakeClock) -> None:
    # Given a task that beat once, then exited and was reported (R=1.5 s: a beat every 1.2 s)
    engine.track(task(1), policy(1.5), polled_at=T0 - 1.1)  # first beat in 0.1 s
    engine.track(task(2), policy(1.5), polled_at=T0 - 1.1)
    step_until(engine, clock, lambda: len(port.beats["t1"]) >= 1, within_seconds=1)
    engine.child_exited("t1")
    engine.reported("t1")
    # When another task beats twice more (t1's next beat would have been due in between)
    step_until(engine, clock, lambda: len(port.beats["t2"]) >= 3, within_seconds=10)
    # Then t1 got no further beat, and the engine forgot it
    assert len(port.beats["t1"]) == 1
    with pytest.raises(KeyError):
        engine.view("t1")


def test_heartbeats_continue_after_the_child_exits_until_reported(
    engine: LeaseEngine, port: FakePort, clock: FakeClock
) -> None:
    engine.track(task(1), policy(1.5), polled_at=T0)
    engine.child_exited("t1")
    run_until(engine, clock, T0 + 2.5)
    assert [t - T0 for t in port.beats["t1"]] == pytest.approx([1.2, 2.4], abs=EXACT)
    assert engine.view("t1").state is LeaseState.REPORTING


def test_a_redelivered_task_keeps_its_lease_and_the_poll_counts_as_an_ack(engine: LeaseEngine) -> None:
    engine.track(task(1), policy(30.0), polled_at=T0 - 5)
    engine.track(task(1), policy(30.0), polled_at=T0)
    view = engine.view("t1")
    assert view.polled_at == T0 - 5
    assert view.lease_deadline == pytest.approx(T0 + 30)


def test_lease_times_are_the_views_fence_and_deadlines_in_one_look(
    engine: LeaseEngine, port: FakePort, clock: FakeClock
) -> None:
    # What the runner's loop asks at admission, start and exit instead of fence_reason + view.
    assert engine.lease_times("t1") is None  # not tracked
    port.beat_mode["t1"] = "fail"
    engine.track(task(1), policy(2.0, hard_timeout_seconds=30.0), polled_at=T0)

    def from_view() -> tuple[FenceReason | None, float | None, float | None]:
        view = engine.view("t1")
        return view.fence_reason, view.lease_deadline, view.hard_deadline

    assert engine.lease_times("t1") == from_view() == (None, pytest.approx(T0 + 2), pytest.approx(T0 + 30))
    run_until(engine, clock, T0 + 2.5)  # no beat acked: fenced at its TERM point
    assert engine.lease_times("t1") == from_view()
    assert from_view()[0] is FenceReason.LEASE_EXPIRED
    assert engine.child_exited("t1") is FenceReason.LEASE_EXPIRED  # its fence, as fence_reason says
    assert engine.fence_reason("t1") is FenceReason.LEASE_EXPIRED
    engine.reported("t1")
    assert engine.lease_times("t1") is None
    assert engine.child_exited("t1") is None  # no longer tracked


def test_child_exited_answers_none_for_a_lease_not_fenced(engine: LeaseEngine) -> None:
    engine.track(task(1), policy(30.0), polled_at=T0)
    assert engine.child_exited("t1") is None
    assert engine.view("t1").state is LeaseState.REPORTING


def test_a_failing_heartbeat_is_logged_once_per_outage_and_its_recovery_once(
    engine: LeaseEngine, port: FakePort, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    # A line per attempt was, with 300 tasks and the server away, 1349 lines in 25 s (a QA pass).
    logger = logging.getLogger("leasecore.runner.leasing.engine")
    logger.addHandler(caplog.handler)  # whatever an earlier CLI run in this process did to propagation
    level = logger.level
    logger.setLevel(logging.DEBUG)  # setLevel, not .level =: it clears isEnabledFor's cache
    propagate, logger.propagate = logger.propagate, False  # and each record once
    try:
        port.beat_mode["t1"] = "fail"
        quick = Backoff(initial_seconds=0.05, multiplier=1.0, max_seconds=0.05)
        engine.track(task(1), policy(30.0, retry_backoff=quick), polled_at=T0 - 23.9)
        step_until(engine, clock, lambda: len(port.beats["t1"]) >= 4, within_seconds=10)
        port.beat_mode["t1"] = "ok"
        step_until(engine, clock, lambda: engine.view("t1").consecutive_failures == 0, within_seconds=10)
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate
    lines = [(r.levelname, r.getMessage()) for r in caplog.records
             if r.name == "leasecore.runner.leasing.engine"]
    failed = [level for level, text in lines if "heartbeat failed" in text]
    assert failed[0] == "WARNING" and set(failed[1:]) == {"DEBUG"} and len(failed) >= 4
    recovered = [(level, text) for level, text in lines if "acknowledged again" in text]
    assert len(recovered) == 1 and recovered[0][0] == "INFO"
    assert recovered[0][1].startswith("task t1: heartbeat acknowledged again after ")


# ----- our own deadlines: shutdown, drain, exec timeout ------------------------------------------


def test_shutdown_terminates_now_and_a_forced_shutdown_kills(engine: LeaseEngine, fences: Fences) -> None:
    engine.track(task(1), policy(30.0, kill_grace_seconds=20.0))
    engine.track(task(2), policy(30.0, kill_grace_seconds=20.0))
    engine.shutdown(None)
    assert [a for _, a in fences.of("t1")] == [TerminateTree(FenceReason.SHUTDOWN)]
    engine.shutdown(None, force=True)
    assert [a for _, a in fences.of("t2")] == [
        TerminateTree(FenceReason.SHUTDOWN),
        KillTree(FenceReason.SHUTDOWN),
    ]


def test_a_drain_fences_at_the_drain_deadline(engine: LeaseEngine, fences: Fences, clock: FakeClock) -> None:
    engine.track(task(1), policy(30.0))
    engine.shutdown("t1", drain_deadline=T0 + 0.5)
    run_until(engine, clock, T0 + 0.49)
    assert fences.of("t1") == []  # still draining, still beating
    run_until(engine, clock, T0 + 1.0)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.SHUTDOWN)
    assert t_term - T0 == pytest.approx(0.5, abs=EXACT)


def test_the_exec_timeout_counts_from_child_started(
    engine: LeaseEngine, fences: Fences, clock: FakeClock
) -> None:
    engine.track(task(1), policy(30.0, exec_timeout_seconds=0.6))
    clock.advance(0.25)  # the child starts a while after the poll
    started = clock.monotonic()
    engine.child_started("t1")
    run_until(engine, clock, started + 1.0)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.EXEC_TIMEOUT)
    assert t_term - started == pytest.approx(0.6, abs=EXACT)


def test_an_on_fence_that_raises_does_not_stop_the_engine(port: FakePort, clock: FakeClock) -> None:
    # Given a runner callback that fails for t1
    seen: list[str] = []

    def on_fence(task_id: str, action: FenceAction) -> None:
        seen.append(task_id)
        if task_id == "t1":
            raise RuntimeError("runner bug")

    engine = LeaseEngine(port, on_fence, clock=clock, executor=InlineSenders())
    engine.track(task(1), policy(30.0, lease_extend_enabled=False, heartbeat_timeout_seconds=0.2))
    engine.track(task(2), policy(30.0, lease_extend_enabled=False, heartbeat_timeout_seconds=0.4))
    # Then t2 is still fenced after t1's callback blew up
    run_until(engine, clock, T0 + 1.0)
    assert seen[0] == "t1" and "t2" in seen


# ----- the final update excludes heartbeats ------------------------------------------------------


def test_a_queued_heartbeat_is_withdrawn_and_sent_only_if_the_update_fails(
    port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given a pool busy elsewhere (held), and t1's beat waiting in the queue
    senders = InlineSenders(capacity=1, hold=True)
    engine = stepped(port, fences, clock, executor=senders)
    engine.track(task(1), policy(30.0), polled_at=T0 - 24)  # its beat is due at once
    assert engine.metrics().queued == 1
    assert engine.view("t1").heartbeat_in_flight
    # When t1's final update begins, then the pool is free again
    assert engine.begin_final_update("t1") is True
    view = engine.view("t1")
    assert (engine.metrics().queued, view.heartbeat_in_flight, view.consecutive_failures) == (0, False, 0)
    senders.hold = False
    run_until(engine, clock, T0 + 1.0)
    assert port.beats["t1"] == []
    # And when the update fails, the overdue beat goes out at once
    engine.final_update_failed("t1")
    engine.run_due()
    assert port.beats["t1"] == [T0 + 1.0]


def test_final_update_calls_for_unknown_tasks_do_nothing(engine: LeaseEngine) -> None:
    assert engine.begin_final_update("nope") is True
    engine.final_update_failed("nope")
    engine.reported("nope")


def test_final_updates_needs_an_engine(port: FakePort) -> None:
    with pytest.raises(RuntimeError, match="attach"):
        FinalUpdates(port).update(TaskResult("t", "w", TaskStatus.COMPLETED))


def test_a_free_sender_takes_heartbeats_before_ownership_checks(
    port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given one sender, busy elsewhere, and an ownership check queued before two heartbeats
    senders = InlineSenders(capacity=1, hold=True)
    engine = stepped(port, fences, clock, executor=senders)
    engine.track(task("c"), policy(30.0, ownership_check_interval_seconds=5.0), polled_at=T0 - 5)
    engine.track(task(1), policy(30.0), polled_at=T0 - 24)
    engine.track(task(2), policy(30.0), polled_at=T0 - 24)
    assert engine.metrics().queued == 3
    # When the sender is free again
    assert senders.run_next() and senders.run_next() and senders.run_next()
    # Then both heartbeats went out before the check that had waited longer
    assert port.order == [("beat-start", "t1"), ("beat-end", "t1"), ("beat-start", "t2"), ("beat-end", "t2"),
                          ("check", "tc")]  # fmt: skip


# ----- ownership: status, pollCount --------------------------------------------------------------


def test_a_cancelled_task_is_fenced_by_the_ownership_check(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given checks every 0.3 s and a task the server reports as CANCELED (its heartbeats still "work")
    port.status["t1"] = TaskStatus.CANCELED
    engine.track(task(1), policy(30.0, ownership_check_interval_seconds=0.3))
    # Then it is terminated right at the first check
    run_until(engine, clock, T0 + 1.0)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term == pytest.approx(port.checks["t1"][0], abs=EXACT) == pytest.approx(T0 + 0.3)


def test_a_requeued_task_is_fenced_by_the_ownership_check(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    port.status["t1"] = TaskStatus.SCHEDULED
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.3))
    run_until(engine, clock, T0 + 1.0)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term == pytest.approx(port.checks["t1"][0], abs=EXACT)


def test_a_task_polled_again_elsewhere_is_fenced_after_the_confirming_check(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given our delivery had pollCount 1 and the server now says 2 (still IN_PROGRESS, same worker id)
    port.poll_count["t1"] = 2
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.3))
    # Then the tree is terminated at the second check, 0.5 s (the grace) after the first
    run_until(engine, clock, T0 + 2.0)
    [(t_term, term)] = fences.of("t1")[:1]  # (no grace: its KILL follows at once)
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    first, second = port.checks["t1"][:2]
    assert second - first == pytest.approx(0.5, abs=EXACT)
    assert t_term == pytest.approx(second, abs=EXACT)


def test_a_redelivery_to_us_is_not_taken_for_a_lost_task(
    engine: LeaseEngine, port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given a running task, delivered to us again with pollCount 2 (the runner tracks it again)
    engine.track(task(1, poll_count=1), policy(30.0, ownership_check_interval_seconds=0.2))
    port.poll_count["t1"] = 2
    engine.track(task(1, poll_count=2), policy(30.0, ownership_check_interval_seconds=0.2))
    # When several checks read pollCount 2
    step_until(engine, clock, lambda: len(port.checks["t1"]) >= 5, within_seconds=5)
    # Then nothing was fenced
    assert fences.of("t1") == []
    assert engine.fence_reason("t1") is None


class CountedChecks:
    """A client's lease calls, with its ownership checks counted."""

    def __init__(self, client: ConductorClient) -> None:
        self.client, self.checks = client, 0

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        self.client.extend_lease(task_id, workflow_id, timeout_seconds=timeout_seconds)

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self.checks += 1
        return self.client.get_task_ownership(task_id, timeout_seconds=timeout_seconds)


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
    fences: Fences, clock: FakeClock
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
        # (the engine runs stepped on its own fake clock; its checks are real GETs)
        counted = CountedChecks(client)
        engine = LeaseEngine(counted, fences, clock=clock, executor=InlineSenders())
        # When we hold our lease with ownership checks
        engine.track(ours, LeasePolicy.from_task(ours, ownership_check_interval_seconds=0.3))
        # Then the tree is fenced after the confirming check: nothing of ours is reported
        run_until(engine, clock, T0 + 1.0)
        [(_, term)] = fences.of(ours.task_id)
        assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
        # And a task re-delivered to us (tracked again) is not
        client.update(TaskResult(theirs.task_id, theirs.workflow_id, TaskStatus.IN_PROGRESS))
        [again] = client.poll("repoll_demo", count=1, timeout_ms=1000, worker_id="host")
        assert again.poll_count == 3
        engine.reported(ours.task_id)
        engine.track(theirs, LeasePolicy.from_task(theirs, ownership_check_interval_seconds=0.3))
        engine.track(again, LeasePolicy.from_task(again, ownership_check_interval_seconds=0.3))
        checks_before = counted.checks
        run_until(engine, clock, clock.monotonic() + 2.0)  # six more checks, each reading pollCount 3
        assert len(fences.of(again.task_id)) == 1  # (same task id) only the first lease's TERM
        assert counted.checks - checks_before >= 5
        assert client.get_task_ownership("no-such-task") is None


def test_against_the_embedded_server_the_hard_timeout_counts_from_the_first_start(
    fences: Fences, clock: FakeClock
) -> None:
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
        polled_at = clock.monotonic()
        [again] = client.poll("hard_demo", count=1, timeout_ms=0)
        assert again.start_time_ms == first.start_time_ms and again.poll_count == 2
        engine = LeaseEngine(client, fences, clock=clock, executor=InlineSenders())
        policy_ = LeasePolicy.from_task(again, ownership_check_interval_seconds=0.0,
                                        kill_grace_seconds=0.5)  # fmt: skip
        assert policy_.hard_elapsed_seconds == pytest.approx(25.0)
        engine.track(again, policy_, polled_at=polled_at)
        # Then the tree is dead 2 s after the second poll (27 s after the first start), not 27 s:
        # TERM at 2 - grace - margin, KILL at 2 - margin
        run_until(engine, clock, polled_at + 3.0)
        term_at, kill_at = 2.0 - 0.5 - FENCE_MARGIN_SECONDS, 2.0 - FENCE_MARGIN_SECONDS
        (t_term, term), (t_kill, kill) = fences.of(again.task_id)[:2]
        assert term == TerminateTree(FenceReason.HARD_TIMEOUT)
        assert kill == KillTree(FenceReason.HARD_TIMEOUT)
        assert t_term - polled_at == pytest.approx(term_at, abs=EXACT)
        assert t_kill - polled_at == pytest.approx(kill_at, abs=EXACT)


# -- the ownership checks' budget (leasecore.checkbudget) ---------------------------------------


def test_ownership_checks_of_many_tasks_stay_within_the_runners_budget(
    port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given 80 tasks each due for a check every 0.2 s (400 a second), and a budget of 40 a second
    engine = stepped(port, fences, clock, check_budget=CheckBudget(40.0))
    for n in range(80):
        engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.2), polled_at=T0)
    # When 2.5 s pass
    run_until(engine, clock, T0 + 2.5)
    times = sorted(t for n in range(80) for t in port.checks[f"tc{n}"])
    # Then the checks started no faster than the budget (its one-second burst, then 40 a second),
    # each task was checked in turn (first come, first served), and nothing was fenced
    in_window = [t for t in times if t - T0 <= 2.5]
    assert len(in_window) <= 40 + 40 * 2.5 + 2, len(in_window)
    assert len(in_window) >= 40 * 2.5 * 0.6, len(in_window)  # the budget was used, not starved
    for n in range(80):
        first = port.checks[f"tc{n}"][0] - T0
        assert first <= 80 / 40 + 0.2 + EXACT, (n, first)  # every task within tasks / rate seconds
    assert fences.calls == []


def test_a_handful_of_tasks_keep_their_check_interval_under_the_budget(
    port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given 3 tasks checked every 0.3 s under a budget of 20 a second (60 tasks' worth)
    engine = stepped(port, fences, clock, check_budget=CheckBudget(20.0))
    for n in range(3):
        engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.3), polled_at=T0)
    five_each = lambda: all(len(port.checks[f"tc{n}"]) >= 5 for n in range(3))  # noqa: E731
    step_until(engine, clock, five_each, within_seconds=5)
    # When the server cancels one of them
    port.status["tc1"] = TaskStatus.CANCELED
    cancelled_at = clock.monotonic()
    step_until(engine, clock, lambda: bool(fences.of("tc1")), within_seconds=5)
    [(t_term, term)] = fences.of("tc1")[:1]
    # Then each was checked every 0.3 s, and the cancellation was seen within one interval
    for n in range(3):
        gaps = [b - a for a, b in itertools.pairwise(port.checks[f"tc{n}"][:5])]
        assert gaps == pytest.approx([0.3] * 4, abs=EXACT)
    assert term == TerminateTree(FenceReason.OWNERSHIP_LOST)
    assert t_term - cancelled_at <= 0.3 + EXACT


def test_a_check_held_by_the_budget_is_bounded_by_the_lease_as_it_is_when_it_starts(
    port: FakePort, fences: Fences, clock: FakeClock
) -> None:
    # Given a budget of one check a second and 4 tasks due at once (R = 30 s, heartbeats working)
    engine = stepped(port, fences, clock, check_budget=CheckBudget(1.0))
    for n in range(4):
        engine.track(task(f"c{n}"), policy(30.0, ownership_check_interval_seconds=0.1), polled_at=T0)
    # When they wait their turn
    three = lambda: sum(len(port.checks[f"tc{n}"]) for n in range(4)) >= 3  # noqa: E731
    step_until(engine, clock, three, within_seconds=10)
    checks = sorted(t for n in range(4) for t in port.checks[f"tc{n}"])
    # Then they went one a second, each a real call (none given up as too late)
    assert [b - a for a, b in itertools.pairwise(checks[:3])] == pytest.approx([1.0, 1.0], abs=EXACT)
    assert fences.calls == []


def test_a_stepped_engine_refuses_to_start(engine: LeaseEngine) -> None:
    # InlineSenders carry requests out only when run_due asks: a timer thread would fire leases
    # whose heartbeats nobody sends.
    with pytest.raises(RuntimeError, match="run_due"):
        engine.start()
    assert not engine.alive()
