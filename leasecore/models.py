"""Frozen values shared by every part of conductor-run: tasks as polled, results as reported.

Owns: ``Task`` (parsed once from the server's JSON, ``Task.from_json``), ``TaskResult`` and its
``to_json`` / ``encoded`` (the body of ``POST /api/tasks``), ``TaskStatus``, ``TaskOwnership``
(what an ownership check read) and ``TaskLog``. Must not: do I/O, read a clock, or know about
leases, children or transports: a value here means the same thing to the client, the runner, the
outbox and the tests.
Threads: any; every value is frozen, so it may be handed between threads without a lock.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class TaskStatus(StrEnum):
    """Conductor's task statuses (CONDUCTOR_PROTOCOL.md §2)."""

    SCHEDULED = "SCHEDULED"
    IN_PROGRESS = "IN_PROGRESS"
    COMPLETED = "COMPLETED"
    COMPLETED_WITH_ERRORS = "COMPLETED_WITH_ERRORS"
    FAILED = "FAILED"
    FAILED_WITH_TERMINAL_ERROR = "FAILED_WITH_TERMINAL_ERROR"
    TIMED_OUT = "TIMED_OUT"
    CANCELED = "CANCELED"
    SKIPPED = "SKIPPED"

    @property
    def is_terminal(self) -> bool:
        return self not in (TaskStatus.SCHEDULED, TaskStatus.IN_PROGRESS)


# Statuses a worker may send in an update (there is no TIMED_OUT among them).
REPORTABLE_STATUSES = frozenset(
    {
        TaskStatus.IN_PROGRESS,
        TaskStatus.COMPLETED,
        TaskStatus.FAILED,
        TaskStatus.FAILED_WITH_TERMINAL_ERROR,
    }
)


def _int(value: Any, default: int = 0) -> int:
    if type(value) is int:  # (the usual field: the server's JSON number as parsed)
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _metadata_values(value: Any) -> dict[str, str]:
    """``Task.runtimeMetadata``: names to values (a non-string value as its JSON text)."""
    if not isinstance(value, Mapping):
        return {}
    return {str(name): item if isinstance(item, str) else json.dumps(item)
            for name, item in value.items() if item is not None}  # fmt: skip


def _metadata_names(value: Any) -> tuple[str, ...]:
    """``TaskDef.runtimeMetadata``: the declared names, in order, once each."""
    if not isinstance(value, list | tuple):
        return ()
    return tuple(dict.fromkeys(name for name in value if isinstance(name, str) and name))


@dataclass(frozen=True)
class Task:
    """A task as handed to this worker by a poll.

    ``timeout_seconds`` is not a field of Conductor's Task JSON: it is read from
    ``workflowTask.taskDefinition.timeoutSeconds`` (0 = no hard ceiling).
    """

    task_id: str
    workflow_id: str
    task_type: str
    reference_name: str = ""
    retry_count: int = 0
    poll_count: int = 0
    response_timeout_seconds: int = 0
    timeout_seconds: int = 0
    input_data: Mapping[str, Any] = field(default_factory=dict)
    domain: str | None = None
    worker_id: str | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    # Server timestamps (epoch ms, 0 = not given): startTime is set by the first poll and kept across
    # re-deliveries; updateTime is the poll's own time. timeoutSeconds counts from startTime + delay.
    start_time_ms: int = 0
    update_time_ms: int = 0
    start_delay_seconds: int = 0
    # The last checkpoint of this logical task (leasecore.process.checkpoint): the polled task's
    # outputData.checkpoint (after a yield), or, for a retry, its earlier attempt's (the runner fills
    # it in at poll time). None: none.
    checkpoint: Any = field(default=None, repr=False, compare=False)
    # Secrets and environment values the task definition declares (``taskDefinition.runtimeMetadata``,
    # a list of names) and what the server resolved at the poll (``runtimeMetadata``, name -> value;
    # a name it could not resolve is left out). Sent on the wire only, never stored by the server.
    runtime_metadata: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    declared_metadata: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Task:
        """Build a Task from the server's JSON, tolerating missing optional fields.

        Once per polled or claimed task: its fields are set in one ``__dict__`` update rather than
        through the frozen class's ``__init__`` (one ``object.__setattr__`` per field), the same
        values (``test_models``' differential test holds it to the constructor).
        """
        get = data.get
        workflow_task = get("workflowTask") or {}
        task_def = get("taskDefinition") or workflow_task.get("taskDefinition") or {}
        input_data = get("inputData")
        metadata = get("runtimeMetadata")
        declared = task_def.get("runtimeMetadata")
        response_timeout = get("responseTimeoutSeconds", task_def.get("responseTimeoutSeconds"))
        task = object.__new__(cls)
        task.__dict__.update(
            task_id=str(get("taskId", "")),
            workflow_id=str(get("workflowInstanceId", "")),
            task_type=str(get("taskType") or get("taskDefName") or ""),
            reference_name=str(get("referenceTaskName") or ""),
            retry_count=_int(get("retryCount")),
            poll_count=_int(get("pollCount")),
            response_timeout_seconds=_int(response_timeout),
            timeout_seconds=_int(task_def.get("timeoutSeconds")),
            input_data=input_data if isinstance(input_data, dict) else {},
            domain=get("domain") or None,
            worker_id=get("workerId") or None,
            raw=dict(data),
            start_time_ms=_int(get("startTime")),
            update_time_ms=_int(get("updateTime")),
            start_delay_seconds=_int(get("startDelayInSeconds")),
            checkpoint=_checkpoint_of(get("outputData")),
            runtime_metadata={} if metadata is None else _metadata_values(metadata),
            declared_metadata=() if declared is None else _metadata_names(declared),
        )
        return task

    @property
    def server_elapsed_seconds(self) -> float:
        """Seconds of ``timeoutSeconds`` the server had already counted when it handed us the task.

        ``updateTime - (startTime + startDelay)``, both stamped by the server's own clock at the poll,
        so no clock skew between us and the server enters. 0 when either timestamp is missing.
        """
        if self.start_time_ms <= 0 or self.update_time_ms <= 0:
            return 0.0
        elapsed_ms = self.update_time_ms - self.start_time_ms - 1000 * self.start_delay_seconds
        return max(0.0, elapsed_ms / 1000.0)


@dataclass(frozen=True)
class TaskOwnership:
    """Who holds a task now, as ``GET /api/tasks/{id}`` says: what an ownership check compares.

    ``poll_count`` goes up by one on every poll of the task id (0: not given); ``worker_id`` is the
    last poller's id (for messages only: runners on one host share the default id).
    """

    status: TaskStatus
    poll_count: int = 0
    worker_id: str | None = None


@dataclass(frozen=True)
class TaskLog:
    """One execution-log line attached to a task."""

    log: str
    created_time_ms: int

    def to_json(self, task_id: str) -> dict[str, Any]:
        return {"log": self.log, "taskId": task_id, "createdTime": self.created_time_ms}


@dataclass(frozen=True)
class TaskResult:
    """The final (or IN_PROGRESS-yield) update for one task, as sent with ``POST /api/tasks``."""

    task_id: str
    workflow_id: str
    status: TaskStatus
    output_data: Mapping[str, Any] = field(default_factory=dict)
    reason_for_incompletion: str | None = None
    callback_after_seconds: int = 0
    worker_id: str | None = None
    logs: tuple[TaskLog, ...] = ()

    def to_json(self) -> dict[str, Any]:
        body = self._head()
        body["outputData"] = dict(self.output_data)
        return body

    def output_json(self) -> str:
        """``outputData`` as JSON text, encoded once per result: the update's body and the
        result-size metric share it (with ``ensure_ascii``, its length is its size in bytes)."""
        text: str | None = self.__dict__.get("_output_json")
        if text is None:  # two threads may both encode it: the same text, no lock needed
            text = _encode_tree(dict(self.output_data))
            object.__setattr__(self, "_output_json", text)
        return text

    def encoded(self) -> bytes:
        """The body of ``POST /api/tasks`` as sent: ``to_json``'s fields, outputData from
        ``output_json`` (last) instead of a second encoding of it; the bytes of
        ``json.dumps(self.to_json())``."""
        return f'{self._head_text()}, "outputData": {self.output_json()}}}'.encode("ascii")

    def _head_text(self) -> str:
        """``json.dumps(self._head())`` without its closing brace. Written here for the usual result
        (str ids and reason, an int callback, no logs: 0.6 us, where json.dumps of the dict took 2.4),
        with json.dumps' own string escaping; anything else goes through json.dumps."""
        task_id, workflow_id, reason, callback, worker_id = (
            self.task_id, self.workflow_id, self.reason_for_incompletion, self.callback_after_seconds,
            self.worker_id)  # fmt: skip
        if (self.logs or type(task_id) is not str or type(workflow_id) is not str
                or type(callback) is not int or (reason and type(reason) is not str)
                or (worker_id and type(worker_id) is not str)):  # fmt: skip
            return json.dumps(self._head())[:-1]  # never empty: "{..., ...}"
        text = (f'{{"taskId": {_json_str(task_id)}, "workflowInstanceId": {_json_str(workflow_id)}, '
                f'"status": {_json_str(self.status.value)}')
        if reason:
            text += f', "reasonForIncompletion": {_json_str(reason)}'
        if callback:
            text += f', "callbackAfterSeconds": {int.__repr__(callback)}'
        if worker_id:
            text += f', "workerId": {_json_str(worker_id)}'
        return text

    def _head(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "taskId": self.task_id,
            "workflowInstanceId": self.workflow_id,
            "status": self.status.value,
        }
        if self.reason_for_incompletion:
            body["reasonForIncompletion"] = self.reason_for_incompletion
        if self.callback_after_seconds:
            body["callbackAfterSeconds"] = self.callback_after_seconds
        if self.worker_id:
            body["workerId"] = self.worker_id
        if self.logs:
            body["logs"] = [entry.to_json(self.task_id) for entry in self.logs]
        return body


_json_str = json.encoder.encode_basestring_ascii  # a str as json.dumps writes it (its C function)


def plain_json_encoder() -> Callable[[Any], str]:
    """json.dumps with its default settings for a tree of plain values (parsed JSON, the runner's own
    values: a result's outputData, a state record's line), through its C encoder made once (json.dumps
    makes one at every call): the same text (ASCII, ", " and ": ", NaN allowed, TypeError for what
    JSON cannot hold), without the check for circular containers, which such a tree has none of.
    json.dumps where this Python has no C encoder."""
    make = getattr(json.encoder, "c_make_encoder", None)
    try:  # (markers, default, encoder, indent, key_separator, item_separator, sort_keys, skipkeys, allow_nan)
        encode = make and make(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None,
                               ": ", ", ", False, False, True)  # fmt: skip
    except TypeError:  # another Python's signature
        encode = None
    if not encode:
        return json.dumps
    return lambda value: "".join(encode(value, 0))


_encode_tree = plain_json_encoder()


def _checkpoint_of(output: Any) -> Any:
    """``outputData.checkpoint`` of a polled task (None: none)."""
    return output.get("checkpoint") if isinstance(output, dict) else None
