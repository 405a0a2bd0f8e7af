"""What making final results stick costs (docs/final-results.md): the common path's lookup per final
update, a whole guarded update against a no-op port, and one read-back (``GET /api/tasks/{id}``)
against the embedded server on loopback. Standalone: ``.venv/bin/python -m bench.finalcheck_cost``."""

from __future__ import annotations

import statistics
import time
from typing import Any

from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.lease import LeasePolicy
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.server import EmbeddedServer

TASKS = 20_000
READS = 500


class _NoServer:
    """A lease and update port that answers at once."""

    def extend_lease(self, *args: Any, **kwargs: Any) -> None: ...
    def get_task_ownership(self, *args: Any, **kwargs: Any) -> None: ...
    def update(self, *args: Any, **kwargs: Any) -> None: ...


def main() -> None:
    engine = LeaseEngine(_NoServer(), lambda *args: None)
    policy = LeasePolicy(response_timeout_seconds=60, ownership_check_interval_seconds=0)
    for i in range(TASKS):
        engine.track(Task(task_id=f"t{i}", workflow_id="w", task_type="x", response_timeout_seconds=60,
                          poll_count=1), policy)  # fmt: skip
    started = time.perf_counter()
    for i in range(TASKS):
        engine.late_beats(f"t{i}")
    print(f"late_beats, none (the common path): {(time.perf_counter() - started) / TASKS * 1e6:.2f} us")
    updates = FinalUpdates(_NoServer(), engine)
    started = time.perf_counter()
    for i in range(TASKS):
        updates.update(TaskResult(f"t{i}", "w", TaskStatus.COMPLETED))
    print(f"a guarded final update, no-op port: {(time.perf_counter() - started) / TASKS * 1e6:.2f} us")
    with EmbeddedServer() as server:
        client = ConductorClient(server.url)
        admin = ConductorAdmin(client)
        admin.register_task_defs([{"name": "x", "responseTimeoutSeconds": 10}])
        admin.register_workflow({"name": "wf", "version": 1, "schemaVersion": 2,
                                 "tasks": [{"name": "x", "taskReferenceName": "s", "type": "SIMPLE"}]})
        admin.start_workflow("wf", {})
        [task] = client.poll("x", count=1, timeout_ms=100)
        times = []
        for _ in range(READS):
            started = time.perf_counter()
            client.get_task_ownership(task.task_id, timeout_seconds=5)
            times.append(time.perf_counter() - started)
        times.sort()
        print(f"one read-back, embedded server on loopback: median {statistics.median(times) * 1e3:.2f} ms, "
              f"p99 {times[int(0.99 * len(times))] * 1e3:.2f} ms")
        client.close()


if __name__ == "__main__":
    main()
