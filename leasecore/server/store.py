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

Known simplifications (documented in the README): only SIMPLE tasks, run in sequence; no rate or
concurrency limits; no external payload storage; no workflow pause/resume/restart/retry; a batch poll
returns as soon as at least one task is available (the SQLite queue keeps collecting until ``count``
or the timeout).
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import math
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorRunError

JSON = dict[str, Any]
SweepMode = Literal["ideal", "coarse"]

MAX_LONG_POLL_MS = 5000
TASK_EXEC_LOG_SIZE_LIMIT = 10
ACTIVE_WORKER_LAST_POLL_SECONDS = 10.0
COARSE_UNACK_PERIOD_SECONDS = 60.0

TERMINAL_TASK = frozenset(
    {
        "COMPLETED",
        "COMPLETED_WITH_ERRORS",
        "FAILED",
        "FAILED_WITH_TERMINAL_ERROR",
        "TIMED_OUT",
        "CANCELED",
        "SKIPPED",
    }
)
SUCCESSFUL_TASK = frozenset({"COMPLETED", "COMPLETED_WITH_ERRORS", "SKIPPED"})
RETRIABLE_TASK = frozenset({"FAILED", "TIMED_OUT"})
UPDATE_STATUSES = frozenset({"IN_PROGRESS", "COMPLETED", "FAILED", "FAILED_WITH_TERMINAL_ERROR", "CANCELED"})
TERMINAL_WORKFLOW = frozenset({"COMPLETED", "FAILED", "TIMED_OUT", "TERMINATED"})
TIMEOUT_POLICIES = frozenset({"RETRY", "TIME_OUT_WF", "ALERT_ONLY"})
RETRY_LOGICS = frozenset({"FIXED", "LINEAR_BACKOFF", "EXPONENTIAL_BACKOFF"})

TASKDEF_DEFAULTS: JSON = {
    "retryCount": 3,
    "retryDelaySeconds": 60,
    "retryLogic": "FIXED",
    "responseTimeoutSeconds": 3600,
    "timeoutSeconds": 0,
    "timeoutPolicy": "TIME_OUT_WF",
    "pollTimeoutSeconds": 0,
    "totalTimeoutSeconds": 0,
    "backoffScaleFactor": 1,
    "rateLimitPerFrequency": 0,
    "rateLimitFrequencyInSeconds": 1,
    "concurrentExecLimit": 0,
    "inputKeys": [],
    "outputKeys": [],
    "inputTemplate": {},
}


class ApiError(ConductorRunError):
    """A Conductor-shaped error answer: the HTTP layer renders it as ``{status, message, ...}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retryable: bool = False,
        validation_errors: list[JSON] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retryable = retryable
        self.validation_errors = validation_errors


def _bad_request(message: str, errors: list[JSON] | None = None) -> ApiError:
    return ApiError(400, message, validation_errors=errors)


def _validation_failed(errors: list[JSON]) -> ApiError:
    return ApiError(400, "Validation failed, check below errors for detail.", validation_errors=errors)


def _binding_error(message: str) -> ApiError:
    # The real server answers every JSON binding problem (malformed JSON, bad enum) with 500.
    return ApiError(500, message)


# ---------------------------------------------------------------------------------------------- records


@dataclass
class TaskRecord:
    """One task attempt (a retry is a new record with a new id)."""

    task_id: str
    workflow_id: str
    workflow_type: str
    correlation_id: str | None
    task_type: str
    ref_name: str
    workflow_task: JSON  # snapshot, taskDefinition included
    task_def: JSON
    input_data: JSON
    seq: int
    scheduled_time: float
    first_scheduled_time: float
    workflow_priority: int = 0
    status: str = "SCHEDULED"
    retry_count: int = 0
    retried_task_id: str | None = None
    retried: bool = False
    poll_count: int = 0
    start_time: float | None = None
    update_time: float | None = None
    end_time: float | None = None
    callback_after_seconds: int = 0
    start_delay_seconds: int = 0
    worker_id: str | None = None
    output_data: JSON = field(default_factory=dict)
    reason: str | None = None
    domain: str | None = None
    queue_name: str = ""
    no_retry: bool = False
    alerted: set[str] = field(default_factory=set)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_TASK

    @property
    def response_timeout_seconds(self) -> int:
        return _as_int(self.task_def.get("responseTimeoutSeconds"), 0)


@dataclass
class WorkflowRecord:
    """One workflow execution."""

    workflow_id: str
    name: str
    version: int
    definition: JSON  # snapshot with taskDefinition filled in
    input: JSON
    correlation_id: str | None
    task_to_domain: dict[str, str]
    priority: int
    create_time: float
    status: str = "RUNNING"
    tasks: list[TaskRecord] = field(default_factory=list)
    update_time: float | None = None
    end_time: float | None = None
    output: JSON = field(default_factory=dict)
    reason: str | None = None
    failed_refs: list[str] = field(default_factory=list)
    failed_task_names: list[str] = field(default_factory=list)
    timer_fired: bool = False
    alerted: bool = False

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_WORKFLOW


class _Queue:
    """A delay queue of task ids: a heap of (available_at, seq, id) with lazy deletion."""

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}
        self._seq = itertools.count()

    def push(self, task_id: str, available_at: float) -> None:
        seq = next(self._seq)
        self._live[task_id] = seq
        heapq.heappush(self._heap, (available_at, seq, task_id))

    def remove(self, task_id: str) -> None:
        self._live.pop(task_id, None)

    def _purge(self) -> None:
        while self._heap and self._live.get(self._heap[0][2]) != self._heap[0][1]:
            heapq.heappop(self._heap)

    def pop_ready(self, now: float, count: int) -> list[str]:
        out: list[str] = []
        while len(out) < count:
            self._purge()
            if not self._heap or self._heap[0][0] > now:
                break
            _, _, task_id = heapq.heappop(self._heap)
            del self._live[task_id]
            out.append(task_id)
        return out

    def next_available(self) -> float | None:
        self._purge()
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._live)


# ---------------------------------------------------------------------------------------------- helpers


def _as_int(value: Any, default: int) -> int:
    if value is None or isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _binding_error(f"Cannot deserialize value {value!r} as a number")


def _as_obj(value: Any, what: str) -> JSON:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _binding_error(f"Cannot deserialize {what}: expected a JSON object")
    return value


def queue_name(task_type: str, domain: str | None) -> str:
    """``domain:taskType``; an empty domain is a different queue (``:taskType``), as on the server."""
    return task_type if domain is None else f"{domain}:{task_type}"


_EXPR = re.compile(r"\$\{([^}]*)\}")


def _lookup(ctx: JSON, path: str) -> Any:
    cur: Any = ctx
    for part in path.strip().split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            return None
    return cur


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def resolve_expressions(value: Any, ctx: JSON) -> Any:
    """Resolve ``${workflow.input.x}`` / ``${ref.output.y}`` (dotted paths) in a parameter template.

    A string that is exactly one expression takes the referenced value with its JSON type; an
    expression inside a longer string is replaced by its text. Unknown paths resolve to null.
    """
    if isinstance(value, str):
        whole = _EXPR.fullmatch(value)
        if whole:
            return copy.deepcopy(_lookup(ctx, whole.group(1)))
        if "${" in value:
            return _EXPR.sub(lambda m: _text(_lookup(ctx, m.group(1))), value)
        return value
    if isinstance(value, dict):
        return {k: resolve_expressions(v, ctx) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_expressions(v, ctx) for v in value]
    return value


def _validate_task_def(td: Any, path: str) -> list[JSON]:
    errors: list[JSON] = []

    def err(field_name: str, message: str, invalid: Any = None) -> None:
        entry: JSON = {"path": f"{path}.{field_name}" if field_name else path, "message": message}
        if invalid is not None:
            entry["invalidValue"] = invalid
        errors.append(entry)

    if not isinstance(td, dict):
        err("", "TaskDef must be a JSON object")
        return errors
    name = td.get("name")
    if not isinstance(name, str) or not name.strip():
        err("name", "TaskDef name cannot be null or empty")
    rc = _as_int(td.get("retryCount"), 3)
    if rc < 0:
        err("retryCount", "TaskDef retryCount: must be >= 0", rc)
    r = _as_int(td.get("responseTimeoutSeconds"), 3600)
    if r < 1:
        err("responseTimeoutSeconds", f"TaskDef responseTimeoutSeconds: {r} must be greater than 0", r)
    t = _as_int(td.get("timeoutSeconds"), 0)
    if t > 0 and r > t:
        err(
            "",
            f"TaskDef: {name} responseTimeoutSeconds: {r} must be less than timeoutSeconds: {t}",
        )
    total = _as_int(td.get("totalTimeoutSeconds"), 0)
    if total < 0:
        err("totalTimeoutSeconds", "TaskDef totalTimeoutSeconds: must be >= 0", total)
    if t > 0 and total > 0 and t > total:
        err("", f"TaskDef: {name} timeoutSeconds: {t} must be less than totalTimeoutSeconds: {total}")
    for key in ("pollTimeoutSeconds", "retryDelaySeconds", "maxRetryDelaySeconds", "backoffJitterMs"):
        v = _as_int(td.get(key), 0)
        if v < 0:
            err(key, f"TaskDef {key}: must be >= 0", v)
    if _as_int(td.get("backoffScaleFactor"), 1) < 1:
        err("backoffScaleFactor", "TaskDef backoffScaleFactor: must be >= 1")
    policy = td.get("timeoutPolicy", "TIME_OUT_WF")
    if policy not in TIMEOUT_POLICIES:
        raise _binding_error(f"Cannot deserialize value of type `TimeoutPolicy` from String {policy!r}")
    logic = td.get("retryLogic", "FIXED")
    if logic not in RETRY_LOGICS:
        raise _binding_error(f"Cannot deserialize value of type `RetryLogic` from String {logic!r}")
    return errors


def _with_defaults(td: JSON) -> JSON:
    out = copy.deepcopy(TASKDEF_DEFAULTS)
    out.update({k: v for k, v in td.items() if v is not None})
    return out


def _retry_delay(td: JSON, retry_count: int) -> int:
    base = _as_int(td.get("retryDelaySeconds"), 60)
    logic = td.get("retryLogic", "FIXED")
    if logic == "LINEAR_BACKOFF":
        delay = base * _as_int(td.get("backoffScaleFactor"), 1) * (retry_count + 1)
    elif logic == "EXPONENTIAL_BACKOFF":
        delay = base * (2**retry_count)
    else:
        delay = base
    cap = _as_int(td.get("maxRetryDelaySeconds"), 0)
    if cap > 0:
        delay = min(delay, cap)
    return max(delay, 0)


# ---------------------------------------------------------------------------------------------- store


class Store:
    """The whole server state. Every public method is thread-safe."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        sweep_mode: SweepMode = "ideal",
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        if sweep_mode not in ("ideal", "coarse"):
            raise ValueError(f"sweep_mode must be 'ideal' or 'coarse', not {sweep_mode!r}")
        self.clock: Clock = clock or SystemClock()
        self.sweep_mode: SweepMode = sweep_mode
        self._new_id = id_factory or (lambda: str(uuid.uuid4()))
        self._lock = threading.Lock()
        self._timer_cond = threading.Condition(self._lock)
        self._mono0 = self.clock.monotonic()
        self._wall0_ms = self.clock.now().timestamp() * 1000.0
        self._closed = False

        self._task_defs: dict[str, JSON] = {}
        self._workflow_defs: dict[str, dict[int, JSON]] = {}
        self._workflows: dict[str, WorkflowRecord] = {}
        self._tasks: dict[str, TaskRecord] = {}
        self._queues: dict[str, _Queue] = {}
        self._logs: dict[str, list[JSON]] = {}
        self._poll_data: dict[tuple[str, str], JSON] = {}
        self._poll_mono: dict[tuple[str, str], float] = {}

        self._due_heap: list[tuple[float, int, str]] = []
        self._due: dict[str, tuple[float, int]] = {}
        self._due_seq = itertools.count()

    # ------------------------------------------------------------------------------------ time

    def _now(self) -> float:
        return self.clock.monotonic()

    def epoch_ms(self, t: float | None) -> int:
        """Epoch milliseconds for a store time; 0 for "not set", as Conductor does."""
        if t is None:
            return 0
        return round(self._wall0_ms + (t - self._mono0) * 1000.0)

    # ------------------------------------------------------------------------------------ metadata

    def register_task_defs(self, body: Any) -> None:
        if not isinstance(body, list):
            raise _binding_error("Cannot deserialize the task definitions: expected a JSON array")
        if not body:
            raise _validation_failed(
                [{"path": "registerTaskDef.taskDefinitions", "message": "TaskDefList cannot be empty"}]
            )
        errors: list[JSON] = []
        for i, td in enumerate(body):
            errors.extend(_validate_task_def(td, f"registerTaskDef.taskDefinitions[{i}]"))
        if errors:
            raise _validation_failed(errors)
        now = self._now()
        with self._lock:
            for td in body:
                stored = _with_defaults(td)
                stored.setdefault("createTime", self.epoch_ms(now))
                self._task_defs[str(td["name"])] = stored

    def update_task_def(self, body: Any) -> None:
        errors = _validate_task_def(body, "updateTaskDef.taskDefinition")
        if errors:
            raise _validation_failed(errors)
        with self._lock:
            name = str(body["name"])
            if name not in self._task_defs:
                raise ApiError(404, f"No such taskType found by name: {name}")
            stored = _with_defaults(body)
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

    def _validate_workflow_def(self, wd: Any, path: str) -> JSON:
        if not isinstance(wd, dict):
            raise _binding_error("Cannot deserialize the workflow definition: expected a JSON object")
        errors: list[JSON] = []
        name = wd.get("name")
        if not isinstance(name, str) or not name.strip():
            errors.append({"path": f"{path}.name", "message": "WorkflowDef name cannot be null or empty"})
        tasks = wd.get("tasks")
        if not isinstance(tasks, list) or not tasks:
            errors.append({"path": f"{path}.tasks", "message": "WorkflowTask list cannot be empty"})
            tasks = []
        refs: set[str] = set()
        for i, wt in enumerate(tasks):
            tpath = f"{path}.tasks[{i}]"
            if not isinstance(wt, dict):
                raise _binding_error("Cannot deserialize a WorkflowTask: expected a JSON object")
            if not isinstance(wt.get("name"), str) or not wt["name"]:
                errors.append(
                    {"path": f"{tpath}.name", "message": "WorkflowTask name cannot be empty or null"}
                )
            ref = wt.get("taskReferenceName")
            if not isinstance(ref, str) or not ref:
                errors.append(
                    {
                        "path": f"{tpath}.taskReferenceName",
                        "message": "WorkflowTask taskReferenceName name cannot be empty or null",
                    }
                )
            elif ref in refs:
                errors.append({"path": tpath, "message": f"taskReferenceName: {ref} should be unique"})
            else:
                refs.add(ref)
            kind = wt.get("type", "SIMPLE")
            if kind != "SIMPLE":
                errors.append(
                    {
                        "path": f"{tpath}.type",
                        "message": f"the embedded server runs only SIMPLE tasks, not {kind!r}",
                    }
                )
            inline = wt.get("taskDefinition")
            if inline is not None:
                errors.extend(_validate_task_def(inline, f"{tpath}.taskDefinition"))
        if errors:
            raise _validation_failed(errors)
        out = copy.deepcopy(wd)
        out["version"] = _as_int(wd.get("version"), 1)
        out.setdefault("schemaVersion", 2)
        out.setdefault("timeoutSeconds", 0)
        out.setdefault("timeoutPolicy", "ALERT_ONLY")
        out.setdefault("inputParameters", [])
        out.setdefault("outputParameters", {})
        for wt in out["tasks"]:
            wt.setdefault("type", "SIMPLE")
            wt.setdefault("inputParameters", {})
        return out

    def register_workflow_def(self, body: Any, *, overwrite: bool = False) -> None:
        wd = self._validate_workflow_def(body, "registerWorkflowDef.workflowDef")
        with self._lock:
            versions = self._workflow_defs.setdefault(wd["name"], {})
            if wd["version"] in versions and not overwrite:
                raise ApiError(409, f"Workflow with {wd['name']}.{wd['version']} already exists!")
            wd.setdefault("createTime", self.epoch_ms(self._now()))
            versions[wd["version"]] = wd

    def update_workflow_defs(self, body: Any) -> None:
        if not isinstance(body, list):
            raise _binding_error("Cannot deserialize the workflow definitions: expected a JSON array")
        defs = [self._validate_workflow_def(wd, f"update.workflowDefs[{i}]") for i, wd in enumerate(body)]
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
        inputs = _as_obj(input_data, "the workflow input")
        domains = _as_obj(task_to_domain, "taskToDomain")
        inline = None
        if workflow_def is not None:
            inline = self._validate_workflow_def(workflow_def, "startWorkflow.workflowDef")
        with self._lock:
            if inline is not None:
                definition = inline
            else:
                if not name:
                    raise _validation_failed(
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
                    wt["taskDefinition"] = _with_defaults(inline_td)
                else:
                    registered = self._task_defs.get(wt["name"])
                    wt["taskDefinition"] = (
                        copy.deepcopy(registered) if registered else _with_defaults({"name": wt["name"]})
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
        req = _as_obj(body, "the StartWorkflowRequest")
        version = req.get("version")
        return self.start_workflow(
            req.get("name"),
            req.get("input"),
            version=None if version is None else _as_int(version, 1),
            correlation_id=req.get("correlationId"),
            task_to_domain=req.get("taskToDomain"),
            workflow_def=req.get("workflowDef"),
            priority=_as_int(req.get("priority"), 0),
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

    # ------------------------------------------------------------------------------------ tasks

    def _queue(self, name: str) -> _Queue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(self._lock)
        return q

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
            raise _bad_request("Long Poll Timeout value cannot be more than 5 seconds")
        qname = queue_name(task_type, domain)
        deadline = time.monotonic() + max(timeout_ms, 0) / 1000.0
        out: list[JSON] = []
        with self._lock:
            q = self._queue(qname)
            while count > 0:
                now = self._now()
                for task_id in q.pop_ready(now, count - len(out)):
                    task = self._tasks.get(task_id)
                    if task is None or task.terminal:
                        continue
                    self._claim(task, worker_id, now)
                    out.append(self._task_json(task))
                if out or self._closed:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                nxt = q.next_available()
                if nxt is not None:
                    remaining = min(remaining, max(nxt - self._now(), 0.001))
                q.cond.wait(remaining)
            self._record_poll(task_type, domain, worker_id)
        return out

    def _claim(self, task: TaskRecord, worker_id: str | None, now: float) -> None:
        task.status = "IN_PROGRESS"
        if task.start_time is None:
            task.start_time = now
        task.callback_after_seconds = 0
        task.worker_id = worker_id
        task.poll_count += 1
        task.update_time = now
        wf = self._workflows[task.workflow_id]
        self._reschedule(wf, now)

    def _record_poll(self, task_type: str, domain: str | None, worker_id: str | None) -> None:
        now = self._now()
        key = (task_type, domain if domain is not None else "DEFAULT")
        entry: JSON = {"queueName": task_type, "lastPollTime": self.epoch_ms(now)}
        if domain is not None:
            entry["domain"] = domain
        if worker_id is not None:
            entry["workerId"] = worker_id
        self._poll_data[key] = entry
        self._poll_mono[key] = now

    def poll_data(self, task_type: str | None) -> list[JSON]:
        with self._lock:
            return [
                dict(v)
                for (tt, _), v in sorted(self._poll_data.items())
                if task_type is None or tt == task_type
            ]

    def queue_size(self, task_type: str, domain: str | None = None) -> int:
        with self._lock:
            q = self._queues.get(queue_name(task_type, domain))
            return len(q) if q is not None else 0

    def queue_sizes(self) -> dict[str, int]:
        with self._lock:
            return {name: len(q) for name, q in sorted(self._queues.items())}

    def update_task(self, body: Any) -> str:
        """``POST /api/tasks``: every rule of CONDUCTOR_PROTOCOL.md §3, in order; returns the taskId."""
        task_id, _task = self._apply_update(body)
        return task_id

    def update_task_v2(self, body: Any) -> JSON | None:
        """``POST /api/tasks/update-v2``: the update, then (terminal, non-lease) claim the next task."""
        _task_id, task = self._apply_update(body)
        if task is None or not task.terminal:
            return None
        worker = body.get("workerId") if isinstance(body, dict) else None
        got = self.poll(
            task.task_type,
            count=1,
            timeout_ms=0,
            worker_id=worker if isinstance(worker, str) else None,
            domain=task.domain,
        )
        return got[0] if got else None

    def _apply_update(self, body: Any) -> tuple[str, TaskRecord | None]:
        if not isinstance(body, dict):
            raise _binding_error("Cannot deserialize the TaskResult: expected a JSON object")
        status = body.get("status")
        if status is not None and status not in UPDATE_STATUSES:
            raise _binding_error(
                f"Cannot deserialize value of type `TaskResult$Status` from String {status!r}: "
                f"not one of the values accepted for Enum class: {sorted(UPDATE_STATUSES)}"
            )
        output = body.get("outputData")
        if output is not None and not isinstance(output, dict):
            raise _binding_error("Cannot deserialize outputData: expected a JSON object")
        logs = body.get("logs")
        if logs is not None and not isinstance(logs, list):
            raise _binding_error("Cannot deserialize logs: expected a JSON array")
        callback = _as_int(body.get("callbackAfterSeconds"), 0)
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
            raise _validation_failed(errors)
        task_id, workflow_id = str(raw_task_id), str(raw_wf_id)

        with self._lock:
            now = self._now()
            if body.get("extendLease") is True:
                task = self._tasks.get(task_id)
                if task is None:
                    raise ApiError(404, f"No such task found by id: {task_id}")
                if not task.terminal:
                    task.update_time = now
                    if self.sweep_mode == "ideal":
                        # The real server leaves its decider queue alone here; "coarse" does too.
                        self._reschedule(self._workflows[task.workflow_id], now)
                return task_id, None
            wf = self._workflows.get(workflow_id)
            if wf is None:
                raise ApiError(404, f"No such workflow found by id: {workflow_id}")
            task = self._tasks.get(task_id)
            if task is None:
                raise ApiError(404, f"No such task found by id: {task_id}")
            wf = self._workflows[task.workflow_id]
            if task.terminal:
                self._queue(task.queue_name).remove(task.task_id)
                return task_id, task
            if wf.terminal:
                self._queue(task.queue_name).remove(task.task_id)
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
                self._queue(task.queue_name).push(task.task_id, now + max(callback, 0))
                self._notify_queue(task.queue_name)
            else:
                task.status = status
                task.end_time = now
                self._queue(task.queue_name).remove(task.task_id)
            task.update_time = now
            wf.update_time = now
            if logs:
                self._store_logs(task.task_id, logs[:TASK_EXEC_LOG_SIZE_LIMIT], now)
            self._decide(wf, now)
            return task_id, task

    def _store_logs(self, task_id: str, logs: Iterable[Any], now: float) -> None:
        entries = self._logs.setdefault(task_id, [])
        for item in logs:
            if isinstance(item, dict):
                created = item.get("createdTime")
                entries.append(
                    {
                        "log": item.get("log"),
                        "taskId": str(item.get("taskId") or task_id),
                        "createdTime": created if isinstance(created, int) else self.epoch_ms(now),
                    }
                )
            else:
                entries.append({"log": str(item), "taskId": task_id, "createdTime": self.epoch_ms(now)})

    def get_task(self, task_id: str) -> JSON:
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None:
                raise ApiError(404, f"Task not found for taskId: {task_id}")
            return self._task_json(task)

    def add_log(self, task_id: str, text: str) -> None:
        with self._lock:
            self._store_logs(task_id, [text], self._now())

    def get_logs(self, task_id: str) -> list[JSON]:
        with self._lock:
            return [dict(e) for e in self._logs.get(task_id, [])]

    def _notify_queue(self, name: str) -> None:
        # A delayed message also wakes the pollers: they shorten their wait to its time.
        q = self._queues.get(name)
        if q is not None:
            q.cond.notify_all()

    # ------------------------------------------------------------------------------------ decider

    def _schedule(self, wf: WorkflowRecord, index: int, now: float) -> None:
        wt = wf.definition["tasks"][index]
        td = wt["taskDefinition"]
        task = TaskRecord(
            task_id=self._new_id(),
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
        self._tasks[task.task_id] = task
        self._queue(task.queue_name).push(task.task_id, now + task.start_delay_seconds)
        self._notify_queue(task.queue_name)

    def _resolve_domain(self, wf: WorkflowRecord, task_type: str, now: float) -> str | None:
        spec = wf.task_to_domain.get(task_type) or wf.task_to_domain.get("*")
        if not spec:
            return None
        candidates = [d.strip() for d in spec.split(",") if d.strip()]
        for d in candidates:
            if d == "NO_DOMAIN":
                return None
            last = self._poll_mono.get((task_type, d))
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
        }
        return ctx

    def _decide(self, wf: WorkflowRecord, now: float) -> None:
        """Bring one workflow up to date: timeouts, retries, next task, outcome; then re-arm its timer."""
        while not wf.terminal:
            wd = wf.definition
            wf_timeout = _as_int(wd.get("timeoutSeconds"), 0)
            if wf_timeout > 0 and now - wf.create_time >= wf_timeout:
                if wd.get("timeoutPolicy") == "TIME_OUT_WF":
                    self._end_workflow(
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
        self._reschedule(wf, now)

    def _check_timeouts(self, wf: WorkflowRecord, task: TaskRecord, now: float) -> None:
        td = task.task_def
        policy = td.get("timeoutPolicy", "TIME_OUT_WF")
        total = _as_int(td.get("totalTimeoutSeconds"), 0)
        if total > 0 and "total" not in task.alerted and now - task.first_scheduled_time >= total:
            reason = (
                f"Task total timeout exceeded: {int(now - task.first_scheduled_time)} seconds since first"
                f" scheduled. Total timeout configured as {total} seconds. Timeout policy configured to"
                f" {policy}"
            )
            task.no_retry = True
            self._apply_timeout_policy(wf, task, policy, reason, "total", now)
            return
        timeout = _as_int(td.get("timeoutSeconds"), 0)
        if (
            timeout > 0
            and task.start_time is not None
            and "task" not in task.alerted
            and now - (task.start_time + task.start_delay_seconds) >= timeout
        ):
            elapsed = int(now - task.start_time)
            reason = (
                f"Task timed out after {elapsed} seconds. Timeout configured as {timeout} seconds. "
                f"Timeout policy configured to {policy}"
            )
            self._apply_timeout_policy(wf, task, policy, reason, "task", now)
            return
        poll_timeout = _as_int(td.get("pollTimeoutSeconds"), 0)
        if (
            task.status == "SCHEDULED"
            and poll_timeout > 0
            and "poll" not in task.alerted
            and now - (task.scheduled_time + task.start_delay_seconds)
            >= poll_timeout + task.callback_after_seconds
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
            and now - task.update_time >= r + task.callback_after_seconds
        ):
            task.status = "TIMED_OUT"
            task.reason = (
                f"responseTimeout: {r} exceeded for the taskId: {task.task_id} "
                f"with Task Definition: {td.get('name', task.task_type)}"
            )
            task.end_time = now
            task.update_time = now
            self._queue(task.queue_name).remove(task.task_id)

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
        self._queue(task.queue_name).remove(task.task_id)
        if policy == "TIME_OUT_WF":
            self._fail_workflow(wf, task, "TIMED_OUT", reason, now)

    def _retry_or_fail(self, wf: WorkflowRecord, task: TaskRecord, now: float) -> None:
        wt = task.workflow_task
        expected = _as_int(wt.get("retryCount"), _as_int(task.task_def.get("retryCount"), 3))
        if task.status in RETRIABLE_TASK and not task.no_retry and task.retry_count < expected:
            delay = _retry_delay(task.task_def, task.retry_count)
            task.retried = True
            retry = TaskRecord(
                task_id=self._new_id(),
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
        self._end_workflow(wf, status, reason, now)

    def _complete_workflow(self, wf: WorkflowRecord, now: float) -> None:
        params = wf.definition.get("outputParameters") or {}
        if params:
            wf.output = resolve_expressions(copy.deepcopy(params), self._ctx(wf))
        else:
            wf.output = copy.deepcopy(wf.tasks[-1].output_data) if wf.tasks else {}
        wf.status = "COMPLETED"
        wf.end_time = now
        wf.update_time = now

    def _end_workflow(self, wf: WorkflowRecord, status: str, reason: str | None, now: float) -> None:
        for t in wf.tasks:
            if not t.terminal:
                t.status = "CANCELED"
                t.end_time = now
                t.update_time = now
                self._queue(t.queue_name).remove(t.task_id)
        wf.status = status
        wf.reason = reason
        wf.end_time = now
        wf.update_time = now
        self._reschedule(wf, now)

    # ------------------------------------------------------------------------------------ timer

    def _next_check(self, wf: WorkflowRecord) -> float | None:
        if wf.terminal:
            return None
        times: list[float] = []
        wf_timeout = _as_int(wf.definition.get("timeoutSeconds"), 0)
        if wf_timeout > 0 and not wf.alerted:
            times.append(wf.create_time + wf_timeout)
        if wf.tasks:
            t = wf.tasks[-1]
            if not t.terminal:
                td = t.task_def
                total = _as_int(td.get("totalTimeoutSeconds"), 0)
                if total > 0 and "total" not in t.alerted:
                    times.append(t.first_scheduled_time + total)
                timeout = _as_int(td.get("timeoutSeconds"), 0)
                if timeout > 0 and t.start_time is not None and "task" not in t.alerted:
                    times.append(t.start_time + t.start_delay_seconds + timeout)
                poll_timeout = _as_int(td.get("pollTimeoutSeconds"), 0)
                if t.status == "SCHEDULED" and poll_timeout > 0 and "poll" not in t.alerted:
                    times.append(
                        t.scheduled_time + t.start_delay_seconds + poll_timeout + t.callback_after_seconds
                    )
                r = t.response_timeout_seconds
                if t.status == "IN_PROGRESS" and r != 0 and t.update_time is not None:
                    times.append(t.update_time + r + t.callback_after_seconds)
        return min(times) if times else None

    def _coarse(self, requested: float) -> float:
        """SQLite's re-delivery time: the first 60 s unack tick more than 60 s after ``requested``."""
        period = COARSE_UNACK_PERIOD_SECONDS
        k = math.floor((requested + period - self._mono0) / period) + 1
        return self._mono0 + k * period

    def _reschedule(self, wf: WorkflowRecord, now: float) -> None:
        due = self._next_check(wf)
        if due is None:
            self._due.pop(wf.workflow_id, None)
            return
        if self.sweep_mode == "coarse" and wf.timer_fired:
            due = self._coarse(due)
        current = self._due.get(wf.workflow_id)
        if current is not None and current[0] == due:
            return
        seq = next(self._due_seq)
        self._due[wf.workflow_id] = (due, seq)
        earliest = self._due_heap[0][0] if self._due_heap else math.inf
        heapq.heappush(self._due_heap, (due, seq, wf.workflow_id))
        if due < earliest:
            self._timer_cond.notify_all()

    def _purge_due(self) -> None:
        while self._due_heap:
            due, seq, wf_id = self._due_heap[0]
            if self._due.get(wf_id) == (due, seq):
                return
            heapq.heappop(self._due_heap)

    def next_due(self) -> float | None:
        """The store time of the next timer-driven check, or None."""
        with self._lock:
            self._purge_due()
            return self._due_heap[0][0] if self._due_heap else None

    def run_due(self) -> int:
        """Evaluate every workflow whose check time has come; return how many were evaluated."""
        with self._lock:
            return self._run_due_locked()

    def _run_due_locked(self) -> int:
        now = self._now()
        ran = 0
        while True:
            self._purge_due()
            if not self._due_heap or self._due_heap[0][0] > now:
                return ran
            _, _, wf_id = heapq.heappop(self._due_heap)
            del self._due[wf_id]
            wf = self._workflows[wf_id]
            wf.timer_fired = True
            self._decide(wf, now)
            ran += 1

    def timer_loop(self) -> None:
        """Body of the server's timer thread: sleep until the next due check, run it; until closed."""
        with self._lock:
            while not self._closed:
                self._run_due_locked()
                self._purge_due()
                if self._due_heap:
                    self._timer_cond.wait(max(self._due_heap[0][0] - self._now(), 0.0005))
                else:
                    self._timer_cond.wait()

    def wake(self) -> None:
        """Wake the timer thread and every long poll (after a fake clock moved, or to shut down)."""
        with self._lock:
            self._timer_cond.notify_all()
            for q in self._queues.values():
                q.cond.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wake()

    # ------------------------------------------------------------------------------------ JSON

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
            "rateLimitPerFrequency": _as_int(t.task_def.get("rateLimitPerFrequency"), 0),
            "rateLimitFrequencyInSeconds": _as_int(t.task_def.get("rateLimitFrequencyInSeconds"), 1),
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
