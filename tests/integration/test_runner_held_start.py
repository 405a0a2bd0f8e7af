"""A held re-delivery is read back when its hold ends and starts only while it is still ours; a
delivery whose lease ran out before the runner handled it never starts. The runner's main loop with
an in-memory Conductor and lease engine, and real child processes: whether a copy ran is what the
child itself wrote, not the runner's log."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.lease import LeasePolicy, LeaseState, LeaseView
from leasecore.models import TaskOwnership, TaskStatus
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import PollSettings, RunOptions, RunOutcome, TaskTypePlan
from leasecore.runner.upstream.reporter import Reporter
from tests.integration.runner_fakes import (
    FakeConductor,
    FakeEngine,
    FakeSupervisor,
    make_task,
    python_spec,
    to_result,
)
from tests.support import wait_until

HOLD_SECONDS = 0.3


class ReadableConductor(FakeConductor):
    """Answers read-backs from ``answers`` (in order; the last one repeats); an exception is raised."""

    def __init__(self, *answers: TaskOwnership | Exception | None) -> None:
        super().__init__()
        self.answers = list(answers)
        self.reads: list[tuple[str, float]] = []  # (task id, monotonic time read)

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self.reads.append((task_id, time.monotonic()))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


class ExpiredEngine(FakeEngine):
    """A lease engine whose leases are past their deadline when the main thread looks (its timer has
    not fenced them yet: the runner was stalled between the poll's answer and handling it)."""

    def view(self, task_id: str) -> LeaseView:
        super().view(task_id)  # (KeyError when not tracked)
        return LeaseView(polled_at=0.0, last_ack_at=0.0, next_heartbeat_at=None,
                         lease_deadline=time.monotonic() - 1.0, hard_deadline=None, exec_deadline=None,
                         consecutive_failures=3, heartbeat_in_flight=False, state=LeaseState.RUNNING,
                         fence_reason=None)


class Run:
    def __init__(self, conductor: FakeConductor, marker: Path, *, engine: type[FakeEngine] = FakeEngine,
                 delay: float = HOLD_SECONDS) -> None:
        self.conductor, self.supervisor = conductor, FakeSupervisor()
        self.engines: list[FakeEngine] = []
        plan = TaskTypePlan(
            poll=PollSettings("t", concurrency=1, timeout_ms=200, worker_id="w1"),
            spec=python_spec(f"open({str(marker)!r}, 'w').write('ran')"),
            worker_id="w1",
            make_policy=lambda task: LeasePolicy(response_timeout_seconds=30,
                                                 start_delay_seconds=delay if task.poll_count > 1 else 0.0),
            kill_grace_seconds=1.0,
        )

        def make_engine(on_fence):  # type: ignore[no-untyped-def]
            made = engine(on_fence)
            self.engines.append(made)
            return made

        self.runner = Runner([plan], conductor=conductor, make_engine=make_engine, supervisor=self.supervisor,
                             to_result=to_result, options=RunOptions(once=True),
                             reporter=lambda updates, done: Reporter(updates, done, backoff_cap_seconds=0.2))
        self.outcome: RunOutcome | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.outcome = self.runner.run()

    def finish(self, timeout: float = 60.0) -> RunOutcome:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the runner did not stop"
        assert self.outcome is not None
        return self.outcome


@pytest.fixture
def runs() -> Iterator[list[Run]]:
    made: list[Run] = []
    yield made
    for run in made:
        if run.thread.is_alive():
            run.runner.request_stop(force=True)
            run.thread.join(30)
        run.supervisor.close()


def test_a_held_redelivery_whose_previous_holder_reported_meanwhile_never_starts(
    runs: list[Run], tmp_path: Path
) -> None:
    """The previous holder's late FAILED landed on our delivery while we held it (Conductor's update
    carries no pollCount): the server has the task FAILED and its retry is on its way elsewhere."""
    marker = tmp_path / "ran"
    conductor = ReadableConductor(TaskOwnership(TaskStatus.FAILED, 2, "previous-holder"))
    conductor.add(make_task("a", poll_count=2))
    run = Run(conductor, marker)
    runs.append(run)
    polled = time.monotonic()
    outcome = run.finish()
    assert not marker.exists(), "the held delivery started a copy of a task that is over"
    assert [tid for tid, _ in conductor.reads] == ["a"]
    assert conductor.reads[0][1] - polled >= HOLD_SECONDS * 0.9  # read back once the hold was over
    assert conductor.updates == []  # nothing reported: not ours
    assert outcome.started == 1 and outcome.statuses == (None,)
    assert "child_started" not in run.engines[0].names("a") and "start_held" in run.engines[0].names("a")


def test_a_held_redelivery_still_ours_starts_after_its_read_back(runs: list[Run], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    conductor = ReadableConductor(RuntimeError("connection reset"),
                                  TaskOwnership(TaskStatus.IN_PROGRESS, 2, "w1"))
    conductor.add(make_task("a", poll_count=2))
    run = Run(conductor, marker)
    runs.append(run)
    outcome = run.finish()
    assert marker.read_text() == "ran"
    assert len(conductor.reads) == 2  # the failed read was tried again before the start
    assert outcome.statuses == (TaskStatus.COMPLETED,)


def test_a_first_delivery_is_not_read_back(runs: list[Run], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    conductor = ReadableConductor(TaskOwnership(TaskStatus.FAILED, 1, "x"))  # would stop it if read
    conductor.add(make_task("a", poll_count=1))
    run = Run(conductor, marker)
    runs.append(run)
    assert run.finish().statuses == (TaskStatus.COMPLETED,)
    assert marker.read_text() == "ran" and conductor.reads == []


def test_a_delivery_handled_after_its_lease_ran_out_never_starts(runs: list[Run], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    conductor = ReadableConductor(TaskOwnership(TaskStatus.IN_PROGRESS, 1, "w1"))
    conductor.add(make_task("a", poll_count=1))
    run = Run(conductor, marker, engine=ExpiredEngine)
    runs.append(run)
    outcome = run.finish()
    assert not marker.exists(), "a child ran on a lease whose deadline had passed"
    assert outcome.statuses == (TaskStatus.FAILED,)
    assert conductor.updates[0].reason_for_incompletion == "its lease ran out before the runner handled it"


class SlowReadConductor(ReadableConductor):
    """Its read-back answers only once ``release`` is set (the stop begins meanwhile)."""

    def __init__(self, *answers: TaskOwnership | Exception | None) -> None:
        super().__init__(*answers)
        self.reading, self.release = threading.Event(), threading.Event()

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self.reading.set()
        self.release.wait(30)
        return super().get_task_ownership(task_id, timeout_seconds=timeout_seconds)


def test_a_stop_while_a_held_task_is_read_back_hands_it_back_unstarted(
    runs: list[Run], tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    conductor = SlowReadConductor(TaskOwnership(TaskStatus.IN_PROGRESS, 2, "w1"))
    conductor.add(make_task("a", poll_count=2))
    run = Run(conductor, marker)
    runs.append(run)
    assert conductor.reading.wait(30), "the held task was never read back"
    run.runner.request_stop()
    wait_until(lambda: conductor.updates, what="the held task handed back before its read's answer")
    conductor.release.set()
    run.finish()
    assert not marker.exists(), "a child started after the stop began"
    (update,) = conductor.updates
    assert update.status is TaskStatus.IN_PROGRESS  # back unmarked: its previous holder may still run it
