"""A task's lease lives per delivery: a yield re-queued at once and polled back by the same runner
while its final update is in flight gets a new lease; the old run's end never drops it.

The engine is driven on a FakeClock and never started (no threads, no sleeps): only its bookkeeping
(which lease is tracked, which is retired) is under test; the pure rule is ``Lease.is_new_delivery``.
"""

from __future__ import annotations

from leasecore.clock import FakeClock
from leasecore.lease import FenceAction, Lease, LeasePolicy, LeaseState
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import FinalUpdates

T0 = 1000.0


def policy() -> LeasePolicy:
    return LeasePolicy(response_timeout_seconds=10.0, ownership_check_interval_seconds=0.0,
                       kill_grace_seconds=0.0, fence_margin_seconds=0.0)  # fmt: skip


def task(poll_count: int) -> Task:
    return Task(task_id="t1", workflow_id="w1", task_type="demo", response_timeout_seconds=10,
                poll_count=poll_count)  # fmt: skip


class NoPort:
    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        raise AssertionError("the engine is not started: nothing is sent")

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> None:
        raise AssertionError("the engine is not started: nothing is sent")


def engine() -> tuple[LeaseEngine, FakeClock]:
    clock = FakeClock(start=T0)
    fences: list[tuple[str, FenceAction]] = []
    return LeaseEngine(NoPort(), lambda tid, action: fences.append((tid, action)), clock=clock), clock


def yielded(eng: LeaseEngine, clock: FakeClock, *, poll_count: int = 1) -> None:
    """Run ``t1`` (delivery ``poll_count``) to its final update: an IN_PROGRESS is being sent."""
    eng.track(task(poll_count), policy(), polled_at=clock.monotonic())
    eng.child_started("t1")
    clock.advance(1.0)
    eng.child_exited("t1")
    assert eng.begin_final_update("t1") is True


# ----- the pure rule ------------------------------------------------------------------------------


def test_a_newer_poll_is_a_new_delivery_only_once_the_final_update_is_sent() -> None:
    lease = Lease(policy(), T0, poll_count=1)
    assert not lease.is_new_delivery(2)  # running: a re-delivery of the same run
    lease.on_child_exited(T0 + 1)
    assert not lease.is_new_delivery(2)  # the result is not sent yet
    lease.on_final_update_started(T0 + 1)
    assert lease.is_new_delivery(2)
    assert not lease.is_new_delivery(1)  # the same poll again: never a new run
    lease.on_final_update_failed(T0 + 2)
    assert not lease.is_new_delivery(2)  # beating again until the retry: still this run's lease
    lease.on_final_update_started(T0 + 3)
    lease.on_reported(T0 + 3)
    assert not lease.is_new_delivery(2)  # over: the engine forgot it anyway


def test_an_unknown_poll_count_is_never_taken_for_a_new_delivery() -> None:
    lease = Lease(policy(), T0, poll_count=0)
    lease.on_final_update_started(T0)
    assert not lease.is_new_delivery(5)


# ----- the engine ---------------------------------------------------------------------------------


def test_a_repoll_during_the_yields_update_gets_its_own_lease_which_the_old_run_never_drops() -> None:
    eng, clock = engine()
    yielded(eng, clock)
    clock.advance(0.5)
    repolled_at = clock.monotonic()
    eng.track(task(2), policy(), polled_at=repolled_at)  # the poller, before the update's ack
    assert eng.retired() == ["t1"]
    view = eng.views()["t1"]
    assert view.polled_at == repolled_at and view.state is LeaseState.RUNNING
    assert view.next_heartbeat_at == repolled_at + 8.0  # heartbeated from its own poll
    eng.final_update_failed("t1")  # the old update's calls reach the retired lease only
    assert eng.begin_final_update("t1") is True
    assert eng.views()["t1"].next_heartbeat_at == repolled_at + 8.0
    eng.reported("t1")  # FinalUpdates: the yield's update acknowledged
    assert eng.retired() == [] and eng.views()["t1"].polled_at == repolled_at
    eng.reported("t1", poll_count=1)  # the runner forgets the old run
    assert eng.views()["t1"].polled_at == repolled_at
    eng.reported("t1", poll_count=2)  # the new run ends
    assert eng.views() == {}


def test_a_repoll_after_the_ack_is_a_new_lease_the_old_runs_end_leaves_alone() -> None:
    eng, clock = engine()
    yielded(eng, clock)
    eng.reported("t1")  # acknowledged first ...
    eng.track(task(2), policy(), polled_at=clock.monotonic())  # ... then polled back
    eng.reported("t1", poll_count=1)  # the report-done event, processed after the poll
    assert list(eng.views()) == ["t1"] and eng.retired() == []
    assert eng.fence_reason("t1") is None


def test_a_redelivery_while_running_keeps_the_one_lease() -> None:
    eng, clock = engine()
    eng.track(task(1), policy(), polled_at=T0)
    eng.child_started("t1")
    clock.advance(2.0)
    eng.track(task(2), policy(), polled_at=clock.monotonic())
    assert eng.retired() == [] and eng.views()["t1"].polled_at == T0  # the same lease, acked
    eng.reported("t1", poll_count=2)  # the runner's newest pollCount of this run
    assert eng.views() == {}


def test_the_same_poll_again_during_the_final_update_is_no_new_run() -> None:
    eng, clock = engine()
    yielded(eng, clock)
    eng.track(task(1), policy(), polled_at=clock.monotonic())
    assert eng.retired() == []
    eng.reported("t1")
    assert eng.views() == {}


def test_fence_reason_of_an_unknown_task_is_none_not_a_crash() -> None:
    eng, _ = engine()
    assert eng.fence_reason("nobody") is None


class _RepollingPort:
    """An update whose acknowledgement the runner sees only after its poller re-polled the task."""

    def __init__(self) -> None:
        self.engine: LeaseEngine | None = None

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        assert self.engine is not None
        self.engine.track(task(2), policy())


def test_final_updates_of_a_yield_repolled_in_flight_leave_the_next_runs_lease() -> None:
    eng, _ = engine()
    port = _RepollingPort()
    port.engine = eng
    updates = FinalUpdates(port, eng)
    eng.track(task(1), policy(), polled_at=T0)
    eng.child_exited("t1")
    updates.update(TaskResult("t1", "w1", TaskStatus.IN_PROGRESS))
    assert list(eng.views()) == ["t1"] and eng.retired() == []
    assert eng.views()["t1"].state is LeaseState.RUNNING
