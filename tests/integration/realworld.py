"""``RealWorld``: the integration tests' ``World`` on the shared REAL Conductor OSS server.

The real-server end-to-end tests (``test_real_server_e2e.py``, ``test_stdio_real_server.py``) get one
through the ``real_world`` fixture (``tests/conftest.py``). Next to ``World``'s runner processes it
remembers the workflows it started and the task processes it saw, and at the end kills those
processes and terminates those workflows still RUNNING, so the one server the session shares stays
free of one test's leftovers (its sweeper would otherwise keep deciding them).

Every process of a task's tree carries ``CONDUCTOR_TASK_ID`` in its environment (escapees that left
the process group too): :func:`task_processes` finds the whole tree by it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from leasecore.errors import ConductorError
from tests.integration.helpers import World
from tests.support import wait_until

if TYPE_CHECKING:  # an annotation only: tests.realserver is loaded as a pytest plugin first
    from tests.realserver import RealConductorServer

DECIDE_EVERY_SECONDS = 0.5  # pace of the decide calls: each one is real work for the server


def task_processes(task_id: str) -> list[psutil.Process]:
    """Every live (non-zombie) process of this user whose environment says it belongs to ``task_id``."""
    uid = os.getuid()
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real != uid:
                continue
            if proc.environ().get("CONDUCTOR_TASK_ID") != task_id:
                continue
            if proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class RealWorld(World):
    """``World`` on the shared real server, tracking workflows and task processes for cleanup."""

    def __init__(self, tmp_path: Path, server: RealConductorServer) -> None:
        super().__init__(tmp_path, server)
        self.workflows: list[str] = []
        self.seen: list[psutil.Process] = []

    def start_workflow(self, **input_data: Any) -> str:
        workflow_id = super().start_workflow(**input_data)
        self.workflows.append(workflow_id)
        return workflow_id

    def task_id_of_running(self, workflow_id: str) -> str:
        """The task id once the runner has polled it and started its child."""
        wait_until(self.child_pids, what="the child to start")
        return str(self.task_of(workflow_id)["taskId"])

    def tree(self, task_id: str, *, at_least: int) -> list[psutil.Process]:
        """Wait for ``at_least`` live processes in the task's tree; remember them for cleanup."""
        procs: list[psutil.Process] = wait_until(
            lambda: (found if len(found := task_processes(task_id)) >= at_least else None),
            what=f"{at_least} processes in the tree of task {task_id}",
        )
        self.seen.extend(procs)
        return procs

    def decide_and_get_task(self, workflow_id: str) -> dict[str, Any]:
        """Force the server's timeout checks now, then read the task back."""
        self.admin.decide(workflow_id)
        return self.task_of(workflow_id)

    def close(self) -> None:
        try:
            super().close()  # SIGKILLs any runner still alive: its fork server then kills the trees
        finally:
            for proc in self.seen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()  # psutil checks the create time: never a recycled pid
            for workflow_id in self.workflows:  # keep the shared server's sweeper free of our leftovers
                with contextlib.suppress(ConductorError):
                    if self.workflow_status(workflow_id) == "RUNNING":
                        self.admin.terminate_workflow(workflow_id, "test cleanup")
            self.client.close()


def all_dead(procs: list[psutil.Process]) -> bool:
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            continue
    return True
