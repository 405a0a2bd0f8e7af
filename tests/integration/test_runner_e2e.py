"""End to end: the real ``conductor-run run`` process against the embedded server, real children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from cli import exitcodes
from leasecore.conductor import ConductorAdmin, ConductorClient
from leasecore.server import EmbeddedServer
from tests.faultproxy import FaultProxy

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = str(ROOT / "sample_tasks" / "sleeper.sh")
FAILER = str(ROOT / "sample_tasks" / "failer.sh")


def wait_until(predicate: Callable[[], Any], timeout_seconds: float = 30.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_seconds}s waiting for {what}")
        time.sleep(0.05)  # polling interval of a condition wait, not a wait for something


class World:
    """One embedded server, a task type with a short responseTimeoutSeconds, and the runner processes."""

    def __init__(self, tmp_path: Path, server: EmbeddedServer) -> None:
        self.tmp = tmp_path
        self.server = server
        self.client = ConductorClient(server.url)
        self.admin = ConductorAdmin(self.client)
        self.task_type = f"job_{uuid.uuid4().hex[:8]}"
        self.state_dir = tmp_path / "state"
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: dict[int, Path] = {}

    def stderr(self, proc: subprocess.Popen[str]) -> str:
        return self.logs[proc.pid].read_text()

    def finish(self, proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[int, str]:
        proc.wait(timeout=timeout)
        return proc.returncode, self.stderr(proc)

    def define(self, *, response_timeout: int = 2, retry_count: int = 0) -> None:
        self.admin.register_task_defs(
            [
                {
                    "name": self.task_type,
                    "responseTimeoutSeconds": response_timeout,
                    "retryCount": retry_count,
                    "retryDelaySeconds": 0,
                    "timeoutSeconds": 0,
                    "timeoutPolicy": "TIME_OUT_WF",
                }
            ]
        )
        self.admin.register_workflow(
            {
                "name": f"wf_{self.task_type}",
                "version": 1,
                "schemaVersion": 2,
                "tasks": [
                    {
                        "name": self.task_type,
                        "taskReferenceName": "step",
                        "type": "SIMPLE",
                        "inputParameters": {k: f"${{workflow.input.{k}}}" for k in ("seconds", "code")},
                    }
                ],
            }
        )

    def start_workflow(self, **input_data: Any) -> str:
        return self.admin.start_workflow(f"wf_{self.task_type}", input_data)

    def task_of(self, workflow_id: str) -> dict[str, Any]:
        tasks = self.admin.get_workflow(workflow_id).get("tasks") or [{}]
        return dict(tasks[-1])

    def workflow_status(self, workflow_id: str) -> str:
        return str(self.admin.get_workflow(workflow_id)["status"])

    def run(
        self, *args: str, url: str | None = None, command: list[str] | None = None
    ) -> subprocess.Popen[str]:
        argv = [
            sys.executable,
            "-m",
            "cli",
            "run",
            "--server",
            url or self.server.url,
            "--task-type",
            self.task_type,
            "--state-dir",
            str(self.state_dir),
            "--poll-timeout",
            "500",
            *args,
            "--",
            *(command or ["/bin/sh", SLEEPER]),
        ]
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
        log_path = self.tmp / f"runner-{len(self.procs)}.log"
        with open(log_path, "w") as log_file:  # stderr to a file: readable while the runner runs
            proc = subprocess.Popen(
                argv, cwd=self.tmp, env=env, stdout=subprocess.DEVNULL, stderr=log_file, text=True
            )
        self.procs.append(proc)
        self.logs[proc.pid] = log_path
        return proc

    def child_pids(self) -> list[int]:
        pids = []
        for path in self.state_dir.glob("runner-*.json"):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            pids += [t["child_pid"] for t in doc.get("tasks", []) if t.get("child_pid")]
        return pids

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
        self.client.close()


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


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
