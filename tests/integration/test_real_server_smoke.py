"""The real Conductor OSS server fixture works, and the worker protocol round-trips on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.realserver import (
    RealConductorServer,
    ensure_jar,
    find_java,
    process_group_alive,
)
from tests.support import wait_until

pytestmark = pytest.mark.real_server

REPO = Path(__file__).resolve().parents[2]


def test_fixture_serves_a_healthy_loopback_server(
    real_server_url: str, real_server: RealConductorServer
) -> None:
    assert real_server_url.startswith("http://127.0.0.1:")
    assert real_server_url.endswith("/api")
    health = requests.get(real_server_url.removesuffix("/api") + "/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["healthy"] is True
    assert real_server.pid is not None
    assert real_server.startup_seconds is not None
    rss = real_server.rss_bytes()
    assert rss is not None and rss > 0


@pytest.fixture
def http() -> Iterator[requests.Session]:
    with requests.Session() as session:
        yield session


def test_one_task_workflow_round_trip(real_server_url: str, http: requests.Session) -> None:
    api = real_server_url
    suffix = uuid.uuid4().hex[:8]
    task_type = f"smoke_{suffix}"
    r = http.post(f"{api}/metadata/taskdefs", timeout=10, json=[{
        "name": task_type, "retryCount": 0, "retryDelaySeconds": 0,
        "responseTimeoutSeconds": 5, "timeoutPolicy": "TIME_OUT_WF",
    }])
    assert r.status_code == 200, r.text
    r = http.post(f"{api}/metadata/workflow", timeout=10, json={
        "name": f"wf_{task_type}", "version": 1, "schemaVersion": 2,
        "tasks": [{"name": task_type, "taskReferenceName": "only", "type": "SIMPLE",
                   "inputParameters": {"greeting": "${workflow.input.greeting}"}}],
    })
    assert r.status_code == 200, r.text
    r = http.post(f"{api}/workflow/wf_{task_type}", timeout=10, json={"greeting": "hi"})
    assert r.status_code == 200, r.text
    workflow_id = r.text

    polled = http.get(f"{api}/tasks/poll/batch/{task_type}", timeout=10,
                      params={"count": 1, "timeout": 2000, "workerid": "smoke-worker"})
    assert polled.status_code == 200, polled.text
    [task] = polled.json()
    assert task["workflowInstanceId"] == workflow_id
    assert task["status"] == "IN_PROGRESS"
    assert task["inputData"] == {"greeting": "hi"}
    assert task["workerId"] == "smoke-worker"
    task_id = task["taskId"]

    lease = http.post(f"{api}/tasks", timeout=10, headers={"Accept": "text/plain"}, json={
        "taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS",
        "extendLease": True, "workerId": "smoke-worker",
    })
    assert (lease.status_code, lease.text) == (200, task_id)
    assert http.get(f"{api}/tasks/{task_id}", timeout=10).json()["status"] == "IN_PROGRESS"

    done = http.post(f"{api}/tasks", timeout=10, headers={"Accept": "text/plain"}, json={
        "taskId": task_id, "workflowInstanceId": workflow_id, "status": "COMPLETED",
        "outputData": {"answer": 42}, "workerId": "smoke-worker",
    })
    assert (done.status_code, done.text) == (200, task_id)
    # The decide runs inside the update call: the workflow is complete when it returns.
    workflow = http.get(f"{api}/workflow/{workflow_id}", timeout=10).json()
    assert workflow["status"] == "COMPLETED"
    assert workflow["tasks"][0]["outputData"] == {"answer": 42}


# A helper process that launches a server (without waiting for it) and then waits to be killed.
_HELPER = """
import sys, time
from pathlib import Path
from tests.realserver import RealConductorServer
server = RealConductorServer(Path(sys.argv[1]), sys.argv[2])
server.launch()
print(server.pid, server.workdir, flush=True)
time.sleep(600)
"""


def test_jvm_dies_with_a_sigkilled_test_process(tmp_path: Path) -> None:
    """If pytest is SIGKILLed, no JVM is left behind (parent-death signal set by the launcher)."""
    java, jar = find_java(), ensure_jar()
    helper = subprocess.Popen(
        [sys.executable, "-c", _HELPER, str(jar), java],
        cwd=REPO, stdout=subprocess.PIPE, text=True,
    )
    assert helper.stdout is not None
    pid_text, workdir = helper.stdout.readline().split()
    jvm_pid = int(pid_text)
    try:
        # The launcher has exec'd java (same pid) once its command line names the jar.
        wait_until(lambda: str(jar).encode() in Path(f"/proc/{jvm_pid}/cmdline").read_bytes(), 30,
                 "the launcher to exec java")
        helper.kill()
        helper.wait(timeout=10)
        wait_until(lambda: not process_group_alive(jvm_pid), 30, "the orphaned JVM to die")
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait(timeout=10)
        helper.stdout.close()
        shutil.rmtree(workdir, ignore_errors=True)


def test_stop_leaves_no_process_behind() -> None:
    server = RealConductorServer(ensure_jar(), find_java())
    server.launch()
    pid = server.pid
    assert pid is not None
    wait_until(lambda: process_group_alive(pid), 10, "the server to run")
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 60
    assert not process_group_alive(pid)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
