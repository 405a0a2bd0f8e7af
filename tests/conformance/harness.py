"""A small plain-HTTP helper for the conformance suite: works against any Conductor base URL.

Every name it registers is unique per call (the real server is shared by the whole session). Timeout
assertions never rely on the server's own sweeper: wait past the deadline, then :meth:`decide`.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, TypeVar

import requests

from tests.support import wait_until

T = TypeVar("T")

HTTP_TIMEOUT = 30.0


class Harness:
    """Convenience calls over ``requests``; raw responses are returned where the test checks them."""

    def __init__(self, base_url: str, kind: str) -> None:
        self.url = base_url.rstrip("/")
        self.root = self.url[: -len("/api")] if self.url.endswith("/api") else self.url
        self.kind = kind
        self.http = requests.Session()

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------------------------ raw calls

    def get(self, path: str, **kw: Any) -> requests.Response:
        return self.http.get(self.url + path, timeout=HTTP_TIMEOUT, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        return self.http.post(self.url + path, timeout=HTTP_TIMEOUT, **kw)

    def put(self, path: str, **kw: Any) -> requests.Response:
        return self.http.put(self.url + path, timeout=HTTP_TIMEOUT, **kw)

    def delete(self, path: str, **kw: Any) -> requests.Response:
        return self.http.delete(self.url + path, timeout=HTTP_TIMEOUT, **kw)

    # ------------------------------------------------------------------------------------ metadata

    def unique(self, prefix: str) -> str:
        return f"crconf_{prefix}_{uuid.uuid4().hex[:10]}"

    def task_def(self, *, name: str | None = None, **fields: Any) -> str:
        """Register one task def (R=2, retryCount=0, retryDelaySeconds=0 unless given); return its name."""
        name = name or self.unique("task")
        body = {"name": name, "responseTimeoutSeconds": 2, "retryCount": 0, "retryDelaySeconds": 0}
        body.update(fields)
        r = self.post("/metadata/taskdefs", json=[body])
        assert r.status_code == 200, r.text
        return name

    def workflow_def(self, *tasks: str | dict[str, Any], name: str | None = None, **fields: Any) -> str:
        """Register a workflow of SIMPLE tasks (a task name means ref = ``t<i>``); return its name."""
        name = name or self.unique("wf")
        wts: list[dict[str, Any]] = []
        for i, t in enumerate(tasks):
            if isinstance(t, str):
                wts.append({"name": t, "taskReferenceName": f"t{i}", "type": "SIMPLE"})
            else:
                wts.append({"type": "SIMPLE", **t})
        body = {
            "name": name,
            "version": 1,
            "schemaVersion": 2,
            "tasks": wts,
            "ownerEmail": "test@example.com",
        }
        body.update(fields)
        r = self.post("/metadata/workflow", json=body)
        assert r.status_code == 200, r.text
        return name

    def one_task_workflow(self, **task_fields: Any) -> tuple[str, str]:
        """A task def plus a one-task workflow around it: ``(task_type, workflow_name)``."""
        task_type = self.task_def(**task_fields)
        return task_type, self.workflow_def(task_type)

    # ------------------------------------------------------------------------------------ workflows

    def start(self, workflow: str, inputs: dict[str, Any] | None = None, **params: Any) -> str:
        r = self.post(f"/workflow/{workflow}", json=inputs or {}, params=params)
        assert r.status_code == 200, r.text
        return r.text

    def workflow(self, workflow_id: str) -> dict[str, Any]:
        r = self.get(f"/workflow/{workflow_id}", params={"includeTasks": "true"})
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def tasks(self, workflow_id: str) -> list[dict[str, Any]]:
        tasks: list[dict[str, Any]] = self.workflow(workflow_id)["tasks"]
        return tasks

    def task(self, task_id: str) -> dict[str, Any]:
        r = self.get(f"/tasks/{task_id}")
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def decide(self, workflow_id: str) -> None:
        r = self.put(f"/workflow/decide/{workflow_id}")
        assert r.status_code in (200, 204), r.text

    def terminate(self, workflow_id: str, reason: str = "test") -> requests.Response:
        return self.delete(f"/workflow/{workflow_id}", params={"reason": reason})

    # ------------------------------------------------------------------------------------ tasks

    def poll_batch(
        self,
        task_type: str,
        *,
        count: int = 1,
        timeout_ms: int = 100,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"count": count, "timeout": timeout_ms}
        if worker_id is not None:
            params["workerid"] = worker_id
        if domain is not None:
            params["domain"] = domain
        r = self.get(f"/tasks/poll/batch/{task_type}", params=params)
        assert r.status_code == 200, r.text
        got: list[dict[str, Any]] = r.json()
        return got

    def poll_one(
        self, task_type: str, *, worker_id: str = "conformance", timeout_s: float = 10.0
    ) -> dict[str, Any]:
        """Poll until one task arrives (the real server may take a moment to enqueue)."""
        def one() -> dict[str, Any] | None:
            got = self.poll_batch(task_type, timeout_ms=1000, worker_id=worker_id)
            return got[0] if got else None

        return wait_until(one, timeout_s, f"a task of type {task_type}")

    def update(self, task: dict[str, Any], status: str | None, **fields: Any) -> requests.Response:
        body: dict[str, Any] = {"taskId": task["taskId"], "workflowInstanceId": task["workflowInstanceId"]}
        if status is not None:
            body["status"] = status
        body.update(fields)
        return self.post("/tasks", json=body, headers={"Accept": "*/*"})

    def extend_lease(self, task: dict[str, Any]) -> requests.Response:
        body = {
            "taskId": task["taskId"],
            "workflowInstanceId": task["workflowInstanceId"],
            "status": "IN_PROGRESS",
            "extendLease": True,
        }
        return self.post("/tasks", json=body, headers={"Accept": "*/*"})

    def keep_alive(self, task: dict[str, Any], seconds: float, every: float = 0.4) -> None:
        """Heartbeat ``task`` with extendLease every ``every`` seconds for ``seconds``."""
        end = time.monotonic() + seconds
        while True:
            r = self.extend_lease(task)
            assert r.status_code == 200, r.text
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(every, left))


def sleep_past(seconds: float) -> None:
    """Let a server-side deadline pass (a timeout test's subject is time itself, so this is no race)."""
    time.sleep(seconds)
