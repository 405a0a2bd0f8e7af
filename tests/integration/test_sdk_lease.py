"""Acceptance test of the embedded server's leases: a real client (conductor-python 2.0.0) against the
embedded server.

With lease extension on, the SDK's ``extendLease`` heartbeats keep a task alive on the embedded server
past its ``responseTimeoutSeconds`` while the worker function sleeps 5 s, and the task completes.
Without lease extension, the same task is timed out by the server at R, and the worker's late
completion is silently ignored.

The SDK worker runs as a subprocess in its own process group (the SDK spawns worker, logger and
resource-tracker processes); the test kills the whole group and checks that nothing survives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from leasecore.server import EmbeddedServer
from tests.conformance.harness import Harness
from tests.support import wait_until

REPO = Path(__file__).resolve().parents[2]
RESPONSE_TIMEOUT_SECONDS = 2
SLEEP_SECONDS = 5


class _RequestLog:
    """Request lines from the embedded server's ``log`` hook (thread-safe)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, line: str) -> None:
        with self._lock:
            self._lines.append(line)

    def count(self, prefix: str) -> int:
        with self._lock:
            return sum(1 for line in self._lines if line.startswith(prefix))


@pytest.fixture
def served() -> Iterator[tuple[EmbeddedServer, _RequestLog, Harness]]:
    log = _RequestLog()
    with EmbeddedServer(log=log) as srv:
        harness = Harness(srv.url, "embedded")
        yield srv, log, harness
        harness.close()


def _group_members(pgid: int) -> list[psutil.Process]:
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _kill_group(proc: subprocess.Popen[bytes], seen: set[psutil.Process]) -> None:
    """TERM the worker's group, then KILL it; then make sure every process we saw is gone."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (proc.poll() is None or _group_members(proc.pid)):
            time.sleep(0.05)
        if proc.poll() is not None and not _group_members(proc.pid):
            break
    proc.wait(timeout=5)
    survivors = [c for c in seen if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    for child in survivors:
        child.kill()  # an escapee from the group: never left behind, but still a failure
    assert survivors == [], f"SDK processes survived the group kill: {survivors}"


def _run_case(
    served: tuple[EmbeddedServer, _RequestLog, Harness],
    tmp_path: Path,
    *,
    lease: bool,
    r: int = RESPONSE_TIMEOUT_SECONDS,
    sleep: float = SLEEP_SECONDS,
    lease_tick: float | None = None,
) -> dict[str, Any]:
    srv, log, api = served
    task_type = api.task_def(responseTimeoutSeconds=r, retryCount=0, retryDelaySeconds=0)
    wf = api.workflow_def(
        {
            "name": task_type,
            "taskReferenceName": "sdk",
            "inputParameters": {"sleep": "${workflow.input.sleep}"},
        }
    )
    workflow_id = api.start(wf, {"sleep": sleep})
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    env["PYTHONPATH"] = str(REPO)
    stderr = (tmp_path / "sdk.stderr").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.sdk_worker", srv.url, task_type, "on" if lease else "off"]
        + ([str(lease_tick)] if lease_tick is not None else []),
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
    seen: set[psutil.Process] = set()
    try:
        parent = psutil.Process(proc.pid)

        def polled() -> dict[str, Any] | None:
            seen.update(parent.children(recursive=True))
            task = api.tasks(workflow_id)[0]
            return task if task["pollCount"] > 0 else None

        polled_task = wait_until(polled, 60, "the SDK worker to poll the task")
        assert polled_task["workerId"] == f"sdk-{'lease' if lease else 'nolease'}"
        seen.update(parent.children(recursive=True))

        def finished() -> dict[str, Any] | None:
            wf_now = api.workflow(workflow_id)
            return wf_now if wf_now["status"] != "RUNNING" else None

        outcome = wait_until(finished, sleep + 30, "the workflow to end")
        if not lease:
            # The worker still finishes its 5 s and reports: that late update must change nothing.
            wait_until(
                lambda: log.count("POST /api/tasks/update-v2") + log.count("POST /api/tasks ") > 0,
                sleep + 30,
                "the worker's late update",
            )
        final = api.workflow(workflow_id)
        return {"outcome": outcome, "final": final, "heartbeats": log.count("POST /api/tasks ")}
    finally:
        _kill_group(proc, seen)
        stderr.close()


@pytest.mark.parametrize(
    ("r", "sleep", "lease_tick"),
    [
        # The acceptance case: R = 2 s, a 5 s task. The SDK's lease manager checks every 0.1 s here, so its
        # "heartbeat at 0.8 x R" rule holds (1.6 s); with its default 1 s tick it beats at exactly 2 s.
        pytest.param(2, 5.0, 0.1, id="r2-tick0.1"),
        # The SDK exactly as shipped: R = 5 is the smallest R where its ceil(0.8 x R) cadence (4 s)
        # leaves a margin below R.
        pytest.param(5, 12.0, None, id="r5-sdk-defaults"),
    ],
)
def test_sdk_with_lease_extension_completes_a_task_that_outlives_r(
    served: tuple[EmbeddedServer, _RequestLog, Harness],
    tmp_path: Path,
    r: int,
    sleep: float,
    lease_tick: float | None,
) -> None:
    result = _run_case(served, tmp_path, lease=True, r=r, sleep=sleep, lease_tick=lease_tick)
    final = result["final"]
    stderr_tail = (tmp_path / "sdk.stderr").read_text(errors="replace")[-2000:]
    assert final["status"] == "COMPLETED", (final.get("reasonForIncompletion"), stderr_tail)
    [task] = final["tasks"]
    assert task["status"] == "COMPLETED"
    assert task["outputData"] == {"slept": sleep}
    assert task["endTime"] - task["startTime"] >= sleep * 1000  # alive well past R
    assert result["heartbeats"] >= 2


def test_sdk_without_lease_extension_is_timed_out_at_r(
    served: tuple[EmbeddedServer, _RequestLog, Harness], tmp_path: Path
) -> None:
    result = _run_case(served, tmp_path, lease=False)
    assert result["outcome"]["status"] == "TIMED_OUT"
    final = result["final"]
    assert final["status"] == "TIMED_OUT"
    [task] = final["tasks"]
    assert task["status"] == "TIMED_OUT"
    assert task["reasonForIncompletion"].startswith(f"responseTimeout: {RESPONSE_TIMEOUT_SECONDS} exceeded")
    assert task["endTime"] - task["updateTime"] <= 0  # nothing touched it after the timeout
    assert "slept" not in task.get("outputData", {})
