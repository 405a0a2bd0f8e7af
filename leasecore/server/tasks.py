"""Task traffic of the embedded server: long polls, updates (§3), extendLease, logs, poll data, queues.

Owns: what a worker's calls do to a task. Handed the store's state, its views, its decider (an update
that ends a task moves its workflow on) and its due schedule (a claim or a lease extension moves a
response timeout). Threads: the HTTP server's request threads, each holding the store's lock for its
call; a long poll waits on its queue's condition (made on that lock), releasing it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from typing import Any

from leasecore.server.decider import Decider
from leasecore.server.queues import DelayQueue
from leasecore.server.records import (
    JSON,
    MAX_LONG_POLL_MS,
    TASK_EXEC_LOG_SIZE_LIMIT,
    UPDATE_STATUSES,
    ApiError,
    TaskRecord,
    as_int,
    bad_request,
    binding_error,
    queue_name,
    validation_failed,
)
from leasecore.server.storestate import StoreState
from leasecore.server.timers import DueSchedule
from leasecore.server.views import StoreViews


class TaskCalls:
    """What workers call. Public methods take the lock."""

    def __init__(self, state: StoreState, views: StoreViews, decider: Decider, schedule: DueSchedule) -> None:
        self._state = state
        self._views = views
        self._decider = decider
        self._due = schedule

    def poll(
        self,
        task_type: str,
        *,
        count: int = 1,
        timeout_ms: int = 100,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[JSON]:
        """Batch poll, a real long poll: returns once a task is ready, or ``[]`` at the timeout."""
        if timeout_ms > MAX_LONG_POLL_MS:
            raise bad_request("Long Poll Timeout value cannot be more than 5 seconds")
        qname = queue_name(task_type, domain)
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000.0
        out: list[JSON] = []
        with self._state.lock:
            q = self._state.queue(qname)
            q.pollers += 1
            try:
                self._poll_queue(q, count, deadline, worker_id, out)
            finally:
                q.pollers -= 1
                # A poll of a type nothing was ever scheduled for (a typo, a scanner) leaves no queue
                # behind: any name can be polled, and the server must not grow with each one.
                if q.disposable and self._state.queues.get(qname) is q:
                    del self._state.queues[qname]
            self._record_poll(task_type, domain, worker_id)
        return out

    def _poll_queue(
        self, q: DelayQueue, count: int, deadline: float, worker_id: str | None, out: list[JSON]
    ) -> None:
        """The body of ``poll``, under the lock: claim up to ``count`` ready tasks of ``q`` into ``out``,
        waiting until ``deadline`` for the first."""
        while count > 0:
            now = self._state.now()
            for task_id in q.pop_ready(now, count - len(out)):
                task = self._state.tasks.get(task_id)
                if task is None or task.terminal:
                    continue
                self._claim(task, worker_id, now)
                out.append(self._views.polled_json(task))
            if out or self._state.closed:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            nxt = q.next_available()
            if nxt is not None:
                remaining = min(remaining, max(nxt - self._state.now(), 0.001))
            q.cond.wait(remaining)

    def _claim(self, task: TaskRecord, worker_id: str | None, now: float) -> None:
        task.status = "IN_PROGRESS"
        if task.start_time is None:
            task.start_time = now
        task.callback_after_seconds = 0
        task.worker_id = worker_id
        task.poll_count += 1
        task.update_time = now
        wf = self._state.workflows[task.workflow_id]
        self._due.reschedule(wf)

    def _record_poll(self, task_type: str, domain: str | None, worker_id: str | None) -> None:
        now = self._state.now()
        key = (task_type, domain if domain is not None else "DEFAULT")
        entry: JSON = {"queueName": task_type, "lastPollTime": self._state.epoch_ms(now)}
        if domain is not None:
            entry["domain"] = domain
        if worker_id is not None:
            entry["workerId"] = worker_id
        self._state.remember_poll(key, entry, now)

    def poll_data(self, task_type: str | None) -> list[JSON]:
        with self._state.lock:
            return [
                dict(v)
                for (tt, _), v in sorted(self._state.poll_data.items())
                if task_type is None or tt == task_type
            ]

    def queue_size(self, task_type: str, domain: str | None = None) -> int:
        with self._state.lock:
            q = self._state.queues.get(queue_name(task_type, domain))
            return len(q) if q is not None else 0

    def queue_sizes(self) -> dict[str, int]:
        with self._state.lock:
            return {name: len(q) for name, q in sorted(self._state.queues.items())}

    def listed_queue_sizes(self) -> dict[str, int]:
        """``GET /api/tasks/queue/all``: as on the real server, only queues something was ever queued
        in (not one a long poll merely waits on)."""
        with self._state.lock:
            return {name: len(q) for name, q in sorted(self._state.queues.items()) if q.ever_pushed}

    def apply_update(self, body: Any) -> tuple[str, TaskRecord | None]:
        """``POST /api/tasks``: every rule of CONDUCTOR_PROTOCOL.md §3, in order; returns the taskId
        and the task (None for a lease extension)."""
        if not isinstance(body, dict):
            raise binding_error("Cannot deserialize the TaskResult: expected a JSON object")
        status = body.get("status")
        if status is not None and status not in UPDATE_STATUSES:
            raise binding_error(
                f"Cannot deserialize value of type `TaskResult$Status` from String {status!r}: "
                f"not one of the values accepted for Enum class: {sorted(UPDATE_STATUSES)}"
            )
        output = body.get("outputData")
        if output is not None and not isinstance(output, dict):
            raise binding_error("Cannot deserialize outputData: expected a JSON object")
        logs = body.get("logs")
        if logs is not None and not isinstance(logs, list):
            raise binding_error("Cannot deserialize logs: expected a JSON array")
        callback = as_int(body.get("callbackAfterSeconds"), 0)
        raw_task_id, raw_wf_id = body.get("taskId"), body.get("workflowInstanceId")
        errors: list[JSON] = []
        if raw_task_id is None or raw_task_id == "":
            errors.append(
                {"path": "updateTask.taskResult.taskId", "message": "Task ID cannot be null or empty"}
            )
        if raw_wf_id is None or raw_wf_id == "":
            errors.append(
                {
                    "path": "updateTask.taskResult.workflowInstanceId",
                    "message": "Workflow Id cannot be null or empty",
                }
            )
        if errors:
            raise validation_failed(errors)
        task_id, workflow_id = str(raw_task_id), str(raw_wf_id)

        if body.get("extendLease") is True and self._state.lease_write_back is not None:
            return self._extend_lease_by_copy(task_id), None
        with self._state.lock:
            now = self._state.now()
            if body.get("extendLease") is True:
                task = self._state.tasks.get(task_id)
                if task is None:
                    raise ApiError(404, f"No such task found by id: {task_id}")
                if not task.terminal:
                    task.update_time = now
                    if self._state.sweep_mode == "ideal":
                        # The real server leaves its decider queue alone here; "coarse" does too.
                        self._due.reschedule(self._state.workflows[task.workflow_id])
                return task_id, None
            wf = self._state.workflows.get(workflow_id)
            if wf is None:
                raise ApiError(404, f"No such workflow found by id: {workflow_id}")
            task = self._state.tasks.get(task_id)
            if task is None:
                raise ApiError(404, f"No such task found by id: {task_id}")
            wf = self._state.workflows[task.workflow_id]
            if task.terminal:
                self._state.dequeue(task.queue_name, task.task_id)
                return task_id, task
            if wf.terminal:
                self._state.dequeue(task.queue_name, task.task_id)
                return task_id, task
            if status is None:
                raise ApiError(500, 'Cannot invoke "TaskResult$Status.name()": status is null')
            worker = body.get("workerId")
            task.output_data = copy.deepcopy(output) if output is not None else {}
            reason = body.get("reasonForIncompletion")
            task.reason = str(reason) if reason is not None else None
            task.worker_id = str(worker) if worker is not None else None
            task.callback_after_seconds = callback
            if status == "IN_PROGRESS":
                task.status = "SCHEDULED"
                self._state.queue(task.queue_name).push(task.task_id, now + max(callback, 0))
                self._state.notify_queue(task.queue_name)
            else:
                task.status = status
                task.end_time = now
                self._state.dequeue(task.queue_name, task.task_id)
            task.update_time = now
            wf.update_time = now
            if logs:
                self._store_logs(task.task_id, logs[:TASK_EXEC_LOG_SIZE_LIMIT], now)
            self._decider.decide(wf, now)
            return task_id, task

    def _extend_lease_by_copy(self, task_id: str) -> str:
        """extendLease as the real server does it (CONDUCTOR_PROTOCOL.md §3, ``EDF.extendLease``): load
        the task, check "not terminal" on that copy, call ``lease_write_back()`` (the store unlocked),
        then write the whole copy back with a new updateTime. A final update handled in between is
        undone (status IN_PROGRESS again, its output gone) while its workflow went on: the real
        server's lost update, made certain here so that a test can show what a worker does about it.
        Test-only."""
        with self._state.lock:
            task = self._state.tasks.get(task_id)
            if task is None:
                raise ApiError(404, f"No such task found by id: {task_id}")
            if task.terminal:
                return task_id
            loaded = copy.deepcopy(vars(task))
            between = self._state.lease_write_back
        if between is not None:
            between()  # the window between the load and the write
        with self._state.lock:
            if self._state.tasks.get(task_id) is task:  # (not forgotten meanwhile)
                vars(task).update(loaded)
                task.update_time = self._state.now()
        return task_id

    def _store_logs(self, task_id: str, logs: Iterable[Any], now: float) -> None:
        entries = self._state.log_entries(task_id)
        epoch_ms = self._state.epoch_ms
        for item in logs:
            if isinstance(item, dict):
                created = item.get("createdTime")
                entries.append(
                    {
                        "log": item.get("log"),
                        "taskId": str(item.get("taskId") or task_id),
                        "createdTime": created if isinstance(created, int) else epoch_ms(now),
                    }
                )
            else:
                entries.append({"log": str(item), "taskId": task_id, "createdTime": epoch_ms(now)})
        self._state.trim_logs(entries)

    def get_task(self, task_id: str) -> JSON:
        with self._state.lock:
            task = self._state.tasks.get(task_id)
            if task is None:
                raise ApiError(404, f"Task not found for taskId: {task_id}")
            return self._views.task_json(task)

    def add_log(self, task_id: str, text: str) -> None:
        with self._state.lock:
            self._store_logs(task_id, [text], self._state.now())

    def get_logs(self, task_id: str) -> list[JSON]:
        with self._state.lock:
            return [dict(e) for e in self._state.logs.get(task_id, [])]
