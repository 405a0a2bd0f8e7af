"""A runner whose lease ran out while the task was handed to another runner does not end that
runner's delivery with its own FAILED (the report's read-first, ``decisions.report_check``).

Conductor's update carries no pollCount: before, the stalled runner's FAILED "lease expired", sent
when it ran again, landed on the other delivery of the same taskId, and the server created the retry
at once while the other holder still ran its copy (simulator finding 5; the simulator saw a stalled
holder report 28 s after the next holder had started). A real ``conductor-run run`` against the
embedded server; the test plays the other holder: it re-queues the task and polls it itself
(pollCount 2) while the runner is stopped, keeps that lease alive, and reads the server's record.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

from cli import exitcodes
from tests.integration.helpers import World, gone
from tests.integration.test_runner_stall_e2e import R, command, started, stop
from tests.support import wait_until


def beating(world: World, workflow_id: str, task_id: str, worker_id: str) -> Callable[[], None]:
    """The other holder's heartbeat, sent when called at least a second after the last one (R is 4 s)."""
    last = [time.monotonic()]

    def beat() -> None:
        if time.monotonic() - last[0] >= 1.0:
            world.client.extend_lease(task_id, workflow_id, worker_id=worker_id)
            last[0] = time.monotonic()

    return beat


def test_a_stalled_runners_failed_never_lands_on_the_delivery_another_runner_holds(world: World) -> None:
    scenario(world)


def scenario(world: World) -> None:
    """(Also run on the real server: ``test_real_server_lost_lease.py``.)"""
    world.define(response_timeout=R, retry_count=1)
    record = world.tmp / "copies"
    a = world.run("--max-tasks", "1", "--worker-id", "host-a", command=command(record))
    wf = world.start_workflow()
    (copy,) = started(record, 1)
    stop(a)  # A's lease runs out; its fork server ends the tree by the lease's deadline
    try:
        other = world.steal(wf, worker_id="other-holder")  # re-queued and polled: the other holder
        assert other.poll_count == 2
        beat = beating(world, wf, other.task_id, "other-holder")
        wait_until(lambda: (beat(), gone(copy.pid))[1], 30, what="A's tree to be ended by its fork server")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    # A runs again, finds its lease over and makes its FAILED "lease expired while the runner was
    # stalled"; the other holder keeps its lease meanwhile.
    wait_until(lambda: (beat(), a.poll() is not None)[1], 60, what="A to end its task and exit")
    code, err = world.finish(a)
    assert "reporting FAILED (lease expired while the runner was stalled" in err, err
    record_now = world.task_of(wf)
    tasks = world.admin.get_workflow(wf)["tasks"]
    assert len(tasks) == 1, "A's FAILED created a retry next to the other holder"
    assert record_now["taskId"] == other.task_id
    assert (record_now["status"], record_now["pollCount"], record_now["workerId"]) == (
        "IN_PROGRESS", 2, "other-holder"), "A's FAILED landed on the other holder's delivery"
    assert "no longer ours (the task was polled again by worker 'other-holder' (pollCount 2, ours 1))" in err
    assert code == exitcodes.TASK_FAILED, err  # (--max-tasks: a task fenced here counts as not done)
    # The other holder's result is the one the server keeps.
    world.client.request("POST", "/tasks", json_body={
        "taskId": other.task_id, "workflowInstanceId": wf, "status": "COMPLETED",
        "workerId": "other-holder"}, accept="*/*")  # fmt: skip
    assert wait_until(lambda: world.workflow_status(wf) == "COMPLETED", 30)
