"""Workflows of the embedded server: start, read, terminate, decide (§4-§7).

Owns: a workflow's creation (its definition resolved and frozen into it) and the calls that read or
end one; every change of course is the decider's, handed in. Threads: the request threads; each
public method takes the store's lock.
"""

from __future__ import annotations

import copy
from typing import Any

from leasecore.server.decider import Decider
from leasecore.server.definitions import validate_workflow_def, with_defaults
from leasecore.server.metadata import MetadataCalls
from leasecore.server.records import JSON, ApiError, WorkflowRecord, as_obj, validation_failed
from leasecore.server.storestate import StoreState
from leasecore.server.views import StoreViews


class WorkflowCalls:
    """``/api/workflow``: start, read, terminate, decide."""

    def __init__(
        self, state: StoreState, views: StoreViews, decider: Decider, metadata: MetadataCalls
    ) -> None:
        self._state = state
        self._views = views
        self._decider = decider
        self._metadata = metadata

    def start_workflow(
        self,
        name: str | None,
        input_data: Any,
        *,
        version: int | None = None,
        correlation_id: str | None = None,
        task_to_domain: Any = None,
        workflow_def: Any = None,
        priority: int = 0,
    ) -> str:
        """Start a workflow (registered by name, or the inline ``workflow_def``); return its id."""
        inputs = as_obj(input_data, "the workflow input")
        domains = as_obj(task_to_domain, "taskToDomain")
        inline = None
        if workflow_def is not None:
            inline = validate_workflow_def(workflow_def, "startWorkflow.workflowDef")
        with self._state.lock:
            if inline is not None:
                definition = inline
            else:
                if not name:
                    raise validation_failed(
                        [
                            {
                                "path": "startWorkflow.request.name",
                                "message": "Workflow name cannot be null or empty",
                            }
                        ]
                    )
                definition = copy.deepcopy(self._metadata.find_workflow_def(name, version))
            for wt in definition["tasks"]:
                inline_td = wt.get("taskDefinition")
                if isinstance(inline_td, dict):
                    wt["taskDefinition"] = with_defaults(inline_td)
                else:
                    registered = self._state.task_defs.get(wt["name"])
                    wt["taskDefinition"] = (
                        copy.deepcopy(registered) if registered else with_defaults({"name": wt["name"]})
                    )
            now = self._state.now()
            wf = WorkflowRecord(
                workflow_id=self._state.new_id(),
                name=definition["name"],
                version=definition["version"],
                definition=definition,
                input=copy.deepcopy(inputs),
                correlation_id=correlation_id,
                task_to_domain={str(k): str(v) for k, v in domains.items()},
                priority=priority,
                create_time=now,
                update_time=now,
            )
            self._state.workflows[wf.workflow_id] = wf
            self._decider.decide(wf, now)
            return wf.workflow_id

    def get_workflow(self, workflow_id: str, *, include_tasks: bool = True) -> JSON:
        with self._state.lock:
            return self._views.workflow_json(self._state.workflow(workflow_id), include_tasks=include_tasks)

    def get_workflow_status(self, workflow_id: str) -> JSON:
        with self._state.lock:
            wf = self._state.workflow(workflow_id)
            out: JSON = {
                "workflowId": wf.workflow_id,
                "output": copy.deepcopy(wf.output),
                "variables": {},
                "status": wf.status,
            }
            if wf.correlation_id is not None:
                out["correlationId"] = wf.correlation_id
            return out

    def terminate_workflow(self, workflow_id: str, reason: str | None) -> None:
        with self._state.lock:
            wf = self._state.workflow(workflow_id)
            if wf.status == "COMPLETED":
                raise ApiError(409, f"Workflow is in terminal state. Status: {wf.status}")
            if wf.status == "TERMINATED":
                return
            now = self._state.now()
            self._decider.end_workflow(wf, "TERMINATED", reason, now)

    def decide(self, workflow_id: str) -> None:
        with self._state.lock:
            self._decider.decide(self._state.workflow(workflow_id), self._state.now())
