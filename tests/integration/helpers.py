"""Helpers for driving the real ``conductor-run run`` process against a Conductor server.

Shared by the end-to-end tests against the embedded server (``test_runner_e2e.py``) and against the
real Conductor OSS server (``test_real_server_e2e.py``): the server only needs a ``url``.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import psutil

from leasecore.conductor.client import ConductorAdmin, ConductorClient
from tests.faultproxy import FaultProxy
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = str(ROOT / "sample_tasks" / "sleeper.sh")
FAILER = str(ROOT / "sample_tasks" / "failer.sh")
# The credentials of the auth_world fixture (tests/conftest.py); the secret is unique per test run, so
# that no other process on the machine holds it (tests scan /proc for it).
AUTH_KEY = "e2e-key-id"
AUTH_SECRET = "e2e-secret-" + secrets.token_hex(12)


class HasUrl(Protocol):
    """A running Conductor server: ``EmbeddedServer`` or ``tests.realserver.RealConductorServer``."""

    @property
    def url(self) -> str: ...


class World:
    """One server (embedded or real), a task type with a short R, and the runner processes."""

    def __init__(
        self, tmp_path: Path, server: HasUrl, *, auth_key: str | None = None, auth_secret: str | None = None
    ) -> None:
        self.tmp = tmp_path
        self.server = server
        self.client = ConductorClient(server.url, auth_key=auth_key, auth_secret=auth_secret)
        self.admin = ConductorAdmin(self.client)
        self.task_type = f"job_{uuid.uuid4().hex[:8]}"
        self.state_dir = tmp_path / "state"
        self.procs: list[subprocess.Popen[str]] = []
        self.logs: dict[int, Path] = {}

    def proxy(self) -> FaultProxy:
        """A fault proxy in front of this world's server (use it as a context manager)."""
        host, _, port = self.server.url.split("//")[1].split("/")[0].partition(":")
        return FaultProxy(host, int(port))

    def strand_result(self, proxy: FaultProxy) -> tuple[int, str]:
        """Run one task through ``proxy`` and leave its COMPLETED result in the outbox: the proxy
        swallows the final update, and a second SIGTERM stops the runner's retries. The held bytes are
        then dropped (the proxy is left in RESET), so only the outbox can deliver the result.
        Returns the runner's exit code and stderr."""
        proc = self.run(url=proxy.url_for("/api"), command=self.gated_command())
        wait_until(self.child_pids, what="the child to start")
        proxy.set_mode("blackhole")  # the final update cannot get through
        self.gate.touch()  # only now may the child finish
        wait_until(lambda: "reporting COMPLETED" in self.stderr(proc), what="the child to finish")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in self.stderr(proc), what="the first signal handled")
        proc.send_signal(signal.SIGTERM)  # second signal: stop retrying, keep the result on disk
        code, err = self.finish(proc)
        proxy.set_mode("reset")
        wait_until(lambda: proxy.open_connections() == 0, what="the held connections to be cut")
        return code, err

    @property
    def gate(self) -> Path:
        """The file a ``gated_command`` child waits for before it exits 0."""
        return self.tmp / "gate"

    def gated_command(self) -> list[str]:
        """A child that ends only once the test creates ``gate``: the test, not the scheduler, decides
        when the task finishes (for example after a fault is in place)."""
        return ["/bin/sh", "-c", 'while [ ! -e "$1" ]; do sleep 0.02; done', "gated", str(self.gate)]

    def steal(self, workflow_id: str, worker_id: str = "other-worker") -> Any:
        """Another client re-queues the workflow's task (a bare IN_PROGRESS update) and another worker
        polls it: the task is someone else's now (its pollCount one higher). Returns that poll's task."""
        task_id = str(self.task_of(workflow_id)["taskId"])
        self.client.request("POST", "/tasks", json_body={
            "taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS"}, accept="*/*")
        (stolen,) = wait_until(lambda: self.client.poll(self.task_type, count=1, timeout_ms=100,
                                                        worker_id=worker_id), what="the re-poll")
        assert stolen.task_id == task_id
        return stolen

    def stderr(self, proc: subprocess.Popen[str]) -> str:
        return self.logs[proc.pid].read_text()

    def finish(self, proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[int, str]:
        proc.wait(timeout=timeout)
        return proc.returncode, self.stderr(proc)

    def define(self, *, response_timeout: int = 2, retry_count: int = 0,
               inputs: Sequence[str] = ("seconds", "code", "x"), **taskdef: Any) -> None:
        """Register the task def (``taskdef`` overrides any field: timeoutSeconds, ...) and a one-task
        workflow passing ``inputs`` (by default ``seconds``, ``code`` and ``x``) from the workflow's input."""
        td = {
            "name": self.task_type,
            "responseTimeoutSeconds": response_timeout,
            "retryCount": retry_count,
            "retryDelaySeconds": 0,
            "timeoutSeconds": 0,
            "timeoutPolicy": "TIME_OUT_WF",
        } | taskdef
        self.admin.register_task_defs([td])
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
                        "inputParameters": {k: f"${{workflow.input.{k}}}" for k in inputs},
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
        self,
        *args: str,
        url: str | None = None,
        command: list[str] | None = None,
        env: dict[str, str] | None = None,
        wrapper: list[str] | None = None,
    ) -> subprocess.Popen[str]:
        """Start ``conductor-run run`` with the machine's environment minus CONDUCTOR_*, plus ``env``
        (under ``wrapper``, a command that execs the rest: ``prlimit --nofile=...``, say)."""
        argv = [
            *(wrapper or []),
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
        base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
        log_path = self.tmp / f"runner-{len(self.procs)}.log"
        with open(log_path, "w") as log_file:  # stderr to a file: readable while the runner runs
            proc = subprocess.Popen(
                argv,
                cwd=self.tmp,
                env=base | (env or {}),
                stdout=subprocess.DEVNULL,
                stderr=log_file,
                text=True,
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


def tree_of(pid: int) -> list[int]:
    """``pid`` and its descendants right now (just ``pid`` once it is gone)."""
    try:
        return [pid] + [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return [pid]


def all_gone(pids: list[int]) -> bool:
    return all(gone(p) for p in pids)


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True
