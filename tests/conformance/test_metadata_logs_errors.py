"""Task/workflow definitions, logs, health and error shapes (CONDUCTOR_PROTOCOL.md §5-§9; §12 items 6-10)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conformance.harness import Harness
from tests.support import wait_until


def test_task_def_defaults(conductor: Harness) -> None:
    name = conductor.unique("defaults")
    r = conductor.post("/metadata/taskdefs", json=[{"name": name}])
    assert r.status_code == 200, r.text
    td = conductor.get(f"/metadata/taskdefs/{name}").json()
    assert td["retryCount"] == 3
    assert td["retryDelaySeconds"] == 60
    assert td["responseTimeoutSeconds"] == 3600
    assert td["timeoutSeconds"] == 0
    assert td["timeoutPolicy"] == "TIME_OUT_WF"
    assert td["retryLogic"] == "FIXED"


@pytest.mark.parametrize(
    "fields",
    [
        {"responseTimeoutSeconds": 0},
        {"responseTimeoutSeconds": 10, "timeoutSeconds": 5},
        {"retryCount": -1},
    ],
    ids=["r-zero", "r-above-timeout", "negative-retries"],
)
def test_invalid_task_defs_are_400_with_validation_errors(conductor: Harness, fields: dict[str, Any]) -> None:
    name = conductor.unique("invalid")
    r = conductor.post("/metadata/taskdefs", json=[{"name": name, **fields}])
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["status"] == 400
    assert body["validationErrors"]
    assert conductor.get(f"/metadata/taskdefs/{name}").status_code == 404


def test_task_def_with_an_empty_name_is_400(conductor: Harness) -> None:
    r = conductor.post("/metadata/taskdefs", json=[{"name": "", "responseTimeoutSeconds": 5}])
    assert r.status_code == 400


def test_response_timeout_equal_to_timeout_is_accepted(conductor: Harness) -> None:
    name = conductor.unique("equal")
    r = conductor.post(
        "/metadata/taskdefs", json=[{"name": name, "responseTimeoutSeconds": 5, "timeoutSeconds": 5}]
    )
    assert r.status_code == 200, r.text


def test_task_def_register_is_an_upsert_and_put_updates(conductor: Harness) -> None:
    name = conductor.task_def(responseTimeoutSeconds=5)
    conductor.task_def(name=name, responseTimeoutSeconds=6)
    assert conductor.get(f"/metadata/taskdefs/{name}").json()["responseTimeoutSeconds"] == 6
    r = conductor.put("/metadata/taskdefs", json={"name": name, "responseTimeoutSeconds": 7, "retryCount": 0})
    assert r.status_code == 200, r.text
    assert conductor.get(f"/metadata/taskdefs/{name}").json()["responseTimeoutSeconds"] == 7


def test_put_of_a_missing_task_def_is_404(conductor: Harness) -> None:
    r = conductor.put(
        "/metadata/taskdefs", json={"name": conductor.unique("missing"), "responseTimeoutSeconds": 5}
    )
    assert r.status_code == 404


def test_get_and_delete_task_def(conductor: Harness) -> None:
    name = conductor.task_def()
    assert conductor.get(f"/metadata/taskdefs/{name}").json()["name"] == name
    assert conductor.delete(f"/metadata/taskdefs/{name}").status_code == 200
    assert conductor.get(f"/metadata/taskdefs/{name}").status_code == 404


def test_task_def_is_snapshotted_at_workflow_start(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=5)
    conductor.start(wf)
    conductor.put(
        "/metadata/taskdefs", json={"name": task_type, "responseTimeoutSeconds": 7, "retryCount": 0}
    )
    task = conductor.poll_one(task_type)
    assert task["responseTimeoutSeconds"] == 5
    assert task["workflowTask"]["taskDefinition"]["responseTimeoutSeconds"] == 5


def test_inline_task_definition_wins_over_the_registered_one(conductor: Harness) -> None:
    task_type = conductor.task_def(responseTimeoutSeconds=5)
    inline = {"name": task_type, "responseTimeoutSeconds": 4, "retryCount": 0, "retryDelaySeconds": 0}
    wf = conductor.workflow_def({"name": task_type, "taskReferenceName": "x", "taskDefinition": inline})
    conductor.start(wf)
    task = conductor.poll_one(task_type)
    assert task["responseTimeoutSeconds"] == 4


def test_simple_task_without_a_def_gets_the_ad_hoc_defaults(conductor: Harness) -> None:
    task_type = conductor.unique("adhoc")
    wf = conductor.workflow_def(task_type)
    conductor.start(wf)
    task = conductor.poll_one(task_type)
    td = task["workflowTask"]["taskDefinition"]
    assert task["responseTimeoutSeconds"] == 3600
    assert td["retryCount"] == 3
    assert td["timeoutPolicy"] == "TIME_OUT_WF"


def test_workflow_def_duplicate_is_409_unless_overwrite(conductor: Harness) -> None:
    task_type = conductor.task_def()
    name = conductor.workflow_def(task_type)
    body = {
        "name": name,
        "version": 1,
        "schemaVersion": 2,
        "ownerEmail": "test@example.com",
        "tasks": [{"name": task_type, "taskReferenceName": "renamed", "type": "SIMPLE"}],
    }
    assert conductor.post("/metadata/workflow", json=body).status_code == 409
    r = conductor.post("/metadata/workflow", json=body, params={"overwrite": "true"})
    assert r.status_code == 200, r.text
    got = conductor.get(f"/metadata/workflow/{name}").json()
    assert got["tasks"][0]["taskReferenceName"] == "renamed"


def test_unknown_workflow_def_is_404(conductor: Harness) -> None:
    assert conductor.get(f"/metadata/workflow/{conductor.unique('nope')}").status_code == 404


# ---------------------------------------------------------------------------------------------- logs


def test_task_logs_are_raw_text_and_204_when_empty(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    conductor.start(wf)
    task = conductor.poll_one(task_type)
    assert conductor.get(f"/tasks/{task['taskId']}/log").status_code == 204
    r = conductor.post(
        f"/tasks/{task['taskId']}/log",
        data=b"hello from the worker",
        headers={"Content-Type": "text/plain"},
    )
    assert r.status_code == 200

    def logs() -> list[dict[str, Any]] | None:
        got = conductor.get(f"/tasks/{task['taskId']}/log")
        return got.json() if got.status_code == 200 else None

    entries = wait_until(logs, 10, "the log line")
    assert entries[0]["log"] == "hello from the worker"
    assert entries[0]["taskId"] == task["taskId"]
    assert entries[0]["createdTime"] > 0


# ---------------------------------------------------------------------------------------------- misc


def test_get_unknown_task_is_404(conductor: Harness) -> None:
    r = conductor.get("/tasks/no-such-task-id")
    assert r.status_code == 404


def test_health(conductor: Harness) -> None:
    assert conductor.http.get(conductor.root + "/health", timeout=10).status_code == 200
    assert conductor.get("/health").status_code == 200


def test_errors_are_conductor_shaped_json(conductor: Harness) -> None:
    r = conductor.get("/tasks/no-such-task-id")
    body = r.json()
    assert body["status"] == 404
    assert isinstance(body["message"], str) and body["message"]
    assert body["retryable"] is False
    assert "Traceback" not in r.text


def test_unknown_route_is_404(conductor: Harness) -> None:
    assert conductor.get("/no/such/route/here").status_code == 404


def test_token_endpoint_is_404_without_auth(conductor: Harness) -> None:
    r = conductor.post("/token", json={"keyId": "k", "keySecret": "s"})
    assert r.status_code in (404, 405)
