"""Polling (CONDUCTOR_PROTOCOL.md §2; §12 item 1)."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.conformance.harness import Harness
from tests.realserver import TEST_ENV_NAME, TEST_ENV_VALUE, TEST_SECRET_NAME, TEST_SECRET_VALUE
from tests.support import wait_until


def test_single_poll_on_an_empty_queue_is_204_with_no_body(conductor: Harness) -> None:
    r = conductor.get(f"/tasks/poll/{conductor.unique('empty')}")
    assert r.status_code == 204
    assert r.content == b""


def test_batch_poll_on_an_empty_queue_is_an_empty_list(conductor: Harness) -> None:
    r = conductor.get(f"/tasks/poll/batch/{conductor.unique('empty')}", params={"count": 5, "timeout": 100})
    assert r.status_code == 200
    assert r.json() == []


def test_long_poll_timeout_over_5000_ms_is_400(conductor: Harness) -> None:
    r = conductor.get(f"/tasks/poll/batch/{conductor.unique('t')}", params={"count": 1, "timeout": 5001})
    assert r.status_code == 400
    body = r.json()
    assert body["status"] == 400
    assert "5 seconds" in body["message"]


def test_batch_poll_is_a_real_long_poll_that_waits_for_its_timeout(conductor: Harness) -> None:
    started = time.monotonic()
    got = conductor.poll_batch(conductor.unique("empty"), timeout_ms=800)
    elapsed = time.monotonic() - started
    assert got == []
    assert elapsed >= 0.7


def test_long_poll_returns_early_when_a_task_arrives(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    result: dict[str, Any] = {}

    def long_poll() -> None:
        started = time.monotonic()
        result["tasks"] = conductor.poll_batch(task_type, timeout_ms=5000, worker_id="lp")
        result["elapsed"] = time.monotonic() - started

    poller = threading.Thread(target=long_poll)
    poller.start()
    time.sleep(0.3)  # let the long poll start waiting: the subject here is the wake-up
    workflow_id = conductor.start(wf)
    poller.join(timeout=15)
    assert not poller.is_alive()
    assert [t["workflowInstanceId"] for t in result["tasks"]] == [workflow_id]
    assert result["elapsed"] < 4.0


def test_poll_side_effects(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    workflow_id = conductor.start(wf)
    before = conductor.tasks(workflow_id)[0]
    assert before["status"] == "SCHEDULED"
    assert before["pollCount"] == 0
    assert before.get("startTime", 0) == 0

    task = conductor.poll_one(task_type, worker_id="worker-a")
    assert task["workflowInstanceId"] == workflow_id
    assert task["taskId"] == before["taskId"]
    assert task["status"] == "IN_PROGRESS"
    assert task["workerId"] == "worker-a"
    assert task["pollCount"] == 1
    assert task["callbackAfterSeconds"] == 0
    assert task["startTime"] > 0
    assert task["updateTime"] >= task["startTime"]
    assert task["responseTimeoutSeconds"] == 2
    assert task["workflowTask"]["taskDefinition"]["responseTimeoutSeconds"] == 2

    stored = conductor.task(task["taskId"])
    assert stored["status"] == "IN_PROGRESS"
    assert stored["workerId"] == "worker-a"
    # The message was removed: nobody else gets the task.
    assert conductor.poll_batch(task_type, timeout_ms=300) == []
    assert conductor.get("/tasks/queue/size", params={"taskType": task_type}).json() == 0


def test_batch_poll_hands_out_up_to_count_tasks(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    ids = {conductor.start(wf) for _ in range(3)}
    got: list[dict[str, Any]] = []

    def collect() -> bool:
        got.extend(conductor.poll_batch(task_type, count=5, timeout_ms=500))
        return len(got) >= 3

    wait_until(collect, 10, "three tasks")
    assert {t["workflowInstanceId"] for t in got} == ids
    assert len({t["taskId"] for t in got}) == 3


def test_poll_data_is_recorded_even_for_empty_polls(conductor: Harness) -> None:
    task_type = conductor.unique("pd")
    assert conductor.poll_batch(task_type, worker_id="pd-worker", timeout_ms=0) == []

    def recorded() -> list[dict[str, Any]] | None:
        data: list[dict[str, Any]] = conductor.get(
            "/tasks/queue/polldata", params={"taskType": task_type}
        ).json()
        return data or None

    data = wait_until(recorded, 10, "poll data")
    assert data[0]["queueName"] == task_type
    assert data[0]["workerId"] == "pd-worker"
    assert data[0]["lastPollTime"] > 0
    everything = conductor.get("/tasks/queue/polldata/all").json()
    assert any(p["queueName"] == task_type for p in everything)


def test_domains_are_separate_queues_and_an_empty_domain_is_not_the_default(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    domain = conductor.unique("dom")
    # A domain counts only if a worker polled it recently, so poll it first.
    assert conductor.poll_batch(task_type, domain=domain, timeout_ms=0) == []
    r = conductor.post(
        "/workflow", json={"name": wf, "version": 1, "input": {}, "taskToDomain": {task_type: domain}}
    )
    assert r.status_code == 200, r.text
    workflow_id = r.text

    assert conductor.poll_batch(task_type, timeout_ms=300) == []
    assert conductor.poll_batch(task_type, domain="", timeout_ms=300) == []
    got = wait_until(
        lambda: conductor.poll_batch(task_type, domain=domain, timeout_ms=500), 10, "domain task"
    )
    assert got[0]["workflowInstanceId"] == workflow_id
    assert got[0]["domain"] == domain


def test_queue_size_counts_waiting_tasks(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    conductor.start(wf)
    conductor.start(wf)
    wait_until(
        lambda: conductor.get("/tasks/queue/size", params={"taskType": task_type}).json() == 2,
        10,
        "queue size 2",
    )
    conductor.poll_one(task_type)
    assert conductor.get("/tasks/queue/size", params={"taskType": task_type}).json() == 1


def test_a_polled_task_carries_its_declared_runtime_metadata_never_stored(conductor: Harness) -> None:
    """TaskDef.runtimeMetadata names resolved at the poll (the secret wins over an environment value
    of the same name: SESSION_SERVER_ENV defines both for the test secret); a name the server cannot
    resolve is left out of the map, still declared in taskDefinition."""
    declared = [TEST_SECRET_NAME, TEST_ENV_NAME, "CR_NOT_DEFINED_ANYWHERE"]
    task_type, wf = conductor.one_task_workflow(runtimeMetadata=declared)
    conductor.start(wf)
    (task,) = wait_until(lambda: conductor.poll_batch(task_type, timeout_ms=500, worker_id="w"),
                         what="the task")  # fmt: skip
    assert task["runtimeMetadata"] == {TEST_SECRET_NAME: TEST_SECRET_VALUE, TEST_ENV_NAME: TEST_ENV_VALUE}
    assert task["taskDefinition"]["runtimeMetadata"] == declared
    stored = conductor.task(task["taskId"])
    assert stored.get("runtimeMetadata") is None and TEST_SECRET_VALUE not in str(stored)


def test_workflow_secret_and_env_references_in_task_input(conductor: Harness) -> None:
    """``${workflow.secrets.X}`` is resolved into the polled copy of inputData only (the stored one
    keeps the reference); ``${workflow.env.X}`` when the task is scheduled, and stored."""
    task_type = conductor.task_def()
    secret_ref, env_ref = f"${{workflow.secrets.{TEST_SECRET_NAME}}}", f"${{workflow.env.{TEST_ENV_NAME}}}"
    params = {"s": secret_ref, "e": env_ref, "inside": f"Bearer {secret_ref}",
              "unknown": "${workflow.secrets.CR_NOT_DEFINED_ANYWHERE}"}  # fmt: skip
    wf = conductor.workflow_def({"name": task_type, "taskReferenceName": "t0", "inputParameters": params})
    conductor.start(wf)
    (task,) = wait_until(lambda: conductor.poll_batch(task_type, timeout_ms=500, worker_id="w"),
                         what="the task")  # fmt: skip
    assert task["inputData"] == {"s": TEST_SECRET_VALUE, "e": TEST_ENV_VALUE, "unknown": None,
                                 "inside": f"Bearer {TEST_SECRET_VALUE}"}  # fmt: skip
    stored = conductor.task(task["taskId"])["inputData"]
    assert stored == {**params, "e": TEST_ENV_VALUE}
