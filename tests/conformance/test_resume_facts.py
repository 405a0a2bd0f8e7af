"""What resuming a long job relies on, held by both servers (docs/long-jobs.md): a yield's outputData
comes back with the task's next delivery; a retry names its earlier attempt (``retriedTaskId``), starts
with an empty outputData, and the earlier attempt keeps its output and its task log."""

from __future__ import annotations

from tests.conformance.harness import Harness


def test_a_yields_output_comes_back_with_the_next_delivery(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=10, retryCount=0)
    conductor.start(wf)
    first = conductor.poll_one(task_type)
    conductor.update(first, "IN_PROGRESS", outputData={"checkpoint": {"step": 3}}, callbackAfterSeconds=0)
    again = conductor.poll_one(task_type)
    assert again["taskId"] == first["taskId"] and again["pollCount"] == first["pollCount"] + 1
    assert again["outputData"]["checkpoint"] == {"step": 3}
    assert "retriedTaskId" not in again


def test_a_retry_names_its_attempt_which_keeps_its_output_and_log(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=10, retryCount=1, retryDelaySeconds=0)
    conductor.start(wf)
    first = conductor.poll_one(task_type)
    r = conductor.post(f"/tasks/{first['taskId']}/log", data="conductor-run checkpoint: {\"step\":2}",
                       headers={"Content-Type": "text/plain"})
    assert r.status_code == 200, r.text
    conductor.update(first, "FAILED", outputData={"checkpoint": {"step": 2}}, reasonForIncompletion="x")
    retry = conductor.poll_one(task_type)
    assert retry["taskId"] != first["taskId"]
    assert retry["retriedTaskId"] == first["taskId"]
    assert not retry.get("outputData")  # the earlier attempt's output is not copied to its retry
    earlier = conductor.task(first["taskId"])
    assert earlier["status"] == "FAILED" and earlier["outputData"]["checkpoint"] == {"step": 2}
    logs = conductor.get(f"/tasks/{first['taskId']}/log").json()
    assert [entry["log"] for entry in logs] == ['conductor-run checkpoint: {"step":2}']
