"""Long jobs that resume, end to end: a real runner, the embedded server on loopback, and
``sample_tasks/resumable.py`` as the child, which records each run's first and last step itself.

Paths: a yield resumes from the checkpoint its run sent with the IN_PROGRESS update; a failed attempt's
retry resumes from the checkpoint sent with the FAILED update; a runner SIGKILLed mid-task sends no
update at all, the server times the task out, and the retry (on another runner) resumes from the
checkpoint the dead runner streamed to the task log.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from cli import exitcodes
from leasecore.process.checkpoint import LOG_MARKER
from tests.integration.helpers import ROOT, World
from tests.support import wait_until

RESUMABLE = [sys.executable, str(ROOT / "sample_tasks" / "resumable.py")]
_INPUTS = ("steps", "step_seconds", "yield_every", "fail_at", "record")


def start_job(world: World, **job: Any) -> str:
    """Register (once) a one-task workflow passing the resumable job's inputs, and start it."""
    name = f"long_{world.task_type}"
    world.admin.register_workflow({
        "name": name, "version": 1, "schemaVersion": 2,
        "tasks": [{"name": world.task_type, "taskReferenceName": "job", "type": "SIMPLE",
                   "inputParameters": {k: f"${{workflow.input.{k}}}" for k in _INPUTS}}],
    }, overwrite=True)  # fmt: skip
    return world.admin.start_workflow(name, job)


def runs_of(record: Path) -> list[tuple[str, int, int]]:
    """Each run of the job, as the child recorded it: (task id, first step, last step)."""
    if not record.exists():
        return []
    return [(t, int(a), int(b)) for t, a, b in (line.split() for line in record.read_text().splitlines())]


def ended(world: World, wf: str) -> bool:
    return world.workflow_status(wf) != "RUNNING"


def test_a_yield_resumes_from_its_checkpoint(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=5)
    record = tmp_path / "runs"
    wf = start_job(world, steps=6, step_seconds=0.05, yield_every=2, record=str(record))
    runner = world.run("--max-tasks", "3", command=RESUMABLE)
    wait_until(lambda: ended(world, wf), timeout_seconds=60, what="the workflow to end")
    code, err = world.finish(runner)
    assert world.workflow_status(wf) == "COMPLETED", err
    runs = runs_of(record)
    # One task id throughout (yields keep it), each run starting where the one before stopped.
    assert [(a, b) for _, a, b in runs] == [(0, 2), (2, 4), (4, 6)], (runs, err)
    assert len({t for t, _, _ in runs}) == 1
    task = world.task_of(wf)
    assert task["outputData"]["checkpoint"] == {"step": 6, "progress": 1.0}
    assert task["outputData"]["resumedAfter"] == 4
    assert "$status" not in task["outputData"] and "$callbackAfterSeconds" not in task["outputData"]
    assert code == 0, err


def test_a_failed_attempts_retry_resumes_from_its_checkpoint(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=5, retry_count=1)
    record = tmp_path / "runs"
    wf = start_job(world, steps=5, step_seconds=0.05, fail_at=3, record=str(record))
    runner = world.run("--max-tasks", "2", command=RESUMABLE)
    wait_until(lambda: ended(world, wf), timeout_seconds=60, what="the workflow to end")
    code, err = world.finish(runner)
    assert world.workflow_status(wf) == "COMPLETED", err
    runs = runs_of(record)
    assert [(a, b) for _, a, b in runs] == [(0, 3), (3, 5)], (runs, err)
    first, retry = (t for t, _, _ in runs)
    assert first != retry  # a retry: a new task id, resumed from the failed attempt's update
    failed = world.client.get_task(first)
    assert failed["status"] == "FAILED" and failed["outputData"]["checkpoint"]["step"] == 3
    assert world.client.get_task(retry)["retriedTaskId"] == first
    assert code == exitcodes.TASK_FAILED, err  # --max-tasks: one of its tasks failed


def test_a_retry_after_the_runner_died_resumes_from_the_task_log(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=2, retry_count=1)
    record = tmp_path / "runs"
    wf = start_job(world, steps=40, step_seconds=0.25, record=str(record))
    a = world.run(command=RESUMABLE)

    def streamed_step() -> int:
        task = world.task_of(wf)
        if not task.get("taskId"):
            return 0
        lines = [line for entry in world.admin.get_logs(task["taskId"])
                 for line in str(entry.get("log", "")).splitlines() if line.startswith(LOG_MARKER)]
        return int(lines[-1].split('"step":')[1].split(",")[0]) if lines else 0

    logged = wait_until(lambda: (step := streamed_step()) >= 3 and step, timeout_seconds=60,
                        what="a checkpoint in the task log")
    first_task = world.task_of(wf)["taskId"]
    a.send_signal(signal.SIGKILL)  # no update, no drain: only the task log knows where it was
    a.wait(timeout=30)
    wait_until(lambda: world.task_of(wf)["taskId"] != first_task, timeout_seconds=60,
               what="the server to time the task out and schedule its retry")
    assert world.client.get_task(first_task)["status"] == "TIMED_OUT"
    b = world.run("--max-tasks", "1", command=RESUMABLE, env={"RUNNER": uuid.uuid4().hex})
    wait_until(lambda: ended(world, wf), timeout_seconds=120, what="the retry to finish the job")
    code, err = world.finish(b)
    assert world.workflow_status(wf) == "COMPLETED", err
    runs = runs_of(record)  # the killed run recorded nothing (its tree died with its runner)
    assert len(runs) == 1, runs
    retry_task, first_step, last_step = runs[0]
    assert retry_task != first_task and last_step == 40
    assert first_step >= 3 and first_step >= logged, (runs, logged)
    assert code == 0, err


_LISTENING = re.compile(r"metrics on http://127\.0\.0\.1:(\d+)/metrics")


def _status(world: World, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "cli", "status", "--state-dir", str(world.state_dir), *args],
                          capture_output=True, text=True, timeout=60, cwd=world.tmp)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_progress_shows_in_status_and_metrics_while_the_job_runs(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=5)
    wf = start_job(world, steps=100, step_seconds=0.1)
    runner = world.run("--metrics-port", "0", command=RESUMABLE)
    port = wait_until(lambda: (m := _LISTENING.search(world.stderr(runner))) and m.group(1),
                      what="the metrics endpoint")

    def progress_in_json() -> float | None:
        doc = json.loads(_status(world, "--json"))
        tasks = [t for r in doc["runners"] for t in r["tasks"]]
        return tasks[0]["progress"] if tasks and (tasks[0]["progress"] or 0) >= 0.05 else None

    seen = wait_until(progress_in_json, timeout_seconds=60, what="progress in status --json")
    assert 0.05 <= seen < 1
    table = _status(world)
    assert "PROGRESS" in table and re.search(r"\b\d{1,2}%", table), table
    task_id = world.task_of(wf)["taskId"]
    labels = (f'taskType="{world.task_type}"', f'taskId="{task_id}"')

    def gauge() -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            lines = reply.read().decode().splitlines()
        values = [float(line.rsplit(" ", 1)[1]) for line in lines
                  if line.startswith("conductor_run_task_progress{") and all(x in line for x in labels)]
        return values[0] if values and values[0] >= seen else None

    assert 0 < wait_until(gauge, what="the progress gauge") < 1
    runner.send_signal(signal.SIGTERM)
    world.finish(runner)


def test_conductor_deadline_is_the_earliest_fence_known_in_advance(world: World, tmp_path: Path) -> None:
    seen = tmp_path / "deadline"
    script = ["/bin/sh", "-c", 'echo "${CONDUCTOR_DEADLINE:-none} $(date +%s)" >> "$0"', str(seen)]
    # exec timeout only; then timeoutSeconds earlier than it; then neither (a task type each)
    for taskdef, flags in (
        ({}, ("--exec-timeout", "300")),
        ({"timeoutSeconds": 120, "timeoutPolicy": "RETRY"}, ("--exec-timeout", "300", "--kill-grace", "3")),
        ({}, ()),
    ):
        world.task_type = f"job_{uuid.uuid4().hex[:8]}"
        world.define(response_timeout=20, **taskdef)
        world.start_workflow()
        code, err = world.finish(world.run("--max-tasks", "1", *flags, command=script))
        assert code == 0, err
    (exec_deadline, exec_now), (hard_deadline, hard_now), (none, _) = (
        line.split() for line in seen.read_text().splitlines())
    assert 299 <= int(exec_deadline) - int(exec_now) <= 300  # whole seconds, rounded down
    # timeoutSeconds counts from the poll; its fence TERMs grace (3 s) + margin ahead of the server
    assert 120 - 3 - 10 <= int(hard_deadline) - int(hard_now) <= 120 - 3
    assert none == "none"


def test_the_stdio_protocol_gets_the_same_checkpoint_file(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=5)
    seen = tmp_path / "seen"
    script = ('f="$CONDUCTOR_CHECKPOINT_FILE"; cat "$f" >> "$0"; echo >> "$0"; '
              'if [ "$CONDUCTOR_POLL_COUNT" = 1 ]; then echo \'{"at": "first"}\' > "$f"; '
              'echo \'{"status": "IN_PROGRESS", "callbackAfterSeconds": 0}\'; '
              'else echo \'{"status": "COMPLETED", "output": {"done": true}}\'; fi')
    wf = world.start_workflow()
    code, err = world.finish(world.run("--protocol", "stdio", "--max-tasks", "2",
                                       command=["/bin/sh", "-c", script, str(seen)]))
    assert seen.read_text().splitlines() == ["", '{"at":"first"}'], err  # empty, then the yield's
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED" and task["outputData"]["checkpoint"] == {"at": "first"}, task
    assert code == 0, err


# Yields once, at step 3 of its first run; every later run goes on to step 30 without yielding.
_YIELD_ONCE = """
import json, os, sys, time
path = os.environ["CONDUCTOR_CHECKPOINT_FILE"]
text = open(path).read()
step = first = json.loads(text)["step"] if text.strip() else 0
stop = 3 if os.environ["CONDUCTOR_POLL_COUNT"] == "1" and os.environ["CONDUCTOR_RETRY_COUNT"] == "0" else 30
while step < stop:
    time.sleep(0.25)
    step += 1
    with open(path + ".tmp", "w") as f:
        json.dump({"step": step}, f)
    os.replace(path + ".tmp", path)
with open(sys.argv[1], "a") as f:
    f.write(f"{os.environ['CONDUCTOR_TASK_ID']} {first} {step}\\n")
if step < 30:
    with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w") as f:
        json.dump({"$status": "IN_PROGRESS", "$callbackAfterSeconds": 0}, f)
"""


def test_a_retry_after_a_yield_and_a_dead_runner_resumes_from_its_log(world: World, tmp_path: Path) -> None:
    # The yield's update left {"step": 3} as the task's output; the next run of the same task id got
    # further, logged it, and died with its runner: the retry must not go back to the yield's step.
    world.define(response_timeout=2, retry_count=1)
    record = tmp_path / "runs"
    child = [sys.executable, "-c", _YIELD_ONCE, str(record)]
    wf = world.start_workflow()
    a = world.run(command=child)

    def logged_past_the_yield() -> bool:
        task = world.task_of(wf)
        if task.get("pollCount", 0) < 2:
            return False
        lines = [line for entry in world.admin.get_logs(task["taskId"])
                 for line in str(entry.get("log", "")).splitlines() if line.startswith(LOG_MARKER)]
        return bool(lines) and json.loads(lines[-1][len(LOG_MARKER):])["step"] >= 5

    wait_until(logged_past_the_yield, timeout_seconds=60, what="the second run to log step 5")
    first_task = world.task_of(wf)["taskId"]
    a.send_signal(signal.SIGKILL)
    a.wait(timeout=30)
    wait_until(lambda: world.task_of(wf)["taskId"] != first_task, timeout_seconds=60, what="the retry")
    assert world.client.get_task(first_task)["outputData"]["checkpoint"]["step"] == 3  # the yield's
    b = world.run("--max-tasks", "1", command=child)
    wait_until(lambda: ended(world, wf), timeout_seconds=120, what="the retry to finish the job")
    code, err = world.finish(b)
    assert world.workflow_status(wf) == "COMPLETED", err
    runs = runs_of(record)  # the first run yielded at 3; the killed one recorded nothing
    assert len(runs) == 2 and runs[0][1:] == (0, 3), (runs, err)
    assert runs[1][0] != first_task and runs[1][1] >= 5 and runs[1][2] == 30, (runs, err)
    assert code == 0, err
