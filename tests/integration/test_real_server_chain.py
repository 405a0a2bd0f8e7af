"""update-v2 chaining against the real Conductor OSS server (3.32.1 jar): what hands a claimed task back
soonest, and the runner chaining through update-v2 and handing back what it claims while it stops.

The runner talks to the server through a ``RewritingRelay`` that records every call (so the test
sees update-v2 used) and can hold an update-v2 until the test lets it through.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cli import exitcodes
from leasecore.handover import YIELD_MARKER, follows_our_yield
from leasecore.models import TaskResult, TaskStatus
from leasecore.runner.chain import hand_back
from tests.integration.helpers import wait_until
from tests.integration.rewriting_relay import RewritingRelay
from tests.integration.test_real_server_e2e import RealWorld
from tests.realserver import RealConductorServer

pytestmark = [pytest.mark.real_server, pytest.mark.slow]

RECORD = 'echo "$CONDUCTOR_TASK_ID $CONDUCTOR_POLL_COUNT" >> "$1"'


@pytest.fixture
def world(tmp_path: Path, real_server: RealConductorServer) -> Iterator[RealWorld]:
    w = RealWorld(tmp_path, real_server)
    try:
        yield w
    finally:
        w.close()


def record(runs: Path) -> list[str]:
    return ["/bin/sh", "-c", RECORD, "job", str(runs)]


def is_v2(path: str) -> bool:
    return path.split("?")[0].endswith("/api/tasks/update-v2")


def test_a_bare_in_progress_update_hands_a_claimed_task_back_at_once(world: RealWorld) -> None:
    """``hand_back``'s update (IN_PROGRESS, callbackAfterSeconds 0, our yield marker) makes the task
    SCHEDULED again at once: the next poll gets it (pollCount 2) well inside a second, not after R,
    and it follows our yield, so its next holder starts it without a wait."""
    world.define(response_timeout=60)
    wf = world.start_workflow()
    (task,) = wait_until(lambda: world.client.poll(world.task_type, count=1, timeout_ms=500, worker_id="w1"),
                         what="the first poll")
    sent = time.monotonic()
    world.client.update(hand_back(task, "w1"))
    (again,) = wait_until(lambda: world.client.poll(world.task_type, count=1, timeout_ms=100, worker_id="w2"),
                          timeout_seconds=10, what="the re-poll", interval_seconds=0.01)
    took = time.monotonic() - sent
    assert again.task_id == task.task_id and again.poll_count == 2
    assert follows_our_yield(again)
    assert took < 2.0, f"re-polled {took:.2f} s after the hand-back"
    world.client.update(TaskResult(again.task_id, wf, TaskStatus.COMPLETED, worker_id="w2"))
    wait_until(lambda: world.workflow_status(wf) == "COMPLETED", what="the workflow")


def test_the_runner_chains_through_update_v2_on_the_real_server(world: RealWorld, tmp_path: Path) -> None:
    world.define(response_timeout=60)
    runs = tmp_path / "runs"
    wfs = [world.start_workflow(x=i) for i in range(8)]
    with RewritingRelay(world.server.url) as relay:
        proc = world.run("--concurrency", "2", url=relay.url, command=record(runs))
        wait_until(lambda: all(world.workflow_status(wf) == "COMPLETED" for wf in wfs), timeout_seconds=120,
                   what="8 workflows", interval_seconds=0.5)
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
        v2 = [c for c in relay.calls() if c.method == "POST" and is_v2(c.path)]
    assert code in (exitcodes.SIGTERM, exitcodes.OK), err
    ran = [line.split() for line in runs.read_text().splitlines()]
    task_ids = {str(world.task_of(wf)["taskId"]) for wf in wfs}
    assert sorted(t for t, _ in ran) == sorted(task_ids) and {n for _, n in ran} == {"1"}  # each once
    assert len(v2) >= 6 and all(c.status in (200, 204) for c in v2), v2  # 2 polled, the rest chained


def test_a_task_claimed_as_the_runner_stops_is_back_in_the_real_queue_at_once(
    world: RealWorld, tmp_path: Path
) -> None:
    world.define(response_timeout=60)
    runs = tmp_path / "runs"
    first, second = world.start_workflow(x=1), world.start_workflow(x=2)
    entered, gate = threading.Event(), threading.Event()

    def hold_v2(method: str, path: str, body: Any) -> int | None:
        if method == "POST" and is_v2(path):
            entered.set()
            gate.wait(30)  # then forwarded: the server applies it and claims the next task
        return None

    with RewritingRelay(world.server.url) as relay:
        relay.rule = hold_v2
        proc = world.run("--concurrency", "1", url=relay.url, command=record(runs))
        assert entered.wait(60), "no update-v2 came"
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in world.stderr(proc), what="the stop to begin")
        released = time.monotonic()
        gate.set()
        code, err = world.finish(proc)
    assert code in (exitcodes.SIGTERM, exitcodes.OK), err
    assert "as the runner began to stop; handing it back" in err
    ran = [line.split()[0] for line in runs.read_text().splitlines()]
    assert ran == [str(world.task_of(first)["taskId"])]  # the claimed one never ran
    back = wait_until(lambda: (t if (t := world.task_of(second))["status"] == "SCHEDULED" else None),
                      timeout_seconds=10, what="the claimed task back in the queue", interval_seconds=0.1)
    assert time.monotonic() - released < 15  # not R (60 s) later
    assert back["outputData"].get(YIELD_MARKER) == 1
    (again,) = wait_until(lambda: world.client.poll(world.task_type, count=1, timeout_ms=500, worker_id="w2"),
                          what="the re-poll")
    assert again.poll_count == 2 and follows_our_yield(again)
    world.client.update(TaskResult(again.task_id, second, TaskStatus.COMPLETED, worker_id="w2"))
