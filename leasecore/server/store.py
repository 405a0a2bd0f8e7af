"""State and decider of the embedded Conductor-compatible server (CONDUCTOR_PROTOCOL.md §2-§9).

Everything lives in memory behind one lock. Handler threads call the public methods; long polls wait
on a per-queue :class:`threading.Condition` built on that lock, so a push wakes exactly the pollers of
that queue. Time comes from an injected :class:`~leasecore.clock.Clock`: every decision reads
``clock.monotonic()``; the epoch-millisecond fields of the JSON are derived from it
(``wall at start + elapsed``), so they never go back even if the wall clock does.

Timer-driven checks (response timeout, task timeout, poll timeout, total and workflow timeouts) are
kept as one due time per running workflow in a heap; :meth:`Store.run_due` evaluates the workflows whose
time has come and :meth:`Store.wait_for_due` is what the server's single timer thread blocks on (woken
when an earlier due time appears). Unit tests drive :meth:`Store.run_due` with a ``FakeClock``.

``sweep_mode="coarse"`` imitates the SQLite-backed real server: the first timer-driven check of a
workflow fires on time, every later one only at the first 60 s "unack sweep" tick that is more than
60 s past the requested time (so 60-120 s late). Synchronous decides (start, update, terminate,
``PUT /api/workflow/decide``) are immediate in both modes, as on the real server.

The store is split along its seams: ``records`` (records, constants, error helpers), ``definitions``
(validation, defaults, expressions), ``queues`` (the delay queue), ``state`` (lock, clock, tables),
``views`` (JSON), ``timers`` (due heap, timer loop), ``decider``, ``tasks`` (polls, updates, logs) and
this module (metadata, workflows, bounds), which assembles :class:`Store` from them.

Known simplifications (documented in docs/embedded-server.md): only SIMPLE tasks, run in sequence; no rate or
concurrency limits; no external payload storage; no workflow pause/resume/restart/retry; a batch poll
returns as soon as at least one task is available (the SQLite queue keeps collecting until ``count``
or the timeout).
"""

from __future__ import annotations

import copy
from typing import Any

from leasecore.server.definitions import (
    resolve_expressions,
    validate_task_def,
    validate_workflow_def,
    with_defaults,
)
from leasecore.server.records import (
    JSON,
    TERMINAL_TASK,
    ApiError,
    SweepMode,
    TaskRecord,
    WorkflowRecord,
    as_int,
    as_obj,
    binding_error,
    queue_name,
    validation_failed,
)
from leasecore.server.tasks import StoreTasks

__all__ = [
    "JSON",
    "TERMINAL_TASK",
    "ApiError",
    "Store",
    "SweepMode",
    "TaskRecord",
    "WorkflowRecord",
    "queue_name",
    "resolve_expressions",
]


class Store(StoreTasks):
    """The whole server state. Every public method is thread-safe."""

    # ------------------------------------------------------------------------------------ metadata

    def register_task_defs(self, body: Any) -> None:
        if not isinstance(body, list):
            raise binding_error("Cannot deserialize the task definitions: expected a JSON array")
        if not body:
            raise validation_failed(
                [{"path": "registerTaskDef.taskDefinitions", "message": "TaskDefList cannot be empty"}]
            )
        errors: list[JSON] = []
        for i, td in enumerate(body):
            errors.extend(validate_task_def(td, f"registerTaskDef.taskDefinitions[{i}]"))
        if errors:
            raise validation_failed(errors)
        now = self._now()
        with self._lock:
            for td in body:
                stored = with_defaults(td)
                stored.setdefault("createTime", self.epoch_ms(now))
                self._task_defs[str(td["name"])] = stored

    def update_task_def(self, body: Any) -> None:
        errors = validate_task_def(body, "updateTaskDef.taskDefinition")
        if errors:
            raise validation_failed(errors)
        with self._lock:
            name = str(body["name"])
            if name not in self._task_defs:
                raise ApiError(404, f"No such taskType found by name: {name}")
            stored = with_defaults(body)
            stored["updateTime"] = self.epoch_ms(self._now())
            self._task_defs[name] = stored

    def get_task_def(self, name: str) -> JSON:
        with self._lock:
            td = self._task_defs.get(name)
            if td is None:
                raise ApiError(404, f"No such taskType found by name: {name}")
            return copy.deepcopy(td)

    def list_task_defs(self) -> list[JSON]:
        with self._lock:
            return [copy.deepcopy(td) for td in self._task_defs.values()]

    def delete_task_def(self, name: str) -> None:
        with self._lock:
            if self._task_defs.pop(name, None) is None:
                raise ApiError(404, f"No such taskType found by name: {name}")

    def register_workflow_def(self, body: Any, *, overwrite: bool = False) -> None:
        wd = validate_workflow_def(body, "registerWorkflowDef.workflowDef")
        with self._lock:
            versions = self._workflow_defs.setdefault(wd["name"], {})
            if wd["version"] in versions and not overwrite:
                raise ApiError(409, f"Workflow with {wd['name']}.{wd['version']} already exists!")
            wd.setdefault("createTime", self.epoch_ms(self._now()))
            versions[wd["version"]] = wd

    def update_workflow_defs(self, body: Any) -> None:
        if not isinstance(body, list):
            raise binding_error("Cannot deserialize the workflow definitions: expected a JSON array")
        defs = [validate_workflow_def(wd, f"update.workflowDefs[{i}]") for i, wd in enumerate(body)]
        with self._lock:
            for wd in defs:
                self._workflow_defs.setdefault(wd["name"], {})[wd["version"]] = wd

    def get_workflow_def(self, name: str, version: int | None = None) -> JSON:
        with self._lock:
            return copy.deepcopy(self._find_workflow_def(name, version))

    def _find_workflow_def(self, name: str, version: int | None) -> JSON:
        versions = self._workflow_defs.get(name) or {}
        if version is None and versions:
            return versions[max(versions)]
        if version is not None and version in versions:
            return versions[version]
        raise ApiError(
            404,
            f"No such workflow found by name: {name}, version: {'latest' if version is None else version}",
        )

    # ------------------------------------------------------------------------------------ workflows

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
        with self._lock:
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
                definition = copy.deepcopy(self._find_workflow_def(name, version))
            for wt in definition["tasks"]:
                inline_td = wt.get("taskDefinition")
                if isinstance(inline_td, dict):
                    wt["taskDefinition"] = with_defaults(inline_td)
                else:
                    registered = self._task_defs.get(wt["name"])
                    wt["taskDefinition"] = (
                        copy.deepcopy(registered) if registered else with_defaults({"name": wt["name"]})
                    )
            now = self._now()
            wf = WorkflowRecord(
                workflow_id=self._new_id(),
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
            self._workflows[wf.workflow_id] = wf
            self._decide(wf, now)
            return wf.workflow_id

    def start_workflow_request(self, body: Any) -> str:
        req = as_obj(body, "the StartWorkflowRequest")
        version = req.get("version")
        return self.start_workflow(
            req.get("name"),
            req.get("input"),
            version=None if version is None else as_int(version, 1),
            correlation_id=req.get("correlationId"),
            task_to_domain=req.get("taskToDomain"),
            workflow_def=req.get("workflowDef"),
            priority=as_int(req.get("priority"), 0),
        )

    def _workflow(self, workflow_id: str) -> WorkflowRecord:
        wf = self._workflows.get(workflow_id)
        if wf is None:
            raise ApiError(404, f"No such workflow found by id: {workflow_id}")
        return wf

    def get_workflow(self, workflow_id: str, *, include_tasks: bool = True) -> JSON:
        with self._lock:
            return self._workflow_json(self._workflow(workflow_id), include_tasks=include_tasks)

    def get_workflow_status(self, workflow_id: str) -> JSON:
        with self._lock:
            wf = self._workflow(workflow_id)
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
        with self._lock:
            wf = self._workflow(workflow_id)
            if wf.status == "COMPLETED":
                raise ApiError(409, f"Workflow is in terminal state. Status: {wf.status}")
            if wf.status == "TERMINATED":
                return
            now = self._now()
            self._end_workflow(wf, "TERMINATED", reason, now)

    def decide(self, workflow_id: str) -> None:
        with self._lock:
            self._decide(self._workflow(workflow_id), self._now())
