"""The runner's chaining with an in-memory Conductor that has update-v2, a recording lease engine and
real children: a claimed task's lease starts at the update's send time; the work budget bounds the
claims (--max-tasks N starts N, however many final updates could claim)."""

from __future__ import annotations

import threading
import time
from typing import Any

from leasecore.lease import LeasePolicy
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import PollSettings, RunOptions, TaskTypePlan
from leasecore.runner.upstream.reporter import Reporter
from tests.integration.runner_fakes import (
    FakeConductor,
    FakeEngine,
    FakeSupervisor,
    make_task,
    python_spec,
    to_result,
)


class ChainingConductor(FakeConductor):
    """update_v2: the update, then (terminal) the next queued task of the same type; slow to answer."""

    def __init__(self, delay_seconds: float = 0.0) -> None:
        super().__init__()
        self.delay = delay_seconds
        self.v2_sent: list[tuple[str, float]] = []  # (task id, monotonic time the call came in)
        self.claimed: list[str] = []

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        self.v2_sent.append((result.task_id, time.monotonic()))
        self.update(result, timeout_seconds=timeout_seconds)
        time.sleep(self.delay)  # the server's decide and claim: the lease must not count from here
        if result.status is TaskStatus.IN_PROGRESS:
            return None
        with self._cond:
            waiting = self.queued.get("t", [])
            if not waiting:
                return None
            task = waiting.pop(0)
            self.claimed.append(task.task_id)
            return task


class TrackingEngine(FakeEngine):
    polled_at: dict[str, float]

    def track(self, task: Task, policy: LeasePolicy, *, polled_at: float | None = None) -> None:
        super().track(task, policy, polled_at=polled_at)
        with self.lock:
            self.polled_at[task.task_id] = polled_at if polled_at is not None else time.monotonic()


def run(conductor: ChainingConductor, options: RunOptions, concurrency: int = 1) -> Any:
    supervisor = FakeSupervisor()

    def make_engine(on_fence):  # type: ignore[no-untyped-def]
        engine = TrackingEngine(on_fence)
        engine.polled_at = {}
        return engine

    plan = TaskTypePlan(poll=PollSettings("t", concurrency=concurrency, timeout_ms=200, worker_id="w1"),
                        spec=python_spec("print('ok')"), worker_id="w1", kill_grace_seconds=1.0,
                        make_policy=lambda task: LeasePolicy(response_timeout_seconds=30))
    runner = Runner([plan], conductor=conductor, make_engine=make_engine, supervisor=supervisor,
                    to_result=to_result, options=options,
                    reporter=lambda updates, done: Reporter(updates, done, backoff_cap_seconds=0.2))
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(runner.run(install_signal_handlers=False)),
                              daemon=True)
    thread.start()
    return runner, thread, result, supervisor


def finish(handle: Any, timeout: float = 60.0) -> Any:
    _runner, thread, result, supervisor = handle
    thread.join(timeout)
    try:
        assert not thread.is_alive(), "the runner did not stop"
        return result[0]
    finally:
        supervisor.close()


def test_a_claimed_tasks_lease_counts_from_the_updates_send_time() -> None:
    conductor = ChainingConductor(delay_seconds=0.3)
    conductor.add(make_task("a"), make_task("b"))
    handle = run(conductor, RunOptions(max_tasks=2))
    outcome = finish(handle)
    runner = handle[0]
    engine = runner._engine  # the runner's own (a TrackingEngine)
    assert outcome.statuses == (TaskStatus.COMPLETED, TaskStatus.COMPLETED)
    assert conductor.claimed == ["b"]  # a's final update claimed b
    (sent_task, entered), *_ = conductor.v2_sent
    assert sent_task == "a"
    # Sent before the call came in, not when its (0.3 s later) answer did.
    assert engine.polled_at["b"] <= entered < engine.polled_at["b"] + 0.3


def test_the_work_budget_bounds_what_final_updates_claim() -> None:
    conductor = ChainingConductor()
    conductor.add(*(make_task(f"t{i}") for i in range(6)))
    handle = run(conductor, RunOptions(max_tasks=3), concurrency=2)
    outcome = finish(handle)
    assert outcome.started == 3 and set(outcome.statuses) == {TaskStatus.COMPLETED}
    started = set(conductor.statuses())
    assert len(started) == 3 and not set(conductor.claimed) - started  # nothing claimed that did not run
    assert len(conductor.queued["t"]) == 3  # the rest was never claimed


def test_update_v2_off_means_every_final_update_is_v1() -> None:
    conductor = ChainingConductor()
    conductor.add(make_task("a"), make_task("b"))
    outcome = finish(run(conductor, RunOptions(max_tasks=2, update_v2=False)))
    assert outcome.statuses == (TaskStatus.COMPLETED, TaskStatus.COMPLETED)
    assert conductor.v2_sent == [] and conductor.claimed == []  # both polled, both reported with v1
