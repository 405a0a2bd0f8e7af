"""Calls a harness, the demo or a test needs beyond the worker protocol (CONDUCTOR_PROTOCOL.md §7).

Owns: task and workflow definitions, starting, reading, terminating and deciding workflows, reading
task logs, all through a client's ``request`` (``leasecore.conductor.client.ConductorClient``): no
HTTP of its own, no retries, no sleeps. The worker itself never calls these. Any thread (it keeps no
state of its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from leasecore.conductor.calls import TEXT_OR_JSON, Reply, path_segment, protocol_error
from leasecore.errors import ConductorRejected


class _Requests(Protocol):
    def request(
        self, method: str, path: str, *, params: Mapping[str, str | int] | None = None,
        json_body: Any = None, accept: str = ...,
    ) -> Reply: ...


class ConductorAdmin:
    """Calls a harness or the demo needs beyond the worker protocol (§7)."""

    def __init__(self, client: _Requests) -> None:
        self._client = client

    def register_task_defs(self, task_defs: Sequence[Mapping[str, Any]]) -> None:
        """Create or update task definitions (``POST /api/metadata/taskdefs``)."""
        self._client.request("POST", "/metadata/taskdefs", json_body=[dict(d) for d in task_defs])

    def register_workflow(self, workflow_def: Mapping[str, Any], *, overwrite: bool = False) -> None:
        """Register a workflow definition; with ``overwrite``, replace an existing name+version."""
        if not overwrite:
            self._client.request("POST", "/metadata/workflow", json_body=dict(workflow_def))
            return
        try:
            self._client.request(
                "POST", "/metadata/workflow", params={"overwrite": "true"}, json_body=dict(workflow_def)
            )
        except ConductorRejected as exc:
            if exc.status_code != 409:  # servers before 3.32 ignore ?overwrite=: update with PUT
                raise
            self._client.request("PUT", "/metadata/workflow", json_body=[dict(workflow_def)])

    def start_workflow(self, name: str, input_data: Mapping[str, Any], version: int | None = None) -> str:
        """Start a workflow; returns its id (the server answers ``text/plain``)."""
        params: dict[str, str | int] = {} if version is None else {"version": version}
        reply = self._client.request(
            "POST",
            f"/workflow/{path_segment(name)}",
            params=params,
            json_body=dict(input_data),
            accept=TEXT_OR_JSON,
        )
        workflow_id = reply.text.strip().strip('"')
        if not workflow_id:
            protocol_error(reply, "no workflow id in the answer")
        return workflow_id

    def get_workflow(self, workflow_id: str) -> dict[str, Any]:
        """The workflow with its tasks."""
        reply = self._client.request(
            "GET", f"/workflow/{path_segment(workflow_id)}", params={"includeTasks": "true"}
        )
        data = reply.json()
        if not isinstance(data, dict):
            protocol_error(reply, "expected a JSON object")
        return data

    def terminate_workflow(self, workflow_id: str, reason: str) -> None:
        """Terminate: its non-terminal tasks become CANCELED."""
        self._client.request(
            "DELETE", f"/workflow/{path_segment(workflow_id)}", params={"reason": reason}, accept=TEXT_OR_JSON
        )

    def decide(self, workflow_id: str) -> None:
        """Force a synchronous evaluation (runs the timeout checks now)."""
        self._client.request("PUT", f"/workflow/decide/{path_segment(workflow_id)}", accept=TEXT_OR_JSON)

    def get_logs(self, task_id: str) -> list[dict[str, Any]]:
        """The task's execution logs, oldest first; ``[]`` when there are none (204)."""
        reply = self._client.request("GET", f"/tasks/{path_segment(task_id)}/log")
        if reply.status_code == 204 or not reply.body.strip():
            return []
        data = reply.json()
        if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
            protocol_error(reply, "expected a JSON list of log entries")
        return data
