"""Long jobs resume on the REAL Conductor OSS server: a failed attempt's retry resumes from the
checkpoint its FAILED update carried, and a retry after its runner was SIGKILLed (no update at all;
the server times the attempt out) resumes from the checkpoint streamed to the attempt's task log.
The child (``sample_tasks/resumable.py``) records each run's first and last step itself."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from cli import exitcodes
from leasecore.process.checkpoint import LOG_MARKER
from tests.integration.realworld import DECIDE_EVERY_SECONDS, RealWorld
from tests.integration.test_long_jobs_e2e import RESUMABLE, runs_of, start_job
from tests.support import wait_until

pytestmark = pytest.mark.real_server


def _over(world: RealWorld, wf: str) -> bool:
    world.admin.decide(wf)  # the real server's sweeper may be late: decide now
    return world.workflow_status(wf) != "RUNNING"


def test_a_failed_attempts_retry_resumes_on_the_real_server(real_world: RealWorld, tmp_path: Path) -> None:
    world = real_world
    world.define(response_timeout=10, retry_count=1)
    record = tmp_path / "runs"
    wf = start_job(world, steps=4, step_seconds=0.05, fail_at=2, record=str(record))
    world.workflows.append(wf)
    runner = world.run("--max-tasks", "2", command=RESUMABLE)
    wait_until(lambda: _over(world, wf), timeout_seconds=120, interval_seconds=DECIDE_EVERY_SECONDS,
               what="the workflow to end")
    code, err = world.finish(runner)
    assert world.workflow_status(wf) == "COMPLETED", err
    assert code == exitcodes.TASK_FAILED, err  # --max-tasks: one of its two tasks failed
    runs = runs_of(record)
    assert [(a, b) for _, a, b in runs] == [(0, 2), (2, 4)], (runs, err)
    first, retry = (t for t, _, _ in runs)
    assert world.client.get_task(retry)["retriedTaskId"] == first
    assert world.client.get_task(first)["outputData"]["checkpoint"] == {"step": 2, "progress": 0.5}
    assert "resuming from the checkpoint of its earlier attempt" in err


def test_a_retry_after_a_dead_runner_resumes_from_the_task_log_on_the_real_server(
    real_world: RealWorld, tmp_path: Path
) -> None:
    world = real_world
    world.define(response_timeout=2, retry_count=1)
    record = tmp_path / "runs"
    wf = start_job(world, steps=30, step_seconds=0.25, record=str(record))
    world.workflows.append(wf)
    a = world.run(command=RESUMABLE)
    first_task = world.task_id_of_running(wf)

    def logged_step() -> int:
        lines = [line for entry in world.admin.get_logs(first_task)
                 for line in str(entry.get("log", "")).splitlines() if line.startswith(LOG_MARKER)]
        return int(lines[-1].split('"step":')[1].split(",")[0]) if lines else 0

    logged = wait_until(lambda: (step := logged_step()) >= 3 and step, timeout_seconds=60,
                        what="a checkpoint in the task log")
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    wait_until(lambda: world.decide_and_get_task(wf)["taskId"] != first_task, timeout_seconds=120,
               interval_seconds=DECIDE_EVERY_SECONDS, what="the server to time the attempt out and retry it")
    assert world.client.get_task(first_task)["status"] == "TIMED_OUT"
    b = world.run("--max-tasks", "1", command=RESUMABLE)
    wait_until(lambda: _over(world, wf), timeout_seconds=120, interval_seconds=DECIDE_EVERY_SECONDS,
               what="the retry to finish the job")
    code, err = world.finish(b)
    assert world.workflow_status(wf) == "COMPLETED", err
    runs = runs_of(record)
    assert len(runs) == 1, runs  # the killed run recorded nothing: its tree died with its runner
    retry_task, first_step, last_step = runs[0]
    assert retry_task != first_task and last_step == 30
    assert first_step >= logged, (runs, logged)
    assert "(from its task log)" in err
    assert code == 0, err
