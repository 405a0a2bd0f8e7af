"""Regressions of the guarantees an independent review found broken in the lease core and the runner:
the real ``conductor-run run`` against the embedded server, through the fault proxy where the server must be
out of reach. Each failed before its fix. Timing bounds carry slack for a loaded machine.
"""

from __future__ import annotations

import json
import signal
import time

import pytest

from cli import exitcodes
from tests.integration.helpers import World, all_gone, gone, tree_of
from tests.support import wait_until

SLACK = 2.5  # seconds of scheduling slack on a loaded 2-core machine


def wait_for_sleeping(world: World, workflow_id: str) -> None:
    def logged() -> bool:
        return "sleeping" in json.dumps(world.admin.get_logs(world.task_of(workflow_id)["taskId"]))

    wait_until(logged, what="the child to log that it sleeps")


# ---------------------------------------------------------------- heartbeat timeout above R


def test_a_heartbeat_timeout_above_r_never_lets_two_copies_run(world: World) -> None:
    """R = 2, --heartbeat-timeout 10, runner A cut off from the server: the server times the task out
    at R and hands the retry to runner B. A's tree must be dead by then (before: it ran ~8 s more)."""
    world.define(responseTimeoutSeconds=2, retryCount=1)
    wf = world.start_workflow(seconds=60)
    with world.proxy() as proxy:
        a = world.run("--heartbeat-timeout", "10", "--kill-grace", "1", url=proxy.url_for("/api"))
        (pid_a,) = wait_until(world.child_pids, what="runner A's child")
        wait_for_sleeping(world, wf)
        tree_a = tree_of(pid_a)
        proxy.set_mode("reset")  # A can no longer reach the server
        cut = time.monotonic()
        b = world.run("--kill-grace", "1")  # B reaches it directly and polls the retry
        overlap_at: float | None = None

        def a_dead_or_overlap() -> bool:
            nonlocal overlap_at
            if all_gone(tree_a):
                return True
            tasks = world.admin.get_workflow(wf)["tasks"]
            if len(tasks) > 1 and tasks[-1]["status"] == "IN_PROGRESS":
                overlap_at = time.monotonic() - cut
                return True
            return False

        wait_until(a_dead_or_overlap, timeout_seconds=30, what="A's tree fenced")
        assert overlap_at is None, f"the retry ran on B {overlap_at:.1f} s after the cut while A's tree lived"
        # The lease runs from A's last ack, sent before the cut: R, then TERM (a sleeper dies on it).
        assert time.monotonic() - cut < 2 + 1 + SLACK
        retry = wait_until(lambda: [t for t in world.admin.get_workflow(wf)["tasks"][1:]
                                    if t["status"] == "IN_PROGRESS"], what="B to run the retry")
        assert retry[0]["retryCount"] == 1
        proxy.set_mode("pass")
        for proc in (a, b):
            proc.send_signal(signal.SIGTERM)
            code, err = world.finish(proc)
            assert code == exitcodes.SIGTERM, err
    warning = "heartbeat_timeout 10s is capped at the task's responseTimeoutSeconds 2s"
    assert world.stderr(a).count(warning) == 1


# ---------------------------------------------------------------- JSON logs


def test_json_logs_are_json_on_every_line_from_every_module(world: World) -> None:
    """--log-format json: lines of leasecore.* loggers (heartbeat, supervisor, ...) went around the
    configured handler (plain text, no timestamp, INFO dropped)."""
    world.define(responseTimeoutSeconds=10)
    wf = world.start_workflow(seconds=60)
    proc = world.run("--log-format", "json", "--kill-grace", "1")
    (pid,) = wait_until(world.child_pids, what="the child to start")
    # the ownership check fences it: runner/leasing/engine.py logs
    world.admin.terminate_workflow(wf, "stop it")
    wait_until(lambda: gone(pid), timeout_seconds=20, what="the tree to be fenced")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    records = []
    for line in err.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pytest.fail(f"not a JSON line: {line!r}\n{err}")
    assert all({"time", "level", "logger", "message"} <= r.keys() for r in records)
    assert any(r["logger"].startswith("leasecore.") for r in records), err  # "no longer ours: ..."
    assert any(r["logger"].startswith("conductor_run.") and r["level"] == "info" for r in records), err


# ---------------------------------------------------------------- saved results of tasks since re-polled


def test_a_saved_result_is_not_delivered_over_another_workers_run(world: World) -> None:
    """A result kept in the outbox (the final update could not get through) is delivered at the next
    start only if nobody polled the task since: here another client re-queued it (bare IN_PROGRESS
    update) and another worker polled it, so our saved COMPLETED must not end that worker's run."""
    world.define(responseTimeoutSeconds=30)
    wf = world.start_workflow()
    with world.proxy() as proxy:
        code, err = world.strand_result(proxy)
        assert code == exitcodes.SIGTERM, err
        saved = list((world.state_dir / "outbox").glob("*.json"))
        assert len(saved) == 1 and json.loads(saved[0].read_text())["poll_count"] == 1
        # Another client re-queues the task and another worker polls it: pollCount 2, not ours
        stolen = world.steal(wf)
        task_id = stolen.task_id
        assert stolen.poll_count == 2
        proxy.set_mode("pass")
        code, err = world.finish(world.run("--once", "--once-wait", "1", url=proxy.url_for("/api")))
    assert code == exitcodes.NO_TASK, err
    task = world.task_of(wf)
    assert (task["status"], task["pollCount"], task["workerId"]) == ("IN_PROGRESS", 2, "other-worker")
    assert not list((world.state_dir / "outbox").glob("*.json"))
    assert err.count("dropping the saved result of task") == 1
    assert f"task {task_id} (COMPLETED): no longer ours: the task was polled again by worker " \
           "'other-worker' (pollCount 2, ours 1)" in err
