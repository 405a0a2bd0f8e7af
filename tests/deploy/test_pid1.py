"""conductor-run as PID 1 (a container without an init): SIGTERM still stops it cleanly, after its
task is fenced and reported. Run in a new PID namespace (``unshare --pid``); skipped where that is not
allowed. (Why the Containerfile still puts tini in front: docs/deployment.md, "Containers".)"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from cli import exitcodes
from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.server import EmbeddedServer
from tests.support import wait_until

UNSHARE = shutil.which("unshare")


def unshare_argv() -> list[str] | None:
    """``unshare`` options that give a new PID namespace here (as root, or in a user namespace)."""
    if UNSHARE is None:
        return None
    for options in (["--pid", "--fork", "--mount-proc"],
                    ["--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]):
        probe = subprocess.run([UNSHARE, *options, "true"], capture_output=True, timeout=30, check=False)
        if probe.returncode == 0:
            return [UNSHARE, *options]
    return None


UNSHARE_ARGV = unshare_argv()


def pid_in_its_namespace(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise AssertionError("no NSpid line")


@pytest.mark.skipif(UNSHARE_ARGV is None, reason="no new PID namespace can be made here (unshare --pid)")
def test_as_pid_1_sigterm_fences_and_reports_the_task_then_exits_143(tmp_path: Path) -> None:
    assert UNSHARE_ARGV is not None
    task_type = f"pid1_{uuid.uuid4().hex[:8]}"
    with EmbeddedServer() as server, ConductorClient(server.url) as client:
        admin = ConductorAdmin(client)
        admin.register_task_defs([{"name": task_type, "responseTimeoutSeconds": 30, "retryCount": 0}])
        admin.register_workflow({"name": f"wf_{task_type}", "version": 1, "schemaVersion": 2,
                                 "tasks": [{"name": task_type, "taskReferenceName": "s", "type": "SIMPLE"}]})
        workflow_id = admin.start_workflow(f"wf_{task_type}", {})
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
        argv = [*UNSHARE_ARGV, sys.executable, "-m", "cli", "run", "--server", server.url,
                "--task-type", task_type, "--worker-id", "pid1", "--state-dir", str(tmp_path / "state"),
                "--poll-timeout", "500", "--kill-grace", "2",
                "--", "/bin/sh", "-c", "sleep 300 & sleep 300"]
        log = tmp_path / "runner.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        try:
            def task() -> dict[str, object]:
                tasks = admin.get_workflow(workflow_id).get("tasks") or [{}]
                return dict(tasks[-1])

            wait_until(lambda: "started: pid" in log.read_text(), 60, "the task to start")
            assert task()["status"] == "IN_PROGRESS"
            (runner,) = psutil.Process(proc.pid).children()  # unshare's child: the namespace's init
            assert pid_in_its_namespace(runner.pid) == 1
            os.kill(runner.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == exitcodes.SIGTERM, log.read_text()
            final = task()
            assert (final["status"], final["reasonForIncompletion"]) == ("FAILED", "worker shutting down")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
