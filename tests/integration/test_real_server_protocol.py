"""Protocol facts that conductor-run (runner and embedded server) relies on, checked on the real server.

Each test is evidence for a line of docs/real-server-notes.md; keep the two in step.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests

from tests.support import wait_until

pytestmark = pytest.mark.real_server

TEXT = {"Accept": "text/plain"}


@dataclass
class Api:
    url: str
    http: requests.Session

    def call(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.http.request(method, self.url + path, timeout=30, **kwargs)

    def task_type(self, *, response_timeout: int = 30, **extra: Any) -> str:
        """Register a fresh task type and a one-task workflow named ``wf_<type>``."""
        name = f"rs_{uuid.uuid4().hex[:10]}"
        definition = {"name": name, "retryCount": 0, "retryDelaySeconds": 0,
                      "responseTimeoutSeconds": response_timeout, "timeoutPolicy": "TIME_OUT_WF", **extra}
        assert self.call("POST", "/metadata/taskdefs", json=[definition]).status_code == 200
        workflow = {"name": f"wf_{name}", "version": 1, "schemaVersion": 2,
                    "tasks": [{"name": name, "taskReferenceName": "t1", "type": "SIMPLE"}]}
        assert self.call("POST", "/metadata/workflow", json=workflow).status_code == 200
        return name

    def start(self, task_type: str) -> str:
        r = self.call("POST", f"/workflow/wf_{task_type}", json={})
        assert r.status_code == 200, r.text
        return r.text

    def poll(self, task_type: str, worker: str = "w1") -> dict[str, Any]:
        r = self.call("GET", f"/tasks/poll/batch/{task_type}",
                      params={"count": 1, "timeout": 3000, "workerid": worker})
        assert r.status_code == 200, r.text
        [task] = r.json()
        return dict(task)

    def started_task(self, task_type: str) -> tuple[str, str]:
        workflow_id = self.start(task_type)
        task = self.poll(task_type)
        assert task["workflowInstanceId"] == workflow_id
        return workflow_id, str(task["taskId"])

    def update(self, body: dict[str, Any]) -> requests.Response:
        return self.call("POST", "/tasks", json=body, headers=TEXT)

    def lease(self, workflow_id: str, task_id: str) -> requests.Response:
        return self.update({"taskId": task_id, "workflowInstanceId": workflow_id, "extendLease": True})

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.call("GET", f"/tasks/{task_id}")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def workflow(self, workflow_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/workflow/{workflow_id}").json())


@pytest.fixture
def api(real_server_url: str) -> Iterator[Api]:
    with requests.Session() as http:
        yield Api(real_server_url, http)


def test_taskdef_validation_errors(api: Api) -> None:
    r = api.call("POST", "/metadata/taskdefs", json=[{"name": "rs_r0", "responseTimeoutSeconds": 0}])
    assert r.status_code == 400
    assert r.json()["validationErrors"] == [{
        "path": "registerTaskDef.arg0[0].responseTimeoutSeconds",
        "message": "TaskDef responseTimeoutSeconds: 0 should be minimum 1 second",
        "invalidValue": "0",
    }]
    r = api.call("POST", "/metadata/taskdefs",
                 json=[{"name": "rs_big_r", "responseTimeoutSeconds": 20, "timeoutSeconds": 10}])
    assert r.status_code == 400
    assert r.json()["validationErrors"] == [{
        "path": "registerTaskDef.arg0[0]",
        "message": "TaskDef: rs_big_r responseTimeoutSeconds: 20 must be less than timeoutSeconds: 10",
    }]
    r = api.call("POST", "/metadata/taskdefs",
                 json=[{"name": "rs_equal_r", "responseTimeoutSeconds": 10, "timeoutSeconds": 10}])
    assert r.status_code == 200


def test_duplicate_workflow_def_is_a_409_unless_overwrite(api: Api) -> None:
    task_type = api.task_type()
    workflow = {"name": f"wf_{task_type}", "version": 1, "schemaVersion": 2,
                "tasks": [{"name": task_type, "taskReferenceName": "t1", "type": "SIMPLE"}]}
    r = api.call("POST", "/metadata/workflow", json=workflow)
    assert r.status_code == 409
    assert r.json()["message"] == f"Workflow with wf_{task_type}.1 already exists!"
    r = api.call("POST", "/metadata/workflow", params={"overwrite": "true"}, json=workflow)
    assert r.status_code == 200


def test_empty_polls(api: Api) -> None:
    task_type = api.task_type()
    batch = api.call("GET", f"/tasks/poll/batch/{task_type}", params={"count": 5, "timeout": 100})
    assert (batch.status_code, batch.json()) == (200, [])
    single = api.call("GET", f"/tasks/poll/{task_type}")
    assert (single.status_code, single.text) == (204, "")


def test_long_poll_timeout_above_5000_is_a_400(api: Api) -> None:
    r = api.call("GET", f"/tasks/poll/batch/{api.task_type()}", params={"count": 1, "timeout": 6000})
    assert r.status_code == 400
    assert r.json()["message"] == "Long Poll Timeout value cannot be more than 5 seconds"
    assert r.json()["retryable"] is False


def test_poll_sets_lease_fields(api: Api) -> None:
    task_type = api.task_type()
    api.start(task_type)
    task = api.poll(task_type, worker="polling-worker")
    assert task["status"] == "IN_PROGRESS"
    assert task["pollCount"] == 1
    assert task["workerId"] == "polling-worker"
    assert task["callbackAfterSeconds"] == 0
    assert task["responseTimeoutSeconds"] == 30
    assert "timeoutSeconds" not in task
    assert task["workflowTask"]["taskDefinition"]["timeoutSeconds"] == 0


def test_extend_lease_refreshes_update_time_only(api: Api) -> None:
    task_type = api.task_type()
    workflow_id, task_id = api.started_task(task_type)
    before = api.task(task_id)
    r = api.lease(workflow_id, task_id)
    assert (r.status_code, r.text) == (200, task_id)
    after = api.task(task_id)
    assert after["status"] == "IN_PROGRESS"
    assert after["updateTime"] >= before["updateTime"]
    assert after["pollCount"] == before["pollCount"]
    # No re-queue: nothing to poll.
    empty = api.call("GET", f"/tasks/poll/batch/{task_type}", params={"count": 1, "timeout": 500})
    assert empty.json() == []


def test_bare_in_progress_update_requeues(api: Api) -> None:
    task_type = api.task_type()
    workflow_id, task_id = api.started_task(task_type)
    first = api.task(task_id)
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS"})
    assert (r.status_code, r.text) == (200, task_id)
    assert api.task(task_id)["status"] == "SCHEDULED"
    again = api.poll(task_type, worker="other-worker")
    assert again["taskId"] == task_id
    assert again["pollCount"] == 2
    assert again["workerId"] == "other-worker"
    assert again["startTime"] == first["startTime"]


def test_an_in_progress_updates_output_comes_back_with_the_next_poll(api: Api) -> None:
    # conductor-run marks its own yields in outputData (leasecore.handover): the next holder, on any
    # host, reads the marker from the poll and starts at once instead of waiting for a previous holder.
    task_type = api.task_type()
    workflow_id, task_id = api.started_task(task_type)
    marker = {"conductorRunYieldedAtPollCount": 1, "exitCode": 75}
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS",
                    "callbackAfterSeconds": 0, "outputData": marker})  # fmt: skip
    assert (r.status_code, r.text) == (200, task_id)
    again = api.poll(task_type, worker="other-worker")
    assert (again["taskId"], again["pollCount"]) == (task_id, 2)
    assert again["outputData"] == marker
    # A bare IN_PROGRESS update (an operator's requeue) replaces the output: no marker any more
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS"})
    assert r.status_code == 200
    third = api.poll(task_type, worker="third-worker")
    assert third["pollCount"] == 3 and "conductorRunYieldedAtPollCount" not in (third.get("outputData") or {})


def test_terminate_cancels_tasks_and_late_calls_are_silently_accepted(api: Api) -> None:
    task_type = api.task_type()
    workflow_id, task_id = api.started_task(task_type)
    r = api.call("DELETE", f"/workflow/{workflow_id}", params={"reason": "test"})
    assert r.status_code == 200
    assert api.task(task_id)["status"] == "CANCELED"
    workflow = api.workflow(workflow_id)
    assert (workflow["status"], workflow["reasonForIncompletion"]) == ("TERMINATED", "test")
    # A heartbeat cannot reveal the lost lease...
    r = api.lease(workflow_id, task_id)
    assert (r.status_code, r.text) == (200, task_id)
    # ...and a late completion is dropped.
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "COMPLETED",
                    "outputData": {"late": True}})
    assert (r.status_code, r.text) == (200, task_id)
    assert api.task(task_id)["status"] == "CANCELED"
    assert api.task(task_id)["outputData"] == {}
    # Terminating again is a no-op.
    assert api.call("DELETE", f"/workflow/{workflow_id}", params={"reason": "again"}).status_code == 200


def test_terminating_a_completed_workflow_is_a_409(api: Api) -> None:
    task_type = api.task_type()
    workflow_id, task_id = api.started_task(task_type)
    api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "COMPLETED"})
    r = api.call("DELETE", f"/workflow/{workflow_id}", params={"reason": "x"})
    assert r.status_code == 409
    assert r.json()["message"] == "Cannot terminate a COMPLETED workflow."


def test_unknown_ids(api: Api) -> None:
    workflow_id, task_id = api.started_task(api.task_type())
    r = api.update({"taskId": "no-such-task", "workflowInstanceId": workflow_id, "status": "COMPLETED"})
    assert (r.status_code, r.json()["message"]) == (404, "No such task found by id: no-such-task")
    r = api.update({"taskId": task_id, "workflowInstanceId": "no-such-wf", "status": "COMPLETED"})
    assert (r.status_code, r.json()["message"]) == (404, "No such workflow found by id: no-such-wf")
    r = api.update({"taskId": "no-such-task", "workflowInstanceId": "no-such-wf", "extendLease": True})
    assert (r.status_code, r.json()["message"]) == (404, "No such task found by id: no-such-task")
    r = api.call("GET", "/tasks/no-such-task")
    assert (r.status_code, r.json()["message"]) == (404, "Task not found for taskId: no-such-task")
    r = api.call("GET", "/workflow/no-such-wf")
    assert r.status_code == 404


def test_malformed_updates(api: Api) -> None:
    workflow_id, task_id = api.started_task(api.task_type())
    r = api.update({"taskId": "", "workflowInstanceId": workflow_id, "status": "COMPLETED"})
    assert r.status_code == 400
    assert r.json()["validationErrors"][0]["message"] == "Task ID cannot be null or empty"
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "TIMED_OUT"})
    assert r.status_code == 500
    r = api.update({"taskId": task_id, "workflowInstanceId": workflow_id})  # no status
    assert r.status_code == 500


def test_no_token_endpoint(api: Api) -> None:
    r = api.call("POST", "/token", json={"keyId": "k", "keySecret": "s"})
    assert r.status_code == 404


def test_task_logs(api: Api) -> None:
    workflow_id, task_id = api.started_task(api.task_type())
    empty = api.call("GET", f"/tasks/{task_id}/log")
    assert (empty.status_code, empty.text) == (204, "")
    r = api.call("POST", f"/tasks/{task_id}/log", data="line one", headers={"Content-Type": "text/plain"})
    assert (r.status_code, r.text) == (200, "")
    api.call("POST", f"/tasks/{task_id}/log", data='"as json"', headers={"Content-Type": "application/json"})
    logs = api.call("GET", f"/tasks/{task_id}/log").json()
    assert [entry["log"] for entry in logs] == ["line one", '"as json"']  # JSON strings keep their quotes
    assert all(entry["taskId"] == task_id and entry["createdTime"] > 0 for entry in logs)
    # Logs sent with a final update are stored too.
    api.update({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "COMPLETED",
                "logs": [{"log": "from update", "taskId": task_id, "createdTime": 1}]})
    logs = api.call("GET", f"/tasks/{task_id}/log").json()
    assert "from update" in [entry["log"] for entry in logs]


def test_response_timeout_is_decided_by_an_explicit_decide(api: Api) -> None:
    task_type = api.task_type(response_timeout=3)
    workflow_id, task_id = api.started_task(task_type)
    beat_at = time.monotonic()
    assert api.lease(workflow_id, task_id).status_code == 200
    assert api.call("PUT", f"/workflow/decide/{workflow_id}").status_code == 200
    if time.monotonic() - beat_at < 2.0:  # well inside R on any sane machine
        assert api.task(task_id)["status"] == "IN_PROGRESS"
    wait_until(lambda: time.monotonic() - beat_at > 3.3, 10, "R to pass")
    assert api.call("PUT", f"/workflow/decide/{workflow_id}").status_code == 200
    task = api.task(task_id)
    assert task["status"] == "TIMED_OUT"
    assert task["reasonForIncompletion"].startswith(f"responseTimeout: 3 exceeded for the taskId: {task_id}")
    assert api.workflow(workflow_id)["status"] == "TIMED_OUT"  # retryCount 0, TIME_OUT_WF


def test_a_never_heartbeated_task_times_out_about_r_after_the_poll(api: Api) -> None:
    task_type = api.task_type(response_timeout=2)
    api.start(task_type)
    polled_at = time.monotonic()
    task_id = api.poll(task_type)["taskId"]
    wait_until(lambda: api.task(task_id)["status"] == "TIMED_OUT", 60, "the sweeper to time the task out",
               interval_seconds=0.1)
    assert time.monotonic() - polled_at >= 2.0


def test_a_task_that_stops_heartbeating_times_out_late_without_decide(api: Api) -> None:
    """SQLite queue: after the first sweep, the next one comes ~60-120 s late (notes §4)."""
    task_type = api.task_type(response_timeout=2)
    workflow_id, task_id = api.started_task(task_type)
    start = time.monotonic()
    for beat in range(1, 6):  # heartbeat every second for 5 s, across the first sweep at ~R
        wait_until(lambda b=beat: time.monotonic() - start >= b, 5, "the next heartbeat time")
        assert api.lease(workflow_id, task_id).status_code == 200
        assert api.task(task_id)["status"] == "IN_PROGRESS"
    waited_from = time.monotonic()
    wait_until(lambda: api.task(task_id)["status"] == "TIMED_OUT", 240, "the late sweep",
               interval_seconds=0.1)
    took = time.monotonic() - waited_from
    assert took > 2.0  # never before R; typically 60-130 s
