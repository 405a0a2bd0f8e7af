"""End to end, ``--protocol stdio``: a script written to conductor-cli's ``worker stdio`` contract
(``sample_tasks/cli_stdio_worker.py``: the whole task on stdin, one JSON document on stdout) run
unchanged by the real ``conductor-run run`` against the embedded server (docs/migrating.md and
docs/child-interface.md "The stdio protocol"; DESIGN.md §3). Every guarantee of the native protocol
holds: heartbeats keep a long task past R, a lost lease kills its whole tree, and no credential reaches
it."""

from __future__ import annotations

import json
import signal
import sys
import time
from datetime import UTC, datetime
from typing import Any

from cli import exitcodes
from tests.integration.helpers import AUTH_KEY, AUTH_SECRET, ROOT, World, all_gone, tree_of
from tests.support import wait_until

WORKER = [sys.executable, str(ROOT / "sample_tasks" / "cli_stdio_worker.py")]
SLACK = 2.5  # seconds of scheduling slack on a loaded 2-core machine
KEY, SECRET = AUTH_KEY, AUTH_SECRET
INPUTS = ("mode", "name", "seconds", "lookFor")


def define(world: World, *, response_timeout: int = 30, retry_count: int = 0) -> None:
    """The task def, and a one-task workflow passing ``mode``, ``name``, ``seconds``, ``lookFor``."""
    world.define(response_timeout=response_timeout, retry_count=retry_count, inputs=INPUTS)


def logs_of(world: World, workflow_id: str) -> list[str]:
    """The lines of the task's execution log (the runner sends them in batches, a line per line)."""
    entries = world.admin.get_logs(world.task_of(workflow_id)["taskId"])
    return [line for entry in entries for line in str(entry.get("log")).split("\n")]


def run_once(world: World, mode: str, *args: str, env: dict[str, str] | None = None,
             **input_data: Any) -> tuple[int, str, str]:  # fmt: skip
    """One workflow, one ``run --once --protocol stdio``: (exit code, runner log, workflow id)."""
    workflow = world.start_workflow(mode=mode, **input_data)
    proc = world.run("--protocol", "stdio", "--once", *args, command=WORKER, env=env)
    code, log = world.finish(proc)
    return code, log, workflow


def test_completed_with_its_output_and_its_logs(world: World) -> None:
    define(world)
    code, log, wf = run_once(world, "complete", name="Ada")
    assert code == exitcodes.OK, log
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED"
    out = task["outputData"]
    assert out["greeting"] == "hello Ada"  # outputData is the document's output, nothing added
    assert "exitCode" not in out and "stdoutTail" not in out
    assert out["taskIdFromStdin"] == task["taskId"]  # the whole task came in on stdin
    assert out["inputFromStdin"]["name"] == "Ada"
    assert out["cliEnv"] == {"TASK_TYPE": world.task_type, "TASK_ID": task["taskId"],
                             "WORKFLOW_ID": wf, "EXECUTION_ID": wf, "POLL_DOMAIN": None}  # fmt: skip
    assert out["conductorTaskId"] == task["taskId"]
    assert world.workflow_status(wf) == "COMPLETED"
    # The document's logs and the stderr lines are in the task's execution log on the server.
    stderr_line = f"[stderr] working on task {task['taskId']} (complete)"
    wanted = {"read the task from stdin", "greeted Ada", stderr_line}
    wait_until(lambda: wanted <= set(logs_of(world, wf)), what="the logs on the server")
    assert not any(line.startswith("{") for line in logs_of(world, wf))  # stdout itself is not logged


def test_failed_carries_the_scripts_reason(world: World) -> None:
    define(world)
    code, log, wf = run_once(world, "fail")
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    assert task["reasonForIncompletion"] == "the input was not good enough"
    assert task["outputData"] == {"checked": True}


def test_a_terminal_error_is_not_retried(world: World) -> None:
    define(world, retry_count=2)
    code, log, wf = run_once(world, "terminal")
    assert code == exitcodes.TASK_FAILED, log
    assert world.task_of(wf)["status"] == "FAILED_WITH_TERMINAL_ERROR"
    assert world.workflow_status(wf) == "FAILED"  # no retry was scheduled, unlike conductor-cli's FAILED
    assert len(world.admin.get_workflow(wf)["tasks"]) == 1


def test_stdout_that_is_not_json_fails_with_an_excerpt(world: World) -> None:
    define(world)
    code, log, wf = run_once(world, "garbage")
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    reason = task["reasonForIncompletion"]
    assert reason.startswith("invalid worker stdout JSON: Expecting value: line 1 column 1")
    assert "stdout began: 'this is not JSON\\n'" in reason
    assert task["outputData"]["stdoutExcerpt"] == "this is not JSON\n"


def test_a_non_zero_exit_fails_with_the_last_stderr_line(world: World) -> None:
    define(world)
    code, log, wf = run_once(world, "crash")
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    assert task["reasonForIncompletion"] == "worker execution failed: exit status 3: something broke"
    assert task["outputData"]["exitCode"] == 3
    wait_until(lambda: "[stderr] something broke" in logs_of(world, wf), what="stderr in the task log")


def test_stdout_past_the_bound_fails_and_the_runner_stays_small(world: World) -> None:
    define(world)
    code, log, wf = run_once(world, "flood")
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert task["reasonForIncompletion"].startswith(
        "worker stdout is too large: 4194328 bytes, over the 3145728-byte (3 MiB) limit")
    assert len(json.dumps(task["outputData"])) < 64 * 1024


def test_in_progress_comes_back_after_callback_after_seconds(world: World) -> None:
    define(world)
    wf = world.start_workflow(mode="in_progress")
    proc = world.run("--protocol", "stdio", command=WORKER)
    try:
        wait_until(lambda: world.workflow_status(wf) == "COMPLETED", timeout_seconds=30,
                   what="the workflow to complete on the second delivery")  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        code, log = world.finish(proc)
    assert code == exitcodes.SIGTERM, log
    task = world.task_of(wf)
    assert task["outputData"] == {"ready": True, "pollCount": 2}
    assert "reporting IN_PROGRESS" in log
    wait_until(lambda: "not ready yet" in logs_of(world, wf), what="the first run's log")
    # The yield asked for 1 s: the second run started no sooner than 1 s after it was reported.
    yielded = _log_time(log, "reporting IN_PROGRESS")
    restarted = [_log_time(line, "") for line in log.splitlines() if "started: pid" in line][-1]
    assert restarted - yielded >= 0.95, log


def _log_time(log: str, text: str) -> float:
    """The time stamp (epoch seconds) of the first runner log line holding ``text``."""
    line = next(line for line in log.splitlines() if text in line)
    stamp = line.split()[0].rstrip("Z")
    return datetime.fromisoformat(stamp).replace(tzinfo=UTC).timestamp()


def test_a_long_task_lives_past_r_and_its_tree_dies_with_the_lease(world: World) -> None:
    define(world, response_timeout=2)
    wf = world.start_workflow(mode="sleep", seconds=120)
    with world.proxy() as proxy:
        url = proxy.url_for("/api")
        proc = world.run("--protocol", "stdio", "--kill-grace", "1", url=url, command=WORKER)
        (pid,) = wait_until(world.child_pids, what="the child to start")
        wait_until(lambda: len(tree_of(pid)) >= 2, what="the script's own child")
        tree = tree_of(pid)
        started = time.monotonic()
        # Three times R later, the heartbeats have kept the task ours and the whole tree alive.
        wait_until(lambda: time.monotonic() - started > 6, timeout_seconds=10, what="3 R to pass")
        assert world.task_of(wf)["status"] == "IN_PROGRESS"
        assert not all_gone(tree) and all(p in tree_of(pid) for p in tree)
        proxy.set_mode("blackhole")  # the server is gone for the runner: the lease cannot be trusted
        cut = time.monotonic()
        wait_until(lambda: all_gone(tree), timeout_seconds=30, what="the tree to be fenced")
        assert time.monotonic() - cut < 2 + 1 + SLACK  # R (from the last ack) + the kill grace at most
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, log = world.finish(proc)
    assert code == exitcodes.SIGTERM, log
    assert "lease expired" in log


def test_the_exec_timeout_kills_the_whole_tree_not_just_the_script(world: World) -> None:
    define(world)
    wf = world.start_workflow(mode="sleep", seconds=120)
    proc = world.run("--protocol", "stdio", "--once", "--exec-timeout", "2", "--kill-grace", "1",
                     command=WORKER)  # fmt: skip
    (pid,) = wait_until(world.child_pids, what="the child to start")
    tree = wait_until(lambda: tree_of(pid) if len(tree_of(pid)) >= 2 else None, what="the script's child")
    code, log = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, log
    assert all_gone(tree)  # conductor-cli's --exec-timeout kills the direct child only
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    assert task["reasonForIncompletion"] == "exec timeout after 2s"


def test_no_credential_reaches_the_script(auth_world: World) -> None:
    world = auth_world
    define(world)
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET,
           # What conductor-cli hands its children: stripped too, should the runner's environment have it.
           "CONDUCTOR_ACCESS_KEY_ID": KEY, "CONDUCTOR_ACCESS_KEY_SECRET": SECRET}  # fmt: skip
    code, log, wf = run_once(world, "complete", env=env, lookFor=[SECRET])
    assert code == exitcodes.OK, log
    out = world.task_of(wf)["outputData"]
    assert out["secretsSeen"] == []
    assert not set(env) & set(out["envNames"])
    assert SECRET not in log


def test_conductor_clis_token_variable_authenticates_and_stays_out_of_the_script(auth_world: World) -> None:
    world = auth_world
    define(world)
    assert world.client.auth is not None
    token = world.client.auth.current(5.0)  # what `conductor` users keep in CONDUCTOR_AUTH_TOKEN
    assert token
    code, log, wf = run_once(world, "complete", env={"CONDUCTOR_AUTH_TOKEN": token}, lookFor=[token])
    assert code == exitcodes.OK, log
    out = world.task_of(wf)["outputData"]
    assert out["secretsSeen"] == [] and "CONDUCTOR_AUTH_TOKEN" not in out["envNames"]
    assert token not in log
