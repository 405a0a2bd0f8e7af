"""``ConductorClient.update_v2`` against the embedded server, which answers update-v2 as the 3.32.1 jar
does (docs/real-server-notes.md): the claimed task on a terminal update, 204 otherwise, 404 for an
unknown workflow; and the store's claim is the one a poll would have made."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from leasecore.conductor.client import ConductorAdmin, ConductorClient
from leasecore.errors import ConductorNotFound
from leasecore.models import TaskResult, TaskStatus
from leasecore.server import EmbeddedServer


@pytest.fixture
def client() -> Iterator[tuple[ConductorClient, ConductorAdmin]]:
    with EmbeddedServer() as server:
        c = ConductorClient(server.url)
        admin = ConductorAdmin(c)
        admin.register_task_defs([{"name": "job", "responseTimeoutSeconds": 60, "retryCount": 0}])
        admin.register_workflow({"name": "wf_job", "version": 1, "schemaVersion": 2,
                                 "tasks": [{"name": "job", "taskReferenceName": "j", "type": "SIMPLE"}]})
        try:
            yield c, admin
        finally:
            c.close()


def test_a_terminal_update_claims_the_next_task_and_then_there_is_none(
    client: tuple[ConductorClient, ConductorAdmin],
) -> None:
    c, admin = client
    first_wf, second_wf = admin.start_workflow("wf_job", {}), admin.start_workflow("wf_job", {})
    (first,) = c.poll("job", count=1, timeout_ms=100, worker_id="w1")
    nxt = c.update_v2(TaskResult(first.task_id, first.workflow_id, TaskStatus.COMPLETED, worker_id="w1"))
    assert nxt is not None and nxt.workflow_id != first.workflow_id
    assert {first.workflow_id, nxt.workflow_id} == {first_wf, second_wf}
    assert (nxt.poll_count, nxt.worker_id, nxt.task_type) == (1, "w1", "job")
    assert admin.get_workflow(first_wf)["status"] == "COMPLETED"
    # Nothing queued: 204, None; the update itself still landed.
    assert c.update_v2(TaskResult(nxt.task_id, nxt.workflow_id, TaskStatus.COMPLETED, worker_id="w1")) is None
    assert admin.get_workflow(second_wf)["status"] == "COMPLETED"


def test_a_yield_claims_nothing(client: tuple[ConductorClient, ConductorAdmin]) -> None:
    c, admin = client
    wf = admin.start_workflow("wf_job", {})
    admin.start_workflow("wf_job", {})
    (task,) = c.poll("job", count=1, timeout_ms=100, worker_id="w1")
    yielded = TaskResult(task.task_id, wf, TaskStatus.IN_PROGRESS, callback_after_seconds=0, worker_id="w1")
    assert c.update_v2(yielded) is None
    assert len(c.poll("job", count=5, timeout_ms=100, worker_id="w1")) == 2  # both queued, none claimed


def test_an_unknown_workflow_is_a_404(client: tuple[ConductorClient, ConductorAdmin]) -> None:
    c, _ = client
    with pytest.raises(ConductorNotFound) as raised:
        c.update_v2(TaskResult("nope", "nope", TaskStatus.COMPLETED, worker_id="w1"))
    assert raised.value.status_code == 404
