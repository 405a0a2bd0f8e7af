"""A conductor-python 2.0.0 worker, run as a subprocess by ``test_sdk_lease.py``.

    python -m tests.integration.sdk_worker SERVER_API_URL TASK_TYPE on|off [LEASE_TICK_SECONDS]

The task function sleeps ``inputData.sleep`` seconds and completes. It is a module-level function so
the SDK's ``spawn`` worker processes can import it. The parent test owns this process's group and
kills all of it afterwards (the SDK leaves worker processes behind when only its parent dies).

``LEASE_TICK_SECONDS`` (exported as ``SDK_LEASE_TICK_SECONDS`` so the SDK's spawned worker process,
which re-imports this module, sees it too) creates the SDK's process-wide ``LeaseManager`` with that
check interval instead of its default 1 s. With the default tick the SDK sends its heartbeats
``ceil(0.8 * R)`` seconds apart, which for R = 2, 3 and 4 is exactly R: too late for a server that
checks ``now - updateTime >= R`` at the deadline.
"""

# No ``from __future__ import annotations``: the SDK compares the parameter's annotation with its Task
# class to decide whether to pass the whole task, so it must be the real class, not a string.
import os
import sys
import time
from typing import Any

from conductor.client.automator.lease_tracker import LeaseManager
from conductor.client.automator.task_handler import TaskHandler
from conductor.client.configuration.configuration import Configuration
from conductor.client.http.models.task import Task
from conductor.client.worker.worker import Worker

if os.environ.get("SDK_LEASE_TICK_SECONDS"):
    LeaseManager.get_instance(check_interval=float(os.environ["SDK_LEASE_TICK_SECONDS"]))


def sleep_then_complete(task: Task) -> dict[str, Any]:
    seconds = float((task.input_data or {}).get("sleep", 5))
    time.sleep(seconds)
    return {"slept": seconds}


def main(argv: list[str]) -> None:
    url, task_type, lease = argv[1], argv[2], argv[3] == "on"
    if len(argv) > 4:
        os.environ["SDK_LEASE_TICK_SECONDS"] = argv[4]
    worker = Worker(
        task_type,
        sleep_then_complete,
        poll_interval=100,
        worker_id=f"sdk-{'lease' if lease else 'nolease'}",
        lease_extend_enabled=lease,
    )
    handler = TaskHandler(
        workers=[worker],
        configuration=Configuration(server_api_url=url),
        scan_for_annotated_workers=False,
        monitor_processes=False,
    )
    handler.start_processes()
    print("started", flush=True)
    handler.join_processes()


if __name__ == "__main__":
    main(sys.argv)
