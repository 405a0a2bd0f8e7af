"""JSON views of the store's records, shaped like the real server's ``Task`` and ``Workflow``.

Threads: the request threads, under the store's lock.
"""

from __future__ import annotations

import copy

from leasecore.server.records import JSON, TaskRecord, WorkflowRecord, as_int
from leasecore.server.state import StoreState


class StoreViews(StoreState):
    """Renders records as JSON (``_lock`` held)."""

    def _task_json(self, t: TaskRecord) -> JSON:
        now = self._now()
        queue_wait = 0
        if t.start_time is not None:
            queue_wait = max(self.epoch_ms(t.start_time) - self.epoch_ms(t.scheduled_time), 0)
        out: JSON = {
            "taskType": t.task_type,
            "status": t.status,
            "inputData": copy.deepcopy(t.input_data),
            "referenceTaskName": t.ref_name,
            "retryCount": t.retry_count,
            "seq": t.seq,
            "pollCount": t.poll_count,
            "taskDefName": t.task_type,
            "scheduledTime": self.epoch_ms(t.scheduled_time),
            "startTime": self.epoch_ms(t.start_time),
            "endTime": self.epoch_ms(t.end_time),
            "updateTime": self.epoch_ms(t.update_time),
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
            else self.epoch_ms(now) - self.epoch_ms(t.scheduled_time),
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

    def _workflow_json(self, wf: WorkflowRecord, *, include_tasks: bool) -> JSON:
        out: JSON = {
            "workflowId": wf.workflow_id,
            "workflowName": wf.name,
            "workflowVersion": wf.version,
            "status": wf.status,
            "input": copy.deepcopy(wf.input),
            "output": copy.deepcopy(wf.output),
            "tasks": [self._task_json(t) for t in wf.tasks] if include_tasks else [],
            "createTime": self.epoch_ms(wf.create_time),
            "updateTime": self.epoch_ms(wf.update_time),
            "startTime": self.epoch_ms(wf.create_time),
            "endTime": self.epoch_ms(wf.end_time),
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
