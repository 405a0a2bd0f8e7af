"""``worker.plan_for``: the lease policy a task type's tasks get, and the warning when it is capped."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.config.loader import TaskSettings
from leasecore.models import Task
from leasecore.runner.plans import plan_for


def task(r: int, task_id: str = "t1") -> Task:
    return Task(task_id=task_id, workflow_id="w1", task_type="encode", response_timeout_seconds=r)


def settings(tmp_path: Path, heartbeat_timeout: float | None, kill_grace: float = 0.25) -> TaskSettings:
    # kill_grace 0.25 s: within a quarter of every lease below, so only the heartbeat timeout is capped
    return TaskSettings(type="encode", command=("true",), cwd=str(tmp_path),
                        heartbeat_timeout=heartbeat_timeout, kill_grace=kill_grace)


@pytest.fixture
def warnings_logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """The worker's log records, whether or not a CLI run in this process stopped propagation."""
    logger = logging.getLogger("conductor_run.worker")
    logger.addHandler(caplog.handler)
    propagate, logger.propagate = logger.propagate, False  # each record once
    try:
        with caplog.at_level(logging.WARNING, logger="conductor_run.worker"):
            yield caplog
    finally:
        logger.propagate = propagate
        logger.removeHandler(caplog.handler)


def test_a_heartbeat_timeout_above_r_is_capped_with_one_warning_per_task_type(
    tmp_path: Path, warnings_logged: pytest.LogCaptureFixture
) -> None:
    # Given --heartbeat-timeout 10 for a task type whose tasks have R=2
    plan = plan_for(settings(tmp_path, 10.0))
    # When three of its tasks are polled
    policies = [plan.make_policy(task(2, f"t{i}")) for i in range(3)]
    # Then each lease ends at R, and the user is told once why
    assert [p.lease_timeout_seconds for p in policies] == [2, 2, 2]
    lines = [r.getMessage() for r in warnings_logged.records]
    assert lines == [
        "task type encode: heartbeat_timeout 10s is capped at the task's responseTimeoutSeconds 2s: "
        "past it the server may give the task to another worker"
    ]


@pytest.mark.parametrize(("heartbeat_timeout", "r"), [(None, 2), (2.0, 2), (1.5, 2), (10.0, 0)])
def test_no_warning_when_the_heartbeat_timeout_is_not_cut(
    tmp_path: Path, warnings_logged: pytest.LogCaptureFixture, heartbeat_timeout: float | None, r: int
) -> None:
    plan = plan_for(settings(tmp_path, heartbeat_timeout))
    policy = plan.make_policy(task(r))
    assert not policy.heartbeat_timeout_capped
    assert warnings_logged.records == []


def test_a_kill_grace_above_a_quarter_of_the_lease_is_capped_with_one_warning_per_task_type(
    tmp_path: Path, warnings_logged: pytest.LogCaptureFixture
) -> None:
    # Given --kill-grace 10 for a task type whose tasks have R=8 (and one with R=60: room enough)
    plan = plan_for(settings(tmp_path, None, kill_grace=10.0))
    policies = [plan.make_policy(task(8, f"t{i}")) for i in range(3)]
    roomy = plan.make_policy(task(60, "t9"))
    # Then each R=8 task gets a 2 s grace (TERM 2.25 s before its deadline), the user is told once
    assert [p.effective_kill_grace_seconds for p in policies] == [2.0, 2.0, 2.0]
    assert roomy.effective_kill_grace_seconds == 10.0
    lines = [r.getMessage() for r in warnings_logged.records]
    assert len(lines) == 1 and lines[0].startswith("task type encode: kill_grace 10s is capped at 2s"), lines
