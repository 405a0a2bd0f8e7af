"""The decider: response, task and poll timeouts, retries, workflow outcomes (PROTOCOL §4; §12 item 4).

Every deadline here is passed by waiting, then evaluated with ``PUT /api/workflow/decide/{id}``, so the
tests hold on the real server too, whose sweeper re-checks workflows only coarsely.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conformance.harness import Harness, sleep_past
from tests.support import wait_until


def _start_and_poll(conductor: Harness, wf: str, task_type: str) -> dict[str, Any]:
    workflow_id = conductor.start(wf)
    task = conductor.poll_one(task_type)
    assert task["workflowInstanceId"] == workflow_id
    return task


def test_heartbeats_keep_a_task_alive_past_r_while_a_silent_task_times_out(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=2, retryCount=0)
    beating = _start_and_poll(conductor, wf, task_type)
    silent = _start_and_poll(conductor, wf, task_type)

    conductor.keep_alive(beating, seconds=3.5)  # well past R = 2 s
    conductor.decide(beating["workflowInstanceId"])
    conductor.decide(silent["workflowInstanceId"])

    alive = conductor.task(beating["taskId"])
    assert alive["status"] == "IN_PROGRESS"
    assert conductor.workflow(beating["workflowInstanceId"])["status"] == "RUNNING"

    dead = conductor.task(silent["taskId"])
    assert dead["status"] == "TIMED_OUT"
    assert dead["reasonForIncompletion"].startswith("responseTimeout: 2 exceeded for the taskId: ")
    assert conductor.workflow(silent["workflowInstanceId"])["status"] == "TIMED_OUT"

    # A late completion of the timed-out task is accepted with 200 and silently dropped.
    r = conductor.update(silent, "COMPLETED", outputData={"late": True})
    assert r.status_code == 200
    assert conductor.task(silent["taskId"])["status"] == "TIMED_OUT"
    # The heartbeating task can still complete normally.
    conductor.update(beating, "COMPLETED", outputData={"ok": True})
    assert conductor.workflow(beating["workflowInstanceId"])["status"] == "COMPLETED"


def test_response_timeout_retries_under_a_new_task_id_then_times_the_workflow_out(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=1, retryCount=1, retryDelaySeconds=0)
    first = _start_and_poll(conductor, wf, task_type)
    workflow_id = first["workflowInstanceId"]

    sleep_past(1.5)
    conductor.decide(workflow_id)
    tasks = conductor.tasks(workflow_id)
    assert [t["status"] for t in tasks] == ["TIMED_OUT", "SCHEDULED"]
    retry = tasks[1]
    assert retry["taskId"] != first["taskId"]
    assert retry["retryCount"] == 1
    assert retry["retriedTaskId"] == first["taskId"]
    assert retry["pollCount"] == 0
    assert "workerId" not in retry
    assert retry["referenceTaskName"] == first["referenceTaskName"]

    second = conductor.poll_one(task_type)
    assert second["taskId"] == retry["taskId"]
    sleep_past(1.5)
    conductor.decide(workflow_id)
    wf_after = conductor.workflow(workflow_id)
    assert wf_after["status"] == "TIMED_OUT"
    assert [t["status"] for t in wf_after["tasks"]] == ["TIMED_OUT", "TIMED_OUT"]
    # A TIMED_OUT workflow lists no failed reference (only a FAILED one does).
    assert wf_after["failedReferenceTaskNames"] == []


def test_failed_task_is_retried_then_fails_the_workflow(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(retryCount=1, retryDelaySeconds=0, responseTimeoutSeconds=30)
    first = _start_and_poll(conductor, wf, task_type)
    workflow_id = first["workflowInstanceId"]
    conductor.update(first, "FAILED", reasonForIncompletion="boom one")

    retry = conductor.poll_one(task_type)
    assert retry["taskId"] != first["taskId"]
    assert retry["retryCount"] == 1
    assert retry["retriedTaskId"] == first["taskId"]
    running = conductor.workflow(workflow_id)
    assert running["status"] == "RUNNING"
    assert running["failedReferenceTaskNames"] == []  # listed only once the workflow fails

    conductor.update(retry, "FAILED", reasonForIncompletion="boom two")
    after = conductor.workflow(workflow_id)
    assert after["status"] == "FAILED"
    assert "boom two" in after["reasonForIncompletion"]
    assert after["failedReferenceTaskNames"] == [first["referenceTaskName"]]
    assert [t["status"] for t in after["tasks"]] == ["FAILED", "FAILED"]


def test_failed_with_terminal_error_never_retries(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(retryCount=3, retryDelaySeconds=0, responseTimeoutSeconds=30)
    task = _start_and_poll(conductor, wf, task_type)
    conductor.update(task, "FAILED_WITH_TERMINAL_ERROR", reasonForIncompletion="fatal")
    after = conductor.workflow(task["workflowInstanceId"])
    assert after["status"] == "FAILED"
    assert [t["status"] for t in after["tasks"]] == ["FAILED_WITH_TERMINAL_ERROR"]


def test_retry_waits_for_retry_delay_seconds(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(retryCount=1, retryDelaySeconds=1, responseTimeoutSeconds=30)
    task = _start_and_poll(conductor, wf, task_type)
    conductor.update(task, "FAILED", reasonForIncompletion="again")
    assert conductor.poll_batch(task_type, timeout_ms=0) == []
    retry = conductor.poll_one(task_type, timeout_s=15)
    assert retry["retriedTaskId"] == task["taskId"]


@pytest.mark.parametrize("policy", ["RETRY", "TIME_OUT_WF", "ALERT_ONLY"])
def test_timeout_seconds_applies_the_timeout_policy_even_while_heartbeating(
    conductor: Harness, policy: str
) -> None:
    task_type, wf = conductor.one_task_workflow(
        responseTimeoutSeconds=2, timeoutSeconds=3, timeoutPolicy=policy, retryCount=1, retryDelaySeconds=0
    )
    task = _start_and_poll(conductor, wf, task_type)
    workflow_id = task["workflowInstanceId"]
    conductor.keep_alive(task, seconds=3.5)  # extendLease does not extend timeoutSeconds
    conductor.decide(workflow_id)
    after = conductor.workflow(workflow_id)
    statuses = [t["status"] for t in after["tasks"]]
    if policy == "RETRY":
        assert statuses == ["TIMED_OUT", "SCHEDULED"]
        assert after["status"] == "RUNNING"
    elif policy == "TIME_OUT_WF":
        assert statuses == ["TIMED_OUT"]
        assert after["status"] == "TIMED_OUT"
    else:
        assert statuses == ["IN_PROGRESS"]
        assert after["status"] == "RUNNING"


def test_poll_timeout_times_out_a_task_nobody_polls(conductor: Harness) -> None:
    _task_type, wf = conductor.one_task_workflow(pollTimeoutSeconds=1, retryCount=0)
    workflow_id = conductor.start(wf)
    sleep_past(1.5)
    conductor.decide(workflow_id)
    after = conductor.workflow(workflow_id)
    assert [t["status"] for t in after["tasks"]] == ["TIMED_OUT"]
    assert after["status"] == "TIMED_OUT"


# ---------------------------------------------------------------------------------------------- outcomes


def test_tasks_run_in_sequence_with_resolved_inputs_and_the_workflow_output(conductor: Harness) -> None:
    first_type = conductor.task_def()
    second_type = conductor.task_def()
    wf = conductor.workflow_def(
        {"name": first_type, "taskReferenceName": "first", "inputParameters": {"n": "${workflow.input.n}"}},
        {
            "name": second_type,
            "taskReferenceName": "second",
            "inputParameters": {
                "doubled": "${first.output.doubled}",
                "literal": 7,
                "n": "${workflow.input.n}",
            },
        },
    )
    workflow_id = conductor.start(wf, {"n": 21})
    first = conductor.poll_one(first_type)
    assert first["inputData"] == {"n": 21}
    assert conductor.poll_batch(second_type, timeout_ms=0) == []
    conductor.update(first, "COMPLETED", outputData={"doubled": 42})

    second = conductor.poll_one(second_type)
    assert second["workflowInstanceId"] == workflow_id
    assert second["inputData"] == {"doubled": 42, "literal": 7, "n": 21}
    assert second["referenceTaskName"] == "second"
    conductor.update(second, "COMPLETED", outputData={"result": "done"})

    after = conductor.workflow(workflow_id)
    assert after["status"] == "COMPLETED"
    assert after["output"] == {"result": "done"}
    assert [t["referenceTaskName"] for t in after["tasks"]] == ["first", "second"]
    assert after["endTime"] > 0


def test_workflow_status_endpoint(conductor: Harness) -> None:
    _task_type, wf = conductor.one_task_workflow()
    workflow_id = conductor.start(wf, correlationId="corr-1")
    status = conductor.get(f"/workflow/{workflow_id}/status").json()
    assert status["workflowId"] == workflow_id
    assert status["status"] == "RUNNING"
    assert status.get("correlationId") == "corr-1"


# ---------------------------------------------------------------------------------------------- terminate


def test_terminate_cancels_open_tasks_and_late_updates_are_ignored(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(responseTimeoutSeconds=30)
    task = _start_and_poll(conductor, wf, task_type)
    workflow_id = task["workflowInstanceId"]
    r = conductor.terminate(workflow_id, reason="operator said so")
    assert r.status_code == 200
    after = conductor.workflow(workflow_id)
    assert after["status"] == "TERMINATED"
    assert after["reasonForIncompletion"] == "operator said so"
    assert conductor.task(task["taskId"])["status"] == "CANCELED"

    late = conductor.update(task, "COMPLETED", outputData={"late": True})
    assert late.status_code == 200
    assert conductor.task(task["taskId"])["status"] == "CANCELED"
    # Terminating again is a no-op.
    assert conductor.terminate(workflow_id).status_code == 200
    assert conductor.workflow(workflow_id)["status"] == "TERMINATED"


def test_terminating_a_completed_workflow_is_409(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    task = _start_and_poll(conductor, wf, task_type)
    conductor.update(task, "COMPLETED")
    r = conductor.terminate(task["workflowInstanceId"])
    assert r.status_code == 409
    assert conductor.workflow(task["workflowInstanceId"])["status"] == "COMPLETED"


def test_terminating_a_failed_workflow_makes_it_terminated(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow(retryCount=0)
    task = _start_and_poll(conductor, wf, task_type)
    conductor.update(task, "FAILED", reasonForIncompletion="x")
    assert conductor.workflow(task["workflowInstanceId"])["status"] == "FAILED"
    assert conductor.terminate(task["workflowInstanceId"]).status_code == 200
    assert conductor.workflow(task["workflowInstanceId"])["status"] == "TERMINATED"


def test_unknown_workflow_is_404(conductor: Harness) -> None:
    assert conductor.get("/workflow/no-such-workflow-id").status_code == 404


def test_start_with_an_inline_workflow_definition(conductor: Harness) -> None:
    task_type = conductor.task_def(responseTimeoutSeconds=9)
    name = conductor.unique("inline")
    body = {
        "name": name,
        "version": 1,
        "input": {"k": "v"},
        "correlationId": "inline-corr",
        "workflowDef": {
            "name": name,
            "version": 1,
            "schemaVersion": 2,
            "ownerEmail": "test@example.com",
            "tasks": [
                {
                    "name": task_type,
                    "taskReferenceName": "only",
                    "type": "SIMPLE",
                    "inputParameters": {"k": "${workflow.input.k}"},
                }
            ],
        },
    }
    r = conductor.post("/workflow", json=body)
    assert r.status_code == 200, r.text
    task = conductor.poll_one(task_type)
    assert task["workflowInstanceId"] == r.text
    assert task["inputData"] == {"k": "v"}
    assert task["responseTimeoutSeconds"] == 9
    wait_until(lambda: conductor.workflow(r.text)["correlationId"] == "inline-corr", 5, "correlation id")
