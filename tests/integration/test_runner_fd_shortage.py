"""A spawn that fails for want of file descriptors (EMFILE in the runner) hands its task back instead of
failing it: the runner's main loop with an in-memory Conductor and lease engine, real children."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

import pytest

from leasecore.errors import SpawnError
from leasecore.models import TaskStatus
from leasecore.runner.fdbudget import FD_SHORT_REQUEUE_SECONDS
from leasecore.runner.ports import RunOptions
from tests.integration.runner_fakes import make_task
from tests.integration.test_runner_fakes import QUICK, Harness


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness(QUICK, RunOptions(max_tasks=2))
    yield h
    if h.thread.is_alive():
        h.runner.request_stop(force=True)
        h.thread.join(30)
    h.supervisor.close()


def test_a_spawn_out_of_fds_hands_the_task_back_and_the_runner_goes_on(harness: Harness) -> None:
    real_start = harness.supervisor.start
    refused: list[str] = []

    def start(task: Any, *args: Any, **kw: Any) -> Any:
        if not refused:  # the first spawn: the pipes cannot be made (as prepare raises it)
            refused.append(task.task_id)
            try:
                raise OSError(errno.EMFILE, "Too many open files")
            except OSError as exc:
                raise SpawnError("cannot make the command's output pipes: Too many open files") from exc
        return real_start(task, *args, **kw)

    harness.supervisor.start = start  # type: ignore[method-assign]
    harness.conductor.add(make_task("a", poll_count=1), make_task("b", poll_count=1))
    outcome = harness.start().finish()
    updates = {u.task_id: u for u in harness.conductor.updates}
    assert refused == ["a"]
    assert updates["a"].status is TaskStatus.IN_PROGRESS  # back to the queue, no retry spent
    assert updates["a"].callback_after_seconds == FD_SHORT_REQUEUE_SECONDS
    assert updates["b"].status is TaskStatus.COMPLETED and harness.conductor.logs["b"] == ["hello", "world"]
    assert TaskStatus.FAILED not in {u.status for u in harness.conductor.updates}
    assert outcome.started >= 1
