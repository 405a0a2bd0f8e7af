"""Embedded server: bounded memory over HTTP (evicted workflows are 404s), the ``store=`` hook, the flag."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from typing import Any

import requests

from leasecore.server import EmbeddedServer
from leasecore.server.store import JSON, Store
from tests.conformance.harness import Harness
from tests.support import wait_until


def test_an_evicted_workflow_and_its_task_are_404_over_http() -> None:
    with EmbeddedServer(max_finished_workflows=1) as srv:
        api = Harness(srv.url, "embedded")
        try:
            task_type, wf = api.one_task_workflow(responseTimeoutSeconds=60)
            done: list[tuple[str, str]] = []
            for _ in range(2):
                wf_id = api.start(wf)
                task = api.poll_one(task_type)
                assert api.update(task, "COMPLETED").status_code == 200
                done.append((wf_id, task["taskId"]))
            (old_wf, old_task), (new_wf, _) = done
            gone = api.get(f"/workflow/{old_wf}")
            assert gone.status_code == 404
            assert gone.json()["message"] == f"No such workflow found by id: {old_wf}"
            assert api.get(f"/tasks/{old_task}").status_code == 404
            assert api.get(f"/workflow/{new_wf}").json()["status"] == "COMPLETED"
        finally:
            api.close()


class RecordingStore(Store):
    """What the ``store=`` hook is for: a subclass that sees every call through the public API."""

    def __init__(self) -> None:
        super().__init__(max_finished_workflows=5)
        self.claimed: list[str] = []
        self.leased: list[str] = []

    def poll(self, task_type: str, **kwargs: Any) -> list[JSON]:
        got = super().poll(task_type, **kwargs)
        self.claimed.extend(str(t["taskId"]) for t in got)
        return got

    def update_task(self, body: Any) -> str:
        task_id = super().update_task(body)
        if isinstance(body, dict) and body.get("extendLease") is True:
            self.leased.append(task_id)
        return task_id


def test_a_store_handed_in_serves_the_http_api() -> None:
    store = RecordingStore()
    with EmbeddedServer(store=store) as srv:
        assert srv.store is store
        api = Harness(srv.url, "embedded")
        try:
            task_type, wf = api.one_task_workflow(responseTimeoutSeconds=60)
            api.start(wf)
            task = api.poll_one(task_type)
            lease = {"taskId": task["taskId"], "workflowInstanceId": task["workflowInstanceId"]}
            assert api.post("/tasks", json={**lease, "extendLease": True}).status_code == 200
        finally:
            api.close()
    assert store.claimed == [task["taskId"]]
    assert store.leased == [task["taskId"]]
    assert store.max_finished_workflows == 5  # the store's own bounds, not the server's defaults


def test_the_flag_is_offered_and_checked() -> None:
    helped = subprocess.run(
        [sys.executable, "-m", "cli", "server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert helped.returncode == 0
    assert "--max-finished-workflows" in helped.stdout
    refused = subprocess.run(
        [sys.executable, "-m", "cli", "server", "--port", "0", "--max-finished-workflows", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "max-finished-workflows" in refused.stderr


def test_the_flag_reaches_the_server() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "server", "--port", "0", "--max-finished-workflows", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        api = Harness(url, "embedded")
        try:
            _task_type, wf = api.one_task_workflow(responseTimeoutSeconds=60)
            ids = [api.start(wf) for _ in range(2)]
            for wf_id in ids:
                assert api.delete(f"/workflow/{wf_id}", params={"reason": "x"}).status_code == 200
            assert api.get(f"/workflow/{ids[0]}").status_code == 404
            assert api.get(f"/workflow/{ids[1]}").json()["status"] == "TERMINATED"
        finally:
            api.close()
        assert requests.get(url.removesuffix("/api") + "/health", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)


def test_a_waiting_poll_keeps_its_queue_while_another_poll_of_the_type_ends() -> None:
    """Queues that only polls made are forgotten after the poll (any name can be polled), but never
    while a long poll still waits on one: a task scheduled later must wake it."""
    store = Store()
    try:
        got: list[list[JSON]] = []
        waiter = threading.Thread(target=lambda: got.append(store.poll("later", timeout_ms=5000)))
        waiter.start()
        wait_until(lambda: "later" in store.queue_sizes(), timeout_seconds=5, what="the long poll to wait")
        assert store.poll("later", timeout_ms=0) == []  # ends while the first still waits
        assert "later" in store.queue_sizes()
        store.register_task_defs([{"name": "later", "responseTimeoutSeconds": 10}])
        store.register_workflow_def({"name": "w", "tasks": [{"name": "later", "taskReferenceName": "b"}]})
        store.start_workflow("w", {})
        waiter.join(10)
        assert not waiter.is_alive() and len(got) == 1 and len(got[0]) == 1  # woken by the new task
    finally:
        store.close()
