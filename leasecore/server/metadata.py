"""Task and workflow definitions of the embedded server: register, update, read, delete (§9).

Owns: the definition tables' rules (validation, defaults, versions). Must not: start or change a
workflow. Threads: the request threads; each public method takes the store's lock.
"""

from __future__ import annotations

import copy
from typing import Any

from leasecore.server.definitions import validate_task_def, validate_workflow_def, with_defaults
from leasecore.server.records import JSON, ApiError, binding_error, validation_failed
from leasecore.server.storestate import StoreState


class MetadataCalls:
    """``/api/metadata``: the definitions a workflow is started from."""

    def __init__(self, state: StoreState) -> None:
        self._state = state

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
        now = self._state.now()
        with self._state.lock:
            for td in body:
                stored = with_defaults(td)
                stored.setdefault("createTime", self._state.epoch_ms(now))
                self._state.task_defs[str(td["name"])] = stored

    def update_task_def(self, body: Any) -> None:
        errors = validate_task_def(body, "updateTaskDef.taskDefinition")
        if errors:
            raise validation_failed(errors)
        with self._state.lock:
            name = str(body["name"])
            if name not in self._state.task_defs:
                raise ApiError(404, f"No such taskType found by name: {name}")
            stored = with_defaults(body)
            stored["updateTime"] = self._state.epoch_ms(self._state.now())
            self._state.task_defs[name] = stored

    def get_task_def(self, name: str) -> JSON:
        with self._state.lock:
            td = self._state.task_defs.get(name)
            if td is None:
                raise ApiError(404, f"No such taskType found by name: {name}")
            return copy.deepcopy(td)

    def list_task_defs(self) -> list[JSON]:
        with self._state.lock:
            return [copy.deepcopy(td) for td in self._state.task_defs.values()]

    def delete_task_def(self, name: str) -> None:
        with self._state.lock:
            if self._state.task_defs.pop(name, None) is None:
                raise ApiError(404, f"No such taskType found by name: {name}")

    def register_workflow_def(self, body: Any, *, overwrite: bool = False) -> None:
        wd = validate_workflow_def(body, "registerWorkflowDef.workflowDef")
        with self._state.lock:
            versions = self._state.workflow_defs.setdefault(wd["name"], {})
            if wd["version"] in versions and not overwrite:
                raise ApiError(409, f"Workflow with {wd['name']}.{wd['version']} already exists!")
            wd.setdefault("createTime", self._state.epoch_ms(self._state.now()))
            versions[wd["version"]] = wd

    def update_workflow_defs(self, body: Any) -> None:
        if not isinstance(body, list):
            raise binding_error("Cannot deserialize the workflow definitions: expected a JSON array")
        defs = [validate_workflow_def(wd, f"update.workflowDefs[{i}]") for i, wd in enumerate(body)]
        with self._state.lock:
            for wd in defs:
                self._state.workflow_defs.setdefault(wd["name"], {})[wd["version"]] = wd

    def get_workflow_def(self, name: str, version: int | None = None) -> JSON:
        with self._state.lock:
            return copy.deepcopy(self.find_workflow_def(name, version))

    def find_workflow_def(self, name: str, version: int | None) -> JSON:
        """The stored definition (latest version when ``version`` is None); the lock held."""
        versions = self._state.workflow_defs.get(name) or {}
        if version is None and versions:
            return versions[max(versions)]
        if version is not None and version in versions:
            return versions[version]
        raise ApiError(
            404,
            f"No such workflow found by name: {name}, version: {'latest' if version is None else version}",
        )
