"""The decider of the embedded server: schedules, times out, retries and ends workflows (§5-§7).

Owns: every change of a workflow's course. Handed the store's state and its due schedule (re-armed
after each decision). Runs with the store's lock held, synchronously from start / update / terminate /
decide calls and from the timer thread. Only SIMPLE tasks, in sequence.
"""

from __future__ import annotations

import copy

from leasecore.server.definitions import resolve_expressions, retry_delay
from leasecore.server.records import (
    ACTIVE_WORKER_LAST_POLL_SECONDS,
    JSON,
    RETRIABLE_TASK,
    SUCCESSFUL_TASK,
    TERMINAL_TASK,
    TaskRecord,
    WorkflowRecord,
    as_int,
    passed,
    queue_name,
)
from leasecore.server.storestate import StoreState
from leasecore.server.timers import DueSchedule


class Decider:
    """Brings workflows up to date (the store's lock held)."""

    def __init__(self, state: StoreState, schedule: DueSchedule) -> None:
        self._state = state
        self._due = schedule

    def _schedule(self, wf: WorkflowRecord, index: int, now: float) -> None:
        wt = wf.definition["tasks"][index]
        td = wt["taskDefinition"]
        task = TaskRecord(
            task_id=self._state.new_id(),
            workflow_id=wf.workflow_id,
            workflow_type=wf.name,
            correlation_id=wf.correlation_id,
            task_type=wt["name"],
            ref_name=wt["taskReferenceName"],
            workflow_task=wt,
            task_def=td,
            input_data=resolve_expressions(copy.deepcopy(wt.get("inputParameters") or {}), self._ctx(wf)),
            seq=len(wf.tasks) + 1,
            scheduled_time=now,
            first_scheduled_time=now,
            workflow_priority=wf.priority,
            update_time=now,
        )
        task.domain = self._resolve_domain(wf, task.task_type, now)
        self._enqueue(wf, task, now)

    def _enqueue(self, wf: WorkflowRecord, task: TaskRecord, now: float) -> None:
        task.queue_name = queue_name(task.task_type, task.domain)
        wf.tasks.append(task)
        self._state.tasks[task.task_id] = task
        self._state.queue(task.queue_name).push(task.task_id, now + task.start_delay_seconds)
        self._state.notify_queue(task.queue_name)

    def _resolve_domain(self, wf: WorkflowRecord, task_type: str, now: float) -> str | None:
        spec = wf.task_to_domain.get(task_type) or wf.task_to_domain.get("*")
        if not spec:
            return None
        candidates = [d.strip() for d in spec.split(",") if d.strip()]
        for d in candidates:
            if d == "NO_DOMAIN":
                return None
            last = self._state.poll_mono.get((task_type, d))
            if last is not None and now - last <= ACTIVE_WORKER_LAST_POLL_SECONDS:
                return d
        if not candidates or candidates[-1] == "NO_DOMAIN":
            return None
        return candidates[-1]

    def _ctx(self, wf: WorkflowRecord) -> JSON:
        ctx: JSON = {}
        for t in wf.tasks:  # later attempts overwrite earlier ones
            ctx[t.ref_name] = {
                "input": t.input_data,
                "output": t.output_data,
                "taskId": t.task_id,
                "status": t.status,
                "retryCount": t.retry_count,
                "reasonForIncompletion": t.reason,
                "workerId": t.worker_id,
            }
        ctx["workflow"] = {
            "input": wf.input,
            "output": wf.output,
            "workflowId": wf.workflow_id,
            "correlationId": wf.correlation_id,
            "workflowType": wf.name,
            "version": wf.version,
            "status": wf.status,
            "env": self._state.env_values(),  # ${workflow.env.X}: CONDUCTOR_ENV_X, resolved when scheduled
        }
        return ctx

    def decide(self, wf: WorkflowRecord, now: float) -> None:
        """Bring one workflow up to date: timeouts, retries, next task, outcome; then re-arm its timer."""
        while not wf.terminal:
            wd = wf.definition
            wf_timeout = as_int(wd.get("timeoutSeconds"), 0)
            if wf_timeout > 0 and passed(now, wf.create_time, wf_timeout):
                if wd.get("timeoutPolicy") == "TIME_OUT_WF":
                    self.end_workflow(
                        wf,
                        "TIMED_OUT",
                        f"Workflow timed out after {int(now - wf.create_time)} seconds. Timeout "
                        f"configured as {wf_timeout} seconds. Timeout policy configured to TIME_OUT_WF",
                        now,
                    )
                    break
                wf.alerted = True
            if not wf.tasks:
                self._schedule(wf, 0, now)
                continue
            last = wf.tasks[-1]
            if not last.terminal:
                self._check_timeouts(wf, last, now)
                if wf.terminal or last.status not in TERMINAL_TASK:  # still running: done for now
                    break
                continue
            if last.status in SUCCESSFUL_TASK:
                index = next(
                    i for i, wt in enumerate(wd["tasks"]) if wt["taskReferenceName"] == last.ref_name
                )
                if index + 1 < len(wd["tasks"]):
                    self._schedule(wf, index + 1, now)
                    continue
                self._complete_workflow(wf, now)
                break
            self._retry_or_fail(wf, last, now)
        self._due.reschedule(wf)

    def _check_timeouts(self, wf: WorkflowRecord, task: TaskRecord, now: float) -> None:
        td = task.task_def
        policy = td.get("timeoutPolicy", "TIME_OUT_WF")
        total = as_int(td.get("totalTimeoutSeconds"), 0)
        if total > 0 and "total" not in task.alerted and passed(now, task.first_scheduled_time, total):
            reason = (
                f"Task total timeout exceeded: {int(now - task.first_scheduled_time)} seconds since first"
                f" scheduled. Total timeout configured as {total} seconds. Timeout policy configured to"
                f" {policy}"
            )
            task.no_retry = True
            self._apply_timeout_policy(wf, task, policy, reason, "total", now)
            return
        timeout = as_int(td.get("timeoutSeconds"), 0)
        if (
            timeout > 0
            and task.start_time is not None
            and "task" not in task.alerted
            and passed(now, task.start_time, task.start_delay_seconds, timeout)
        ):
            elapsed = int(now - task.start_time)
            reason = (
                f"Task timed out after {elapsed} seconds. Timeout configured as {timeout} seconds. "
                f"Timeout policy configured to {policy}"
            )
            self._apply_timeout_policy(wf, task, policy, reason, "task", now)
            return
        poll_timeout = as_int(td.get("pollTimeoutSeconds"), 0)
        if (
            task.status == "SCHEDULED"
            and poll_timeout > 0
            and "poll" not in task.alerted
            and passed(now, task.scheduled_time, task.start_delay_seconds, poll_timeout,
                       task.callback_after_seconds)
        ):
            reason = (
                f"Task poll timed out after {int(now - task.scheduled_time)} seconds. Poll timeout "
                f"configured as {poll_timeout} seconds. Timeout policy configured to {policy}"
            )
            self._apply_timeout_policy(wf, task, policy, reason, "poll", now)
            return
        r = task.response_timeout_seconds
        if (
            task.status == "IN_PROGRESS"
            and r != 0
            and task.update_time is not None
            and passed(now, task.update_time, r, task.callback_after_seconds)
        ):
            task.status = "TIMED_OUT"
            task.reason = (
                f"responseTimeout: {r} exceeded for the taskId: {task.task_id} "
                f"with Task Definition: {td.get('name', task.task_type)}"
            )
            task.end_time = now
            task.update_time = now
            self._state.dequeue(task.queue_name, task.task_id)

    def _apply_timeout_policy(
        self, wf: WorkflowRecord, task: TaskRecord, policy: str, reason: str, kind: str, now: float
    ) -> None:
        if policy == "ALERT_ONLY":
            task.alerted.add(kind)
            return
        task.status = "TIMED_OUT"
        task.reason = reason
        task.end_time = now
        task.update_time = now
        self._state.dequeue(task.queue_name, task.task_id)
        if policy == "TIME_OUT_WF":
            self._fail_workflow(wf, task, "TIMED_OUT", reason, now)

    def _retry_or_fail(self, wf: WorkflowRecord, task: TaskRecord, now: float) -> None:
        wt = task.workflow_task
        expected = as_int(wt.get("retryCount"), as_int(task.task_def.get("retryCount"), 3))
        if task.status in RETRIABLE_TASK and not task.no_retry and task.retry_count < expected:
            delay = retry_delay(task.task_def, task.retry_count)
            task.retried = True
            retry = TaskRecord(
                task_id=self._state.new_id(),
                workflow_id=task.workflow_id,
                workflow_type=task.workflow_type,
                correlation_id=task.correlation_id,
                task_type=task.task_type,
                ref_name=task.ref_name,
                workflow_task=task.workflow_task,
                task_def=task.task_def,
                input_data=copy.deepcopy(task.input_data),
                seq=len(wf.tasks) + 1,
                scheduled_time=now,
                first_scheduled_time=task.first_scheduled_time,
                workflow_priority=task.workflow_priority,
                retry_count=task.retry_count + 1,
                retried_task_id=task.task_id,
                callback_after_seconds=delay,
                start_delay_seconds=delay,
                update_time=now,
                domain=task.domain,
            )
            self._enqueue(wf, retry, now)
            return
        if wt.get("optional") is True:
            task.status = "COMPLETED_WITH_ERRORS"
            return
        status = {"CANCELED": "TERMINATED", "TIMED_OUT": "TIMED_OUT"}.get(task.status, "FAILED")
        message = f"Task {task.task_id} failed with status: {status} and reason: '{task.reason}'"
        self._fail_workflow(wf, task, status, message, now)

    def _fail_workflow(
        self, wf: WorkflowRecord, task: TaskRecord, status: str, reason: str, now: float
    ) -> None:
        if status == "FAILED":  # as 3.32.1 does: not while retrying, not for a TIMED_OUT workflow
            if task.ref_name not in wf.failed_refs:
                wf.failed_refs.append(task.ref_name)
            if task.task_type not in wf.failed_task_names:
                wf.failed_task_names.append(task.task_type)
        wf.output = copy.deepcopy(task.output_data)
        self.end_workflow(wf, status, reason, now)

    def _complete_workflow(self, wf: WorkflowRecord, now: float) -> None:
        params = wf.definition.get("outputParameters") or {}
        if params:
            wf.output = resolve_expressions(copy.deepcopy(params), self._ctx(wf))
        else:
            wf.output = copy.deepcopy(wf.tasks[-1].output_data) if wf.tasks else {}
        wf.status = "COMPLETED"
        wf.end_time = now
        wf.update_time = now
        self._finish(wf)

    def end_workflow(self, wf: WorkflowRecord, status: str, reason: str | None, now: float) -> None:
        for t in wf.tasks:
            if not t.terminal:
                t.status = "CANCELED"
                t.end_time = now
                t.update_time = now
                self._state.dequeue(t.queue_name, t.task_id)
        wf.status = status
        wf.reason = reason
        wf.end_time = now
        wf.update_time = now
        self._due.reschedule(wf)
        self._finish(wf)

    def _finish(self, wf: WorkflowRecord) -> None:
        """Count ``wf`` among the finished workflows; those the bound forgets leave the schedule too."""
        for forgotten in self._state.finished_workflow(wf):
            self._due.forget(forgotten)
