"""The queue and poll-data endpoints behind ``conductor-run fleet`` and the KEDA trigger (§7).

Shapes as the real server answers them (docs/real-server-notes.md "Queues and poll data").
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.conformance.harness import Harness
from tests.support import wait_until


def poll_records(conductor: Harness, task_type: str) -> list[dict[str, Any]]:
    r = conductor.get("/tasks/queue/polldata", params={"taskType": task_type})
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()
    return data


def test_poll_data_keeps_one_record_per_task_type_and_domain_the_last_pollers(conductor: Harness) -> None:
    task_type = conductor.unique("pdlast")
    domain = conductor.unique("dom")
    before = int(time.time() * 1000) - 5_000  # tolerance for a server clock a little behind ours
    conductor.poll_batch(task_type, worker_id="first", timeout_ms=0)
    conductor.poll_batch(task_type, worker_id="second", timeout_ms=0)
    conductor.poll_batch(task_type, worker_id="in-domain", domain=domain, timeout_ms=0)

    def both() -> list[dict[str, Any]] | None:
        data = poll_records(conductor, task_type)
        return data if len(data) == 2 and any(d.get("workerId") == "second" for d in data) else None

    data = wait_until(both, 10, "two poll records")
    default = [d for d in data if "domain" not in d]
    in_domain = [d for d in data if d.get("domain") == domain]
    assert len(default) == 1 and len(in_domain) == 1, data
    assert default[0]["queueName"] == task_type and default[0]["workerId"] == "second"
    assert in_domain[0]["queueName"] == task_type and in_domain[0]["workerId"] == "in-domain"
    assert all(isinstance(d["lastPollTime"], int) and d["lastPollTime"] >= before for d in data)
    everything = conductor.get("/tasks/queue/polldata/all").json()
    mine = sorted((d for d in everything if d["queueName"] == task_type), key=lambda d: d.get("domain", ""))
    assert mine == sorted(data, key=lambda d: d.get("domain", ""))


def test_a_poll_without_a_worker_id_is_recorded_without_one(conductor: Harness) -> None:
    task_type = conductor.unique("pdanon")
    conductor.poll_batch(task_type, timeout_ms=0)
    (record,) = wait_until(lambda: poll_records(conductor, task_type) or None, 10, "a poll record")
    assert "workerId" not in record
    assert record["queueName"] == task_type


def test_queue_all_names_domain_queues_domain_colon_type_and_keeps_drained_ones(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    domain = conductor.unique("dom")
    assert conductor.poll_batch(task_type, domain=domain, timeout_ms=0) == []  # the domain counts now
    body = {"name": wf, "version": 1, "input": {}, "taskToDomain": {task_type: domain}}
    r = conductor.post("/workflow", json=body)
    assert r.status_code == 200, r.text
    conductor.start(wf)
    conductor.start(wf)

    def sizes() -> dict[str, int] | None:
        everything: dict[str, int] = conductor.get("/tasks/queue/all").json()
        ready = everything.get(task_type) == 2 and everything.get(f"{domain}:{task_type}") == 1
        return everything if ready else None

    everything = wait_until(sizes, 10, "the default and the domain queue")
    assert all(isinstance(v, int) for v in everything.values())
    assert conductor.get("/tasks/queue/size", params={"taskType": task_type, "domain": domain}).json() == 1
    conductor.poll_one(task_type)
    conductor.poll_one(task_type)
    assert conductor.get("/tasks/queue/all").json()[task_type] == 0  # drained, still listed


def test_a_type_that_was_only_polled_has_no_queue_listed_even_during_a_long_poll(conductor: Harness) -> None:
    task_type = conductor.unique("onlypolled")
    conductor.poll_batch(task_type, worker_id="w", timeout_ms=0)
    wait_until(lambda: poll_records(conductor, task_type) or None, 10, "a poll record")
    assert task_type not in conductor.get("/tasks/queue/all").json()
    waiting = threading.Thread(target=conductor.poll_batch, args=(task_type,), kwargs={"timeout_ms": 3000})
    waiting.start()
    try:
        time.sleep(0.3)  # let the long poll reach the server and wait there
        assert task_type not in conductor.get("/tasks/queue/all").json()
    finally:
        waiting.join(timeout=30)


def test_queue_size_is_a_bare_number_and_an_empty_domain_means_the_default_queue(conductor: Harness) -> None:
    task_type, wf = conductor.one_task_workflow()
    conductor.start(wf)
    wait_until(lambda: conductor.get("/tasks/queue/size", params={"taskType": task_type}).json() == 1,
               10, "queue size 1")
    r = conductor.get("/tasks/queue/size", params={"taskType": task_type})
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("application/json")
    assert r.text.strip() == "1"  # what a KEDA metrics-api trigger reads with valueLocation "@this"
    assert conductor.get("/tasks/queue/size", params={"taskType": task_type, "domain": ""}).json() == 1
    assert conductor.get("/tasks/queue/size", params={"taskType": conductor.unique("none")}).json() == 0
    named = conductor.get("/tasks/queue/sizes", params={"taskType": [task_type, "crconf_none_x"]}).json()
    assert named == {task_type: 1, "crconf_none_x": 0}


def test_the_task_type_parameter_is_required(conductor: Harness) -> None:
    for path in ("/tasks/queue/polldata", "/tasks/queue/size", "/tasks/queue/sizes"):
        r = conductor.get(path)
        assert r.status_code == 500, (path, r.text)  # Spring's missing-parameter error is no 400 here
        assert r.json()["retryable"] is False
    r = conductor.get("/tasks/queue/polldata", params={"taskType": ""})
    assert r.status_code == 400
    assert r.json()["validationErrors"][0]["message"] == "TaskType cannot be null or empty."
