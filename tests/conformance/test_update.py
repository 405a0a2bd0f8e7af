"""Updating a task and extending its lease (CONDUCTOR_PROTOCOL.md §3; §12 items 2 and 3)."""

from __future__ import annotations

from typing import Any

from tests.conformance.harness import Harness, sleep_past
from tests.support import wait_until


def _polled(conductor: Harness, **task_fields: Any) -> tuple[dict[str, Any], str]:
    task_type, wf = conductor.one_task_workflow(**task_fields)
    conductor.start(wf)
    return conductor.poll_one(task_type), task_type


def test_update_answers_the_task_id_as_text(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.update(task, "COMPLETED", outputData={"answer": 42})
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/plain")
    assert r.text == task["taskId"]


def test_completed_update_sets_end_time_output_and_completes_the_workflow(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    conductor.update(task, "COMPLETED", outputData={"answer": 42})
    stored = conductor.task(task["taskId"])
    assert stored["status"] == "COMPLETED"
    assert stored["outputData"] == {"answer": 42}
    assert stored["endTime"] >= stored["startTime"] > 0
    wf = conductor.workflow(task["workflowInstanceId"])
    assert wf["status"] == "COMPLETED"
    assert wf["output"] == {"answer": 42}


def test_empty_ids_are_400_with_validation_errors(conductor: Harness) -> None:
    r = conductor.post("/tasks", json={"taskId": "", "workflowInstanceId": "", "status": "COMPLETED"})
    assert r.status_code == 400
    body = r.json()
    assert body["status"] == 400
    assert len(body["validationErrors"]) == 2


def test_extend_lease_with_an_empty_workflow_id_is_400(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.post(
        "/tasks", json={"taskId": task["taskId"], "workflowInstanceId": "", "extendLease": True}
    )
    assert r.status_code == 400


def test_unknown_workflow_is_404_before_the_task_is_looked_up(conductor: Harness) -> None:
    r = conductor.update({"taskId": "no-such-task", "workflowInstanceId": "no-such-workflow"}, "COMPLETED")
    assert r.status_code == 404
    assert r.json()["status"] == 404


def test_unknown_task_of_a_known_workflow_is_404(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.update(
        {"taskId": "no-such-task", "workflowInstanceId": task["workflowInstanceId"]}, "COMPLETED"
    )
    assert r.status_code == 404


def test_update_of_a_terminal_task_is_silently_ignored(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    conductor.update(task, "COMPLETED", outputData={"first": True})
    r = conductor.update(task, "FAILED", outputData={"second": True}, reasonForIncompletion="late")
    assert r.status_code == 200
    assert r.text == task["taskId"]
    stored = conductor.task(task["taskId"])
    assert stored["status"] == "COMPLETED"
    assert stored["outputData"] == {"first": True}


def test_in_progress_update_requeues_the_same_task_for_any_worker(conductor: Harness) -> None:
    task, task_type = _polled(conductor)
    r = conductor.update(task, "IN_PROGRESS", outputData={"progress": 1})
    assert r.status_code == 200
    assert r.text == task["taskId"]
    assert conductor.task(task["taskId"])["status"] in ("SCHEDULED", "IN_PROGRESS")
    again = conductor.poll_one(task_type, worker_id="another-worker")
    assert again["taskId"] == task["taskId"]
    assert again["pollCount"] == 2
    assert again["workerId"] == "another-worker"
    assert again["startTime"] == task["startTime"]  # set only once


def test_in_progress_update_with_callback_delays_the_requeue(conductor: Harness) -> None:
    task, task_type = _polled(conductor)
    conductor.update(task, "IN_PROGRESS", callbackAfterSeconds=2)
    stored = conductor.task(task["taskId"])
    assert stored["status"] == "SCHEDULED"
    assert stored["callbackAfterSeconds"] == 2
    assert conductor.poll_batch(task_type, timeout_ms=500) == []
    again = conductor.poll_one(task_type, timeout_s=15)
    assert again["taskId"] == task["taskId"]
    assert again["callbackAfterSeconds"] == 0


def test_output_is_replaced_not_merged(conductor: Harness) -> None:
    task, task_type = _polled(conductor)
    conductor.update(task, "IN_PROGRESS", outputData={"a": 1})
    again = conductor.poll_one(task_type)
    conductor.update(again, "COMPLETED", outputData={"b": 2})
    assert conductor.task(task["taskId"])["outputData"] == {"b": 2}


def test_missing_status_is_500(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.update(task, None, outputData={})
    assert r.status_code == 500
    assert conductor.task(task["taskId"])["status"] == "IN_PROGRESS"


def test_unknown_status_value_is_500(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.update(task, "TIMED_OUT")
    assert r.status_code == 500
    assert conductor.task(task["taskId"])["status"] == "IN_PROGRESS"


def test_malformed_json_is_500(conductor: Harness) -> None:
    r = conductor.post("/tasks", data=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 500
    assert "Traceback" not in r.text


def test_update_logs_are_stored_up_to_ten(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    logs = [
        {"log": f"line {i}", "taskId": task["taskId"], "createdTime": 1_700_000_000_000 + i}
        for i in range(12)
    ]
    conductor.update(task, "COMPLETED", logs=logs)

    def stored() -> list[dict[str, Any]] | None:
        r = conductor.get(f"/tasks/{task['taskId']}/log")
        return r.json() if r.status_code == 200 else None

    got = wait_until(stored, 10, "task logs")
    assert sorted(entry["log"] for entry in got) == sorted(f"line {i}" for i in range(10))


# ---------------------------------------------------------------------------------------------- lease


def test_extend_lease_of_an_unknown_task_is_404(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    r = conductor.extend_lease({"taskId": "no-such-task", "workflowInstanceId": task["workflowInstanceId"]})
    assert r.status_code == 404


def test_extend_lease_only_moves_update_time(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    before = conductor.task(task["taskId"])
    sleep_past(0.05)  # updateTime has millisecond resolution: let some pass
    body = {
        "taskId": task["taskId"],
        "workflowInstanceId": task["workflowInstanceId"],
        "status": "COMPLETED",  # ignored: the lease path returns first
        "extendLease": True,
        "outputData": {"ignored": True},
        "callbackAfterSeconds": 30,
    }
    r = conductor.post("/tasks", json=body, headers={"Accept": "*/*"})
    assert r.status_code == 200
    assert r.text == task["taskId"]
    after = conductor.task(task["taskId"])
    assert after["updateTime"] > before["updateTime"]
    for key in ("status", "pollCount", "outputData", "callbackAfterSeconds", "startTime", "workerId"):
        assert after.get(key) == before.get(key), key


def test_extend_lease_of_a_terminal_task_is_a_silent_200(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    conductor.update(task, "COMPLETED")
    r = conductor.extend_lease(task)
    assert r.status_code == 200
    assert r.text == task["taskId"]
    assert conductor.task(task["taskId"])["status"] == "COMPLETED"


def test_update_v2_completes_and_claims_the_next_task_of_the_type(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    conductor.start(wf)
    first = conductor.poll_one(task_type)
    second_wf = conductor.start(wf)
    wait_until(
        lambda: conductor.get("/tasks/queue/size", params={"taskType": task_type}).json() == 1, 10, "queued"
    )
    body = {
        "taskId": first["taskId"],
        "workflowInstanceId": first["workflowInstanceId"],
        "status": "COMPLETED",
        "workerId": "v2-worker",
    }
    r = conductor.post("/tasks/update-v2", json=body)
    assert r.status_code == 200, r.text
    claimed = r.json()
    assert claimed["workflowInstanceId"] == second_wf
    assert claimed["status"] == "IN_PROGRESS"
    assert claimed["workerId"] == "v2-worker"
    assert conductor.task(first["taskId"])["status"] == "COMPLETED"


def test_update_v2_of_a_non_terminal_status_is_204(conductor: Harness) -> None:
    task, _ = _polled(conductor)
    body = {"taskId": task["taskId"], "workflowInstanceId": task["workflowInstanceId"], "extendLease": True}
    r = conductor.post("/tasks/update-v2", json=body)
    assert r.status_code == 204
