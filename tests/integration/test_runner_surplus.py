"""A poll answered with more tasks than asked: every claimed task is run or handed back, never dropped
(review: ``tasks[:count]`` silently dropped the rest, which the server counted as ours until R).

The poller alone with a scripted port, then the runner with an in-memory Conductor and real children.
"""

from __future__ import annotations

import threading

import pytest

from leasecore.handover import YIELD_MARKER
from leasecore.lease import LeasePolicy
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import PollSettings, RunOptions, RunOutcome, TaskTypePlan
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.reporter import Reporter
from tests.integration.runner_fakes import (
    FakeConductor,
    FakeEngine,
    FakeSupervisor,
    make_task,
    python_spec,
    to_result,
)


class OverDelivering(FakeConductor):
    """Answers a poll with every task queued, whatever count was asked (a buggy server or proxy)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def poll(self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
             domain: str | None = None) -> list[Task]:
        self.asked.append(count)
        return super().poll(task_type, count=1_000_000, timeout_ms=timeout_ms)


# ---------------------------------------------------------------- the poller


@pytest.mark.parametrize(
    ("concurrency", "max_tasks", "ran", "surplus"),
    [
        (1, None, 2, 3),  # asked 1: runs 1 + 1 (overshoot bounded by the count asked), hands 3 back
        (2, None, 4, 1),  # asked 2: runs 2 + 2
        (1, 1, 1, 4),  # --once: the budget allows no more than the one asked
        (3, 4, 4, 1),  # asked 3, budget 4: one more than asked
    ],
)
def test_the_poller_runs_or_hands_back_every_task_of_an_oversized_answer(
    concurrency: int, max_tasks: int | None, ran: int, surplus: int
) -> None:
    port = OverDelivering()
    port.add(*(make_task(f"t{i}") for i in range(5)))
    stop = threading.Event()
    run: list[str] = []
    back: list[str] = []

    def on_task(task: Task, polled_at: float) -> None:
        run.append(task.task_id)

    def on_surplus(task: Task, polled_at: float) -> None:
        back.append(task.task_id)
        if len(run) + len(back) == 5:
            stop.set()  # every task is accounted for: no second poll

    budget = WorkBudget(max_tasks)
    poller = Poller(port, PollSettings("t", concurrency=concurrency, timeout_ms=100), on_task,
                    budget=budget, stop=stop, on_surplus=on_surplus)
    poller.start()
    assert poller.join(10.0), "the poller did not stop"
    assert port.asked[0] == concurrency if max_tasks is None else min(concurrency, max_tasks)
    assert (len(run), len(back)) == (ran, surplus)
    assert sorted(run + back) == [f"t{i}" for i in range(5)]  # none dropped, none twice
    if max_tasks is not None:
        assert budget.exhausted


def test_the_poller_claims_no_more_than_max_unstarted_until_the_runner_takes_them_up() -> None:
    """With a large concurrency, claims follow the runner's progress: never more than
    ``max_unstarted`` tasks handed over and not yet taken up (started, refused or handed back)."""
    port = FakeConductor()
    port.add(*(make_task(f"t{i}") for i in range(20)))
    stop = threading.Event()
    handed: list[str] = []
    more = threading.Condition()

    def on_task(task: Task, polled_at: float) -> None:
        with more:
            handed.append(task.task_id)
            more.notify_all()

    poller = Poller(port, PollSettings("t", concurrency=100, timeout_ms=100, max_unstarted=3), on_task,
                    budget=WorkBudget(None), stop=stop)
    poller.start()
    try:
        for taken in range(0, 18, 3):
            with more:
                assert more.wait_for(lambda n=taken: len(handed) >= n + 3, timeout=10), handed
            # Nothing more is claimed while those 3 wait for the runner (a poll every ~0.1 s at most)
            assert not stop.wait(0.3)
            assert len(handed) == taken + 3, handed
            poller.taken_up(3)
        with more:
            assert more.wait_for(lambda: len(handed) == 20, timeout=10), handed
    finally:
        stop.set()
        poller.wake()
        assert poller.join(10.0)


# ---------------------------------------------------------------- the runner


def run_once_against(conductor: FakeConductor, options: RunOptions, concurrency: int = 1) -> RunOutcome:
    plan = TaskTypePlan(
        poll=PollSettings("t", concurrency=concurrency, timeout_ms=200, worker_id="w1"),
        spec=python_spec("print('done')"),
        worker_id="w1",
        make_policy=lambda task: LeasePolicy(response_timeout_seconds=30),
        kill_grace_seconds=1.0,
    )
    runner = Runner(
        [plan],
        conductor=conductor,
        make_engine=FakeEngine,
        supervisor=FakeSupervisor(),
        to_result=to_result,
        options=options,
        reporter=lambda updates, done: Reporter(updates, done, backoff_cap_seconds=0.2),
    )
    outcome: list[RunOutcome] = []
    thread = threading.Thread(target=lambda: outcome.append(runner.run(install_signal_handlers=False)))
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the runner did not stop"
    return outcome[0]


def test_once_runs_one_task_and_hands_the_others_back_at_once() -> None:
    # Given a server that answers a poll for 1 task with 3
    conductor = OverDelivering()
    conductor.add(make_task("a"), make_task("b"), make_task("c"))
    # When the runner serves --once
    outcome = run_once_against(conductor, RunOptions(once=True))
    # Then it ran one, reported it, and handed the two others back (re-queued: IN_PROGRESS, callback 0)
    assert outcome.started == 1 and outcome.statuses == (TaskStatus.COMPLETED,)
    updates = {u.task_id: u for u in conductor.updates}
    assert sorted(updates) == ["a", "b", "c"]
    assert updates["a"].status is TaskStatus.COMPLETED
    for task_id in ("b", "c"):
        back: TaskResult = updates[task_id]
        assert (back.status, back.callback_after_seconds, back.worker_id) == (TaskStatus.IN_PROGRESS, 0, "w1")


def test_extras_within_the_budget_run_beyond_the_concurrency() -> None:
    # Given a server that answers a poll for 1 task with 2, and a budget of 2 tasks
    conductor = OverDelivering()
    conductor.add(make_task("a"), make_task("b"))
    # When the runner serves --max-tasks 2 with one slot
    outcome = run_once_against(conductor, RunOptions(max_tasks=2))
    # Then both ran to completion (a one-task overshoot of the slot), nothing was handed back
    assert outcome.statuses == (TaskStatus.COMPLETED, TaskStatus.COMPLETED)
    assert conductor.statuses() == {"a": TaskStatus.COMPLETED, "b": TaskStatus.COMPLETED}
    assert conductor.asked[0] == 1


def test_a_hand_back_carries_the_yield_marker_only_when_nobody_else_may_run_the_task() -> None:
    # Given three tasks in one answer for one: "b" a first delivery, "c" a re-delivery (pollCount 2,
    # not after a yield of ours: its previous holder may still run it)
    conductor = OverDelivering()
    conductor.add(make_task("a"), make_task("b", poll_count=1), make_task("c", poll_count=2))
    outcome = run_once_against(conductor, RunOptions(once=True))
    assert outcome.started == 1
    updates = {u.task_id: u for u in conductor.updates}
    # Then "b"'s hand-back says which delivery it ended, so its next holder starts at once; "c"'s
    # does not, so its next holder still waits for the holder before us
    assert updates["b"].output_data == {YIELD_MARKER: 1}
    assert YIELD_MARKER not in updates["c"].output_data
