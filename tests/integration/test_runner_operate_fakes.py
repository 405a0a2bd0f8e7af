"""The runner's side of pause, resume, reload and drain (``leasecore.runner.loop.operate``), driven through
``Runner.control`` as the control socket's thread calls it, with fake ports and real child processes."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest

from leasecore.errors import ConfigError
from leasecore.lease import LeasePolicy
from leasecore.models import TaskStatus
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import LiveChange, PollSettings, RunOptions, RunOutcome, TaskTypePlan
from tests.integration.runner_fakes import (
    FakeConductor,
    FakeEngine,
    FakeSupervisor,
    make_task,
    python_spec,
    to_result,
)
from tests.support import wait_until

SLEEP = "import time; time.sleep({})"


def plan(task_type: str, code: str, *, concurrency: int = 1) -> TaskTypePlan:
    poll = PollSettings(task_type, concurrency=concurrency, timeout_ms=100, worker_id="w1")
    return TaskTypePlan(poll=poll, spec=python_spec(code), worker_id="w1", kill_grace_seconds=1.0,
                        make_policy=lambda task: LeasePolicy(response_timeout_seconds=30))


class Running:
    """A runner on a thread, with a reload that answers what the test sets."""

    def __init__(self, *plans: TaskTypePlan, options: RunOptions | None = None) -> None:
        self.conductor = FakeConductor()
        self.supervisor = FakeSupervisor()
        self.next_reload: LiveChange | Exception = ConfigError("no reload set")
        self.runner = Runner(list(plans), conductor=self.conductor, make_engine=FakeEngine,
                             supervisor=self.supervisor, to_result=to_result, options=options or RunOptions(),
                             reload=self._reload)  # fmt: skip
        self.outcome: list[RunOutcome] = []
        self.thread = threading.Thread(target=lambda: self.outcome.append(self.runner.run()), daemon=True)
        self.thread.start()

    def _reload(self) -> LiveChange:
        if isinstance(self.next_reload, Exception):
            raise self.next_reload
        return self.next_reload

    def ask(self, command: str, *types: str, timeout: float | None = None) -> dict[str, object]:
        request = {"command": command, "task_types": list(types), "timeout_seconds": timeout}
        return self.runner.control(request)


@pytest.fixture
def made() -> Iterator[list[Running]]:
    runs: list[Running] = []
    yield runs
    for run in runs:
        if run.thread.is_alive():
            run.runner.request_stop(force=True)
            run.thread.join(30)
        run.supervisor.close()


def test_pause_names_what_changed_and_refuses_a_type_not_served(made: list[Running]) -> None:
    run = Running(plan("a", SLEEP.format(0)), plan("b", SLEEP.format(0)))
    made.append(run)
    assert run.ask("pause", "a") == {"ok": True, "changed": ["a"], "paused": ["a"]}
    assert run.ask("pause") == {"ok": True, "changed": ["b"], "paused": ["a", "b"]}
    assert run.ask("pause", "c") == {"ok": False, "error": "this runner does not serve c (it serves a, b)"}
    assert not threading.Event().wait(0.3)  # the polls in flight at the pause (100 ms) have ended
    polls = run.conductor.polls
    run.conductor.add(make_task("t1", "a"))
    assert not threading.Event().wait(0.3)
    assert run.conductor.polls == polls  # none since
    assert run.conductor.queued["a"] == [make_task("t1", "a")]  # not taken
    assert run.ask("resume", "a")["changed"] == ["a"]
    wait_until(lambda: run.conductor.statuses().get("t1") is TaskStatus.COMPLETED, what="t1 to run")


def test_a_refused_reload_changes_nothing_and_an_accepted_one_serves_new_tasks_with_the_new_plan(
    made: list[Running],
) -> None:
    old = plan("t", SLEEP.format(0), concurrency=1)
    run = Running(old)
    made.append(run)
    run.next_reload = ConfigError("[server] url (from conductor.toml:2) can only change with a restart")
    reply = run.ask("reload")
    assert reply["ok"] is False and "can only change with a restart" in str(reply["error"])
    assert run.runner._t.plans["t"] is old and run.runner._pollers["t"].settings.concurrency == 1

    new = plan("t", SLEEP.format(0), concurrency=3)
    run.next_reload = LiveChange((new,), dataclasses.replace(RunOptions(), drain=True),
                                 paused=(("t", True),), changes=("task t: concurrency: 1 -> 3",))
    assert run.ask("reload") == {"ok": True, "changed": ["task t: concurrency: 1 -> 3"], "paused": ["t"]}
    assert run.runner._t.plans["t"] is new and run.runner._pollers["t"].settings.concurrency == 3
    assert run.runner.options.drain is True


def test_drain_lets_the_running_task_finish_and_the_run_ends_clean(made: list[Running]) -> None:
    run = Running(plan("t", SLEEP.format(1)))
    made.append(run)
    run.conductor.add(make_task("t1"))
    wait_until(lambda: "t1" in run.supervisor.children, what="t1 to start")
    reply = run.ask("drain", timeout=30)
    assert reply["ok"] is True and reply["running"] == 1 and reply["drain_timeout_seconds"] == 30
    assert run.ask("pause") == {"ok": False, "error": "the runner is stopping"}
    again = run.ask("drain")
    assert again["ok"] is True and again["already_stopping"] is True
    run.thread.join(30)
    assert not run.thread.is_alive()
    (outcome,) = run.outcome
    assert outcome.signum is None and outcome.statuses == (TaskStatus.COMPLETED,)
    assert run.ask("resume") == {"ok": False, "error": "the runner is stopping"}  # closed: answered at once
