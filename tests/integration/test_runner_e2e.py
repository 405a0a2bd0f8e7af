"""End to end: the real ``conductor-run run`` process against the embedded server, real children."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli import exitcodes
from leasecore.server import EmbeddedServer
from tests.faultproxy import FaultProxy
from tests.integration.helpers import FAILER, World, gone, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    with EmbeddedServer() as server:
        w = World(tmp_path, server)
        try:
            yield w
        finally:
            w.close()


def test_a_long_task_outlives_its_response_timeout_thanks_to_heartbeats(world: World) -> None:
    world.define(response_timeout=2)
    wf = world.start_workflow(seconds=5)
    code, err = world.finish(world.run("--once"))
    assert code == exitcodes.OK, err
    assert world.workflow_status(wf) == "COMPLETED"
    task = world.task_of(wf)
    assert task["pollCount"] == 1 and task["outputData"]["slept"] == 5
    logs = [entry["log"] for entry in world.admin.get_logs(task["taskId"])]
    assert any("sleeping 5s" in line for line in logs)


def test_once_exit_codes_for_failed_and_for_nothing(world: World) -> None:
    world.define(response_timeout=10)
    world.start_workflow(code=3)
    code, err = world.finish(world.run("--once", command=["/bin/sh", FAILER]))
    assert code == exitcodes.TASK_FAILED, err
    code, err = world.finish(world.run("--once"))
    assert code == exitcodes.NO_TASK, err


def test_server_unreachable_at_start_is_a_clear_error(world: World) -> None:
    with FaultProxy("127.0.0.1", 9) as proxy:  # port 9 (discard): nothing listens there
        proxy.set_mode("refuse")
        code, err = world.finish(world.run("--once", url=proxy.url_for("/api")))
    assert code == exitcodes.UNREACHABLE
    assert "server unreachable" in err and "Traceback" not in err


def test_sigterm_stops_the_child_and_reports_failed_promptly(world: World) -> None:
    world.define(response_timeout=30, retry_count=1)
    wf = world.start_workflow(seconds=60)
    proc = world.run()
    (pid,) = wait_until(world.child_pids, what="the child to start")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc, timeout=30)
    assert code == exitcodes.SIGTERM, err
    assert gone(pid)
    first = world.admin.get_workflow(wf)["tasks"][0]
    assert first["status"] == "FAILED" and first["reasonForIncompletion"] == "worker shutting down"


def test_drain_lets_the_task_finish_while_heartbeating(world: World) -> None:
    world.define(response_timeout=2)
    wf = world.start_workflow(seconds=4)
    proc = world.run("--drain", "--drain-timeout", "60")
    wait_until(world.child_pids, what="the child to start")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc, timeout=60)
    assert code == exitcodes.SIGTERM, err
    assert world.workflow_status(wf) == "COMPLETED"  # outlived R=2 while draining


def test_a_terminated_workflow_kills_its_child(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow(seconds=60)
    proc = world.run()
    (pid,) = wait_until(world.child_pids, what="the child to start")
    world.admin.terminate_workflow(wf, "changed my mind")
    wait_until(lambda: gone(pid), timeout_seconds=20, what="the child to be killed")
    assert proc.poll() is None  # the runner itself keeps serving
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def test_a_silent_server_means_the_tree_is_dead_by_the_lease_deadline(world: World) -> None:
    world.define(response_timeout=3)
    wf = world.start_workflow(seconds=120)
    host, port = world.server.url.split("//")[1].split("/")[0].split(":")
    with FaultProxy(host, int(port)) as proxy:
        proc = world.run("--kill-grace", "1", url=proxy.url_for("/api"))
        (pid,) = wait_until(world.child_pids, what="the child to start")
        silenced_at = time.monotonic()
        proxy.set_mode("blackhole")
        wait_until(lambda: gone(pid), timeout_seconds=30, what="the child to be fenced")
        # R (3 s) from the last acknowledged heartbeat, at most, plus the 1 s grace and slack.
        assert time.monotonic() - silenced_at < 3 + 1 + 4
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "lease" in err.lower()
    del wf


def test_concurrent_tasks_overlap(world: World) -> None:
    world.define(response_timeout=10)
    wfs = [world.start_workflow(seconds=2) for _ in range(3)]
    code, err = world.finish(world.run("--concurrency", "3", "--max-tasks", "3"))
    assert code == exitcodes.OK, err
    tasks = [world.task_of(wf) for wf in wfs]
    assert all(t["status"] == "COMPLETED" for t in tasks)
    span_ms = max(t["endTime"] for t in tasks) - min(t["startTime"] for t in tasks)
    assert span_ms < 5000  # one after the other would take over 6 s


def test_an_undelivered_result_is_delivered_on_the_next_start(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow(seconds=2)
    host, port = world.server.url.split("//")[1].split("/")[0].split(":")
    with FaultProxy(host, int(port)) as proxy:
        proc = world.run(url=proxy.url_for("/api"))
        wait_until(world.child_pids, what="the child to start")
        proxy.set_mode("blackhole")  # the final update cannot get through
        wait_until(lambda: "reporting COMPLETED" in world.stderr(proc), what="the child to finish")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in world.stderr(proc), what="the first signal handled")
        proc.send_signal(signal.SIGTERM)  # second signal: stop retrying, keep the result on disk
        code, err = world.finish(proc)
        assert code == exitcodes.SIGTERM, err
        assert list((world.state_dir / "outbox").glob("*.json"))
        assert world.workflow_status(wf) == "RUNNING"
        proxy.set_mode("pass")
        code, err = world.finish(world.run("--once", url=proxy.url_for("/api")))
    assert code == exitcodes.NO_TASK, err
    assert world.workflow_status(wf) == "COMPLETED"
    assert not list((world.state_dir / "outbox").glob("*.json"))
