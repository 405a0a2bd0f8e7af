"""Records, constants and error helpers shared by the embedded server's store modules.

Threads: any; records are mutated only under the store's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

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


def bad_request(message: str, errors: list[JSON] | None = None) -> ApiError:
    return ApiError(400, message, validation_errors=errors)


def validation_failed(errors: list[JSON]) -> ApiError:
    return ApiError(400, "Validation failed, check below errors for detail.", validation_errors=errors)


def binding_error(message: str) -> ApiError:
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
        return as_int(self.task_def.get("responseTimeoutSeconds"), 0)


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


# ---------------------------------------------------------------------------------------------- helpers


def due_at(start: float, *lengths: float) -> float:
    """The store time a timeout counted from ``start`` falls due: ``start`` plus each length, added in
    this order. The due schedule (``timers.next_check``) and the decider's "has it passed" test
    (``passed``) both use it, so they agree to the last bit: were one ``t + R`` and the other
    ``now - t >= R``, floating point could make a check due that the decider finds not passed, and the
    timer loop would look again at once, forever under a clock that does not move."""
    due = start
    for length in lengths:
        due += length
    return due


def passed(now: float, start: float, *lengths: float) -> bool:
    """True once ``now`` has reached ``due_at(start, *lengths)``."""
    return now >= due_at(start, *lengths)


def as_int(value: Any, default: int) -> int:
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
    raise binding_error(f"Cannot deserialize value {value!r} as a number")


def as_obj(value: Any, what: str) -> JSON:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise binding_error(f"Cannot deserialize {what}: expected a JSON object")
    return value


def queue_name(task_type: str, domain: str | None) -> str:
    """``domain:taskType``; an empty domain is a different queue (``:taskType``), as on the server."""
    return task_type if domain is None else f"{domain}:{task_type}"
