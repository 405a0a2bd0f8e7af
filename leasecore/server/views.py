"""JSON views of the store's records, shaped like the real server's ``Task`` and ``Workflow``.

Owns: how a record reads as JSON, and the copy of a task a poll hands out (secrets resolved into it).
Must not: change a record. Threads: the request threads, under the store's lock.
"""

from __future__ import annotations

import copy
import json
import logging

from leasecore.server.definitions import SECRET_REF, resolve_secret_refs
from leasecore.server.records import JSON, TaskRecord, WorkflowRecord, as_int
from leasecore.server.storestate import ENV_PREFIX, SECRET_PREFIX, StoreState

log = logging.getLogger("conductor_run.server")


class StoreViews:
    """Renders records as JSON (the store's lock held)."""

    def __init__(self, state: StoreState) -> None:
        self._state = state

    def task_json(self, t: TaskRecord) -> JSON:
        """A task as ``GET /api/tasks/{id}`` shows it."""
        epoch_ms = self._state.epoch_ms
        now = self._state.now()
        queue_wait = 0
        if t.start_time is not None:
            queue_wait = max(epoch_ms(t.start_time) - epoch_ms(t.scheduled_time), 0)
        out: JSON = {
            "taskType": t.task_type,
            "status": t.status,
            "inputData": copy.deepcopy(t.input_data),
            "referenceTaskName": t.ref_name,
            "retryCount": t.retry_count,
            "seq": t.seq,
            "pollCount": t.poll_count,
            "taskDefName": t.task_type,
            "scheduledTime": epoch_ms(t.scheduled_time),
            "startTime": epoch_ms(t.start_time),
            "endTime": epoch_ms(t.end_time),
            "updateTime": epoch_ms(t.update_time),
            "startDelayInSeconds": t.start_delay_seconds,
            "retried": t.retried,
            "executed": t.terminal,
            "callbackFromWorker": True,
            "responseTimeoutSeconds": t.response_timeout_seconds,
            "workflowInstanceId": t.workflow_id,
            "workflowType": t.workflow_type,
            "taskId": t.task_id,
            "callbackAfterSeconds": t.callback_after_seconds,
            "outputData": copy.deepcopy(t.output_data),
            "workflowTask": copy.deepcopy(t.workflow_task),
            "rateLimitPerFrequency": as_int(t.task_def.get("rateLimitPerFrequency"), 0),
            "rateLimitFrequencyInSeconds": as_int(t.task_def.get("rateLimitFrequencyInSeconds"), 1),
            "workflowPriority": t.workflow_priority,
            "iteration": 0,
            "subworkflowChanged": False,
            "loopOverTask": False,
            "taskDefinition": copy.deepcopy(t.task_def),
            "queueWaitTime": queue_wait
            if t.start_time is not None
            else epoch_ms(now) - epoch_ms(t.scheduled_time),
        }
        for key, value in (
            ("correlationId", t.correlation_id),
            ("retriedTaskId", t.retried_task_id),
            ("reasonForIncompletion", t.reason),
            ("workerId", t.worker_id),
            ("domain", t.domain),
        ):
            if value is not None:
                out[key] = value
        return out

    def workflow_json(self, wf: WorkflowRecord, *, include_tasks: bool) -> JSON:
        """A workflow as ``GET /api/workflow/{id}`` shows it."""
        epoch_ms = self._state.epoch_ms
        out: JSON = {
            "workflowId": wf.workflow_id,
            "workflowName": wf.name,
            "workflowVersion": wf.version,
            "status": wf.status,
            "input": copy.deepcopy(wf.input),
            "output": copy.deepcopy(wf.output),
            "tasks": [self.task_json(t) for t in wf.tasks] if include_tasks else [],
            "createTime": epoch_ms(wf.create_time),
            "updateTime": epoch_ms(wf.update_time),
            "startTime": epoch_ms(wf.create_time),
            "endTime": epoch_ms(wf.end_time),
            "failedReferenceTaskNames": list(wf.failed_refs),
            "failedTaskNames": list(wf.failed_task_names),
            "workflowDefinition": copy.deepcopy(wf.definition),
            "taskToDomain": dict(wf.task_to_domain),
            "priority": wf.priority,
            "variables": {},
            "lastRetriedTime": 0,
        }
        if wf.correlation_id is not None:
            out["correlationId"] = wf.correlation_id
        if wf.reason is not None:
            out["reasonForIncompletion"] = wf.reason
        return out

    def polled_json(self, task: TaskRecord) -> JSON:
        """A task as a poll hands it out, resolved now from the server's environment (sent, never
        stored; ``runtime_environ``): ``${workflow.secrets.X}`` in its input, and ``runtimeMetadata``,
        the names its definition declares, secret first (CONDUCTOR_SECRET_<NAME>, then
        CONDUCTOR_ENV_<NAME>); a name that cannot be resolved is left out, with a warning."""
        out = self.task_json(task)
        environ = self._state.environ()
        if SECRET_REF in json.dumps(task.workflow_task.get("inputParameters") or {}):  # (the template: small)
            out["inputData"] = resolve_secret_refs(
                out["inputData"], lambda name: environ.get(SECRET_PREFIX + name)
            )
        names = task.task_def.get("runtimeMetadata")
        if not isinstance(names, list) or not names:
            return out
        resolved: JSON = {}
        for name in names:
            if not isinstance(name, str):
                continue
            value = environ.get(SECRET_PREFIX + name)
            if value is None:
                value = environ.get(ENV_PREFIX + name)
            if value is None:
                log.warning(
                    "task %s: declared secret/env %r not found in the environment", task.task_id, name
                )
                continue
            resolved[name] = value
        out["runtimeMetadata"] = resolved
        return out
