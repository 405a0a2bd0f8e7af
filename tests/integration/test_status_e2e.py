"""`conductor-run status` reading what a real `conductor-run run` publishes.

The runner and the status command are separate processes, as on a real host: the only thing they share
is the state directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from datetime import datetime
from typing import Any

import psutil
import pytest

from tests.integration.helpers import World
from tests.support import wait_until


def status(world: World, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    return subprocess.run(
        [sys.executable, "-m", "cli", "status", "--state-dir", str(world.state_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def status_json(world: World) -> dict[str, Any]:
    proc = status(world, "--json")
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_status_shows_a_live_runner_its_task_and_a_lease_kept_alive(world: World) -> None:
    world.define(response_timeout=2)
    workflow_id = world.start_workflow(seconds=8)
    runner = world.run("--worker-id", "status-e2e")
    task_id = wait_until(lambda: world.task_of(workflow_id).get("taskId"), what="the task to be scheduled")

    def task_with_a_heartbeat() -> dict[str, Any] | None:
        # A heartbeat has been acknowledged once last_ack_at moved past the poll (started_at).
        for r in status_json(world)["runners"]:
            for t in r["tasks"]:
                beaten = when(t["last_ack_at"]) > when(t["started_at"])
                if t["task_id"] == task_id and t["child_pid"] and beaten:
                    return {"runner": r, "task": t}
        return None

    found = wait_until(task_with_a_heartbeat, timeout_seconds=20, what="a heartbeat in the snapshot")
    snap, task = found["runner"], found["task"]

    assert snap["stale"] is False
    assert snap["pid"] == runner.pid
    assert snap["runner"]["worker_id"] == "status-e2e"
    assert snap["runner"]["server_url"] == world.server.url
    assert world.task_type in snap["runner"]["task_types"]
    assert task["workflow_id"] == workflow_id
    assert task["task_type"] == world.task_type
    assert task["state"] == "running"
    assert task["health"] == "healthy"
    assert psutil.Process(task["child_pid"]).is_running()
    assert when(task["lease_deadline_at"]) > when(task["last_ack_at"])
    assert task["lease_timeout_seconds"] == pytest.approx(2)

    # One task by id (or a prefix), human view, with the child's recent output.
    one = status(world, task_id[:8])
    assert one.returncode == 0, one.stderr
    assert task_id in one.stdout
    assert "sleeping 8s" in one.stdout

    # The task outlives R thanks to heartbeats and completes; then the runner has no task in flight.
    wait_until(lambda: world.workflow_status(workflow_id) == "COMPLETED", timeout_seconds=30)
    wait_until(
        lambda: all(not r["tasks"] for r in status_json(world)["runners"]),
        what="the finished task to leave the snapshot",
    )


def test_a_killed_runner_shows_as_stale_and_prune_removes_it(world: World) -> None:
    world.define(response_timeout=5)
    runner = world.run()
    wait_until(lambda: status_json(world)["runners"], what="the runner's first snapshot")

    runner.send_signal(signal.SIGKILL)
    runner.wait(timeout=30)

    def stale_runner() -> dict[str, Any] | None:
        runners = status_json(world)["runners"]
        return next((r for r in runners if r["pid"] == runner.pid and r["stale"]), None)

    stale = wait_until(stale_runner, what="the killed runner to be stale")
    assert stale["stale_reason"] == "runner process is gone"
    assert "STALE" in status(world).stdout

    pruned = status(world, "--prune", "--json")
    assert pruned.returncode == 0, pruned.stderr
    assert json.loads(pruned.stdout)["runners"] == []
