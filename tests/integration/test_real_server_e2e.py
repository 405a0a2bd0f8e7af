"""End to end: the real ``conductor-run run`` process against the REAL Conductor OSS server.

The same story as ``test_runner_e2e.py`` (embedded server), told where it matters most. The real server
(SQLite) sweeps coarsely: after its first on-time check it may re-check a workflow 60-120 s late
(CONDUCTOR_PROTOCOL.md §4). So these tests never wait for the sweeper: they call
``PUT /api/workflow/decide/{id}``, which runs the response-timeout check *now*. A decide that finds
the task still IN_PROGRESS long after R is what proves the heartbeats work; a decide that times out an
unextended task is what gives the runner something to notice.

Every process of a task's tree carries ``CONDUCTOR_TASK_ID`` in its environment (escapees that left the
process group too), which is how these tests find the whole tree and check that none of it survives
(``tests/integration/realworld.py``; the ``real_world`` fixture is in ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from cli import exitcodes
from leasecore.config.loader import TaskSettings
from tests.integration.realworld import DECIDE_EVERY_SECONDS, RealWorld, all_dead, task_processes
from tests.support import wait_until

pytestmark = pytest.mark.real_server

OWNERSHIP_CHECK_SECONDS = TaskSettings.ownership_check_interval  # the runner's default (5 s)
KILL_GRACE_SECONDS = 2.0
# Room for a loaded 2-core machine shared with a JVM: process start, HTTP round trips, scheduling.
SLACK_SECONDS = 8.0


def test_heartbeats_keep_a_task_alive_for_several_response_timeouts(real_world: RealWorld) -> None:
    r_seconds, task_seconds = 3, 10  # more than 3 x R; heartbeats every 0.8 x R = 2.4 s
    real_world.define(response_timeout=r_seconds)
    wf = real_world.start_workflow(seconds=task_seconds)
    proc = real_world.run("--once")
    decided_past_r = 0

    def runner_done() -> bool:
        nonlocal decided_past_r
        task = real_world.decide_and_get_task(wf)
        assert task.get("status") != "TIMED_OUT", f"the server timed the task out: {task}"
        started_ms = task.get("startTime") or 0
        if task.get("status") == "IN_PROGRESS" and started_ms and time.time() * 1000 > started_ms + (
            r_seconds + 1
        ) * 1000:
            decided_past_r += 1  # a response-timeout check that would have fired without heartbeats
        return proc.poll() is not None

    wait_until(runner_done, task_seconds + 60, "the runner to finish the task",
               interval_seconds=DECIDE_EVERY_SECONDS)
    code, err = real_world.finish(proc)
    assert code == exitcodes.OK, err
    assert decided_past_r >= 3, f"only {decided_past_r} decide(s) ran while the task outlived R"
    workflow = real_world.admin.get_workflow(wf)
    assert workflow["status"] == "COMPLETED"
    [task] = workflow["tasks"]  # one attempt: never timed out, never retried
    assert task["status"] == "COMPLETED" and task["pollCount"] == 1
    assert task["outputData"]["slept"] == task_seconds
    assert task["endTime"] - task["startTime"] >= task_seconds * 1000 > 3 * r_seconds * 1000
    # The child's output was streamed to the task's execution log (POST /api/tasks/{id}/log).
    wait_until(
        lambda: any(f"sleeping {task_seconds}s" in e["log"]
                    for e in real_world.admin.get_logs(task["taskId"])),
        what="the child's output in the task log",
        interval_seconds=DECIDE_EVERY_SECONDS,
    )


def test_without_lease_extension_the_lease_ends_at_r_and_the_tree_dies_with_it(real_world: RealWorld) -> None:
    r_seconds = 3  # time enough to list the tree (sh and its sleep) before the lease ends
    real_world.define(response_timeout=r_seconds)
    wf = real_world.start_workflow(seconds=120)
    # A heartbeat timeout past R is capped at R: past R the server may hand the task to another worker,
    # so without heartbeats the lease ends at poll + R, whatever the flag asks for.
    proc = real_world.run(
        "--no-lease-extend", "--heartbeat-timeout", "120", "--kill-grace", str(KILL_GRACE_SECONDS)
    )
    task_id = real_world.task_id_of_running(wf)
    seen_running_at = time.monotonic()  # after the poll: an elapsed time from here is never too long
    tree = real_world.tree(task_id, at_least=2)

    limit = r_seconds + KILL_GRACE_SECONDS + SLACK_SECONDS
    wait_until(lambda: all_dead(tree) and not task_processes(task_id), limit, "the tree to be fenced at R")
    assert time.monotonic() - seen_running_at < limit
    # Then the server records its TIMED_OUT or the runner's FAILED (lease expired), whichever came first.
    ended = wait_until(
        lambda: (t if (t := real_world.decide_and_get_task(wf))["status"] in ("TIMED_OUT", "FAILED")
                 else None),
        30,
        "the task to end on the server",
        interval_seconds=DECIDE_EVERY_SECONDS,
    )
    reason = ended["reasonForIncompletion"]
    assert reason.startswith("lease expired") if ended["status"] == "FAILED" else "responseTimeout" in reason
    assert ended["pollCount"] == 1
    # retryCount 0: the workflow ends with it, once the server has decided it after that update (the
    # task's status can be read before: CI once read FAILED / RUNNING)
    wait_until(
        lambda: real_world.decide_and_get_task(wf) and real_world.workflow_status(wf) == ended["status"],
        30,
        "the workflow to end with its task",
        interval_seconds=DECIDE_EVERY_SECONDS,
    )
    err = real_world.stderr(proc)
    assert f"heartbeat_timeout 120s is capped at the task's responseTimeoutSeconds {r_seconds}s" in err
    assert f"task {task_id}: terminating the process tree (lease expired)" in err
    assert proc.poll() is None  # the runner keeps serving
    proc.send_signal(signal.SIGTERM)
    code, err = real_world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def test_terminating_the_workflow_kills_the_whole_tree_and_the_task_stays_canceled(
    real_world: RealWorld,
) -> None:
    real_world.define(response_timeout=30)
    wf = real_world.start_workflow()
    # A grandchild in the child's process group, and one that left it (setsid): both must die.
    command = ["/bin/sh", "-c", "sleep 300 & setsid sleep 300 & wait"]
    proc = real_world.run("--kill-grace", str(KILL_GRACE_SECONDS), command=command)
    task_id = real_world.task_id_of_running(wf)
    tree = real_world.tree(task_id, at_least=3)
    assert len({os.getsid(p.pid) for p in tree}) == 2, "expected a grandchild outside the child's session"

    real_world.admin.terminate_workflow(wf, "changed my mind")
    terminated_at = time.monotonic()
    limit = OWNERSHIP_CHECK_SECONDS + KILL_GRACE_SECONDS + SLACK_SECONDS
    wait_until(lambda: all_dead(tree) and not task_processes(task_id), limit, "the tree to be killed")
    assert time.monotonic() - terminated_at < limit
    wait_until(lambda: "no longer ours" in real_world.stderr(proc), what="the runner to log the lost task")
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    code, err = real_world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    task = real_world.decide_and_get_task(wf)
    assert task["status"] == "CANCELED", task
    assert real_world.workflow_status(wf) == "TERMINATED"


def test_a_silenced_server_means_the_tree_is_dead_by_the_lease_deadline(real_world: RealWorld) -> None:
    r_seconds = 3
    real_world.define(response_timeout=r_seconds)
    wf = real_world.start_workflow(seconds=120)
    with real_world.proxy() as proxy:
        proc = real_world.run("--kill-grace", str(KILL_GRACE_SECONDS), url=proxy.url_for("/api"))
        task_id = real_world.task_id_of_running(wf)
        tree = real_world.tree(task_id, at_least=2)
        silenced_at = time.monotonic()
        proxy.set_mode("blackhole")
        # The lease deadline is at most R after the last acknowledged heartbeat, i.e. before
        # silenced_at + R; TERM kills sleeper.sh at once, KILL follows after the grace anyway.
        limit = r_seconds + KILL_GRACE_SECONDS + SLACK_SECONDS
        wait_until(lambda: all_dead(tree) and not task_processes(task_id), limit, "the tree to be fenced")
        assert time.monotonic() - silenced_at < limit
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = real_world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "lease expired" in err
    # Whatever the runner's best-effort FAILED achieved, the task is over on the server: never COMPLETED.
    # CANCELED too (seen in CI, 22 ms after the runner's FAILED): the server's sweep and that FAILED
    # race inside the server, and ending the workflow cancels a task it still read as running.
    seen: list[dict[str, Any]] = []

    def ended() -> bool:
        seen.append(real_world.decide_and_get_task(wf))
        return seen[-1]["status"] in {"TIMED_OUT", "FAILED", "CANCELED"}

    try:
        wait_until(ended, r_seconds + 30, "the server to end the task", interval_seconds=DECIDE_EVERY_SECONDS)
    except AssertionError:  # what the server still showed, and what the runner said
        last = {k: seen[-1].get(k) for k in ("status", "pollCount", "updateTime", "reasonForIncompletion")}
        raise AssertionError(f"task still {last} on the server; the runner said:\n{err[-3000:]}") from None
    # Not necessarily the same word as the task's: the server's sweep (TIMED_OUT) and the runner's FAILED
    # reach the server in the same instant, and it can keep one in the task row and act on the other for
    # the workflow (seen once: task FAILED, workflow TIMED_OUT). Over, either way: not running, not done.
    assert real_world.workflow_status(wf) in {"TIMED_OUT", "FAILED", "TERMINATED"}
