"""conductor-cli's ``worker stdio`` contract (``protocol = "stdio"``, DESIGN.md §3).

A script written for ``conductor-cli worker stdio`` runs unchanged: it gets the whole task object as
JSON on stdin (``task_json``) and ``TASK_TYPE``, ``TASK_ID``, ``WORKFLOW_ID``, ``EXECUTION_ID`` and
``POLL_DOMAIN`` in its environment (``spec.stdio_env``, beside conductor-run's own ``CONDUCTOR_*``
variables), and prints one JSON document on stdout::

    {"status": "COMPLETED", "output": {...}, "logs": ["..."], "reason": "...",
     "callbackAfterSeconds": 30}        # the last one: our extension, for IN_PROGRESS

Owns what the child gets, ``StdoutDocument`` (stdout kept whole instead of streamed, bounded by
``STDOUT_LIMIT_BYTES`` + 1 byte; the rest is read and dropped so the child never blocks), the document's
parsing (``parse_reply``) and the mapping to the update (``to_stdio_result``, whose docstring has the
table). Must not touch: anything but its arguments; pure, like ``task_result.py`` (``reasons.py`` words
what both share). Threads: ``StdoutDocument`` on the Supervisor's reader thread; the rest on any
(the runner's main thread maps the exit).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from leasecore.models import Task, TaskLog, TaskResult, TaskStatus
from leasecore.process.payload import OUTPUT_DATA_LIMIT_BYTES, deeper_than, json_size, too_large
from leasecore.process.results.reasons import bounded, callback_seconds, exit_verdict, resources, signal_name
from leasecore.process.spec import ChildExit, CommandSpec
from leasecore.process.taskfiles import OUTPUT_FILE_LIMIT_BYTES, OUTPUT_MAX_DEPTH, dump_json

STDOUT_LIMIT_BYTES = OUTPUT_FILE_LIMIT_BYTES  # as CONDUCTOR_OUTPUT_FILE: what the server keeps (3 MiB)
EXCERPT_CHARS = 200  # of stdout, in a reason
STDOUT_EXCERPT_BYTES = 4096  # of stdout, in outputData.stdoutExcerpt
MAX_LOG_ENTRIES = 1000  # the document's logs kept (the task log's own buffer holds as many)
MAX_CALLBACK_SECONDS = 365 * 24 * 3600

STATUSES = {
    "COMPLETED": TaskStatus.COMPLETED,
    "FAILED": TaskStatus.FAILED,
    "IN_PROGRESS": TaskStatus.IN_PROGRESS,
    "FAILED_WITH_TERMINAL_ERROR": TaskStatus.FAILED_WITH_TERMINAL_ERROR,
}


# --------------------------------------------------------------------------- what the child gets


def task_json(task: Task) -> bytes:
    """The task object as the server sent it, as UTF-8 JSON (``\\u`` escapes for lone surrogates)."""
    return dump_json(task.raw, "the task")


# --------------------------------------------------------------------------- what comes back


class StdoutDocument:
    """Keeps a child's stdout (its result document) instead of splitting it into log lines.

    The same face as ``output.StreamCapture`` for the reader thread (``feed``, ``close``, ``tail``,
    ``last_line``, ``total_bytes``); ``document()`` is what was kept: at most ``limit + 1`` bytes.
    """

    def __init__(self, limit: int = STDOUT_LIMIT_BYTES) -> None:
        self._limit_bytes = limit
        self._chunks: list[bytes] = []
        self._kept = 0
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        self.total_bytes += len(data)
        room = self._limit_bytes + 1 - self._kept
        if room > 0:
            piece = data[:room]
            self._chunks.append(piece)
            self._kept += len(piece)

    def close(self) -> None:
        """End of stream: nothing to do (the document is judged once the child is done)."""

    def tail(self) -> str:
        return ""  # stdout is the document: reported through it, not as a tail

    def last_line(self) -> str:
        return ""

    def document(self) -> bytes:
        return b"".join(self._chunks)


@dataclass(frozen=True, eq=False)
class StdioReply:
    """A valid result document."""

    status: TaskStatus
    output: Mapping[str, Any] = field(default_factory=dict)
    logs: tuple[str, ...] = ()
    reason: str = ""
    callback_after_seconds: int = 0


class InvalidReply(ValueError):
    """stdout is not a usable result document; ``str()`` is the reason (already worded)."""

    def __init__(self, reason: str, *, excerpt: bool = True) -> None:
        super().__init__(reason)
        self.excerpt = excerpt  # whether outputData should carry the stdout excerpt


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else type(value).__name__


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _field(document: Mapping[str, Any], name: str) -> Any:
    """``document[name]`` the way Go's encoding/json finds it: the exact key, else any case of it."""
    if name in document:
        return document[name]
    folded = name.casefold()
    value = None
    for key, item in document.items():  # the last match wins, as in Go
        if key.casefold() == folded:
            value = item
    return value


def excerpt(data: bytes, limit: int = EXCERPT_CHARS) -> str:
    """The start of ``data`` for a message: decoded, ``repr``-quoted, cut at ``limit`` characters."""
    text = data[: limit * 4].decode("utf-8", "replace")
    cut = len(text) > limit or len(data) > limit * 4
    return repr(text[:limit]) + ("..." if cut else "")


def parse_reply(
    data: bytes, *, limit: int = STDOUT_LIMIT_BYTES, total_bytes: int | None = None
) -> StdioReply:
    """The result document in ``data`` (a child's whole stdout); ``InvalidReply`` saying why not.

    Field names match like Go's ``encoding/json`` does (exact first, else case-insensitively); unknown
    fields are ignored; the types are as strict as conductor-cli's (``output`` an object, ``logs`` strings,
    ``reason`` and ``status`` strings, each may be null). ``total_bytes``: how much the child printed
    in all (``data`` holds at most ``limit`` + 1 of them), for the reason.
    """
    if len(data) > limit:
        size = max(total_bytes or 0, len(data))
        cut = total_bytes is None and len(data) == limit + 1  # maybe only the part that was kept
        advice = "print the result document only, and write big results elsewhere"
        raise InvalidReply(too_large("worker stdout", size, limit, at_least=cut, advice=advice))
    if not data.strip():
        raise InvalidReply("invalid worker stdout JSON: stdout is empty (expected one JSON document)",
                           excerpt=False)  # fmt: skip
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidReply(
            f"invalid worker stdout JSON: not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:  # JSONDecodeError included: "Extra data" is a second document
        raise InvalidReply(f"invalid worker stdout JSON: {exc}") from None
    except RecursionError:
        raise InvalidReply("invalid worker stdout JSON: nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidReply(
            f"invalid worker stdout JSON: expected an object {{status, output, logs, reason}}, "
            f"not {_kind(value)}"
        )
    return _reply(value)


def _reply(document: Mapping[str, Any]) -> StdioReply:
    status_text = _field(document, "status")
    if status_text is not None and not isinstance(status_text, str):
        raise InvalidReply(f"invalid worker stdout JSON: status must be a string, not {_kind(status_text)}")
    output = _field(document, "output")
    if output is not None and not isinstance(output, dict):
        raise InvalidReply(f"invalid worker stdout JSON: output must be an object, not {_kind(output)}")
    if output is not None and deeper_than(output, OUTPUT_MAX_DEPTH):
        raise InvalidReply(f"invalid worker stdout JSON: output is nested too deeply (over "
                           f"{OUTPUT_MAX_DEPTH} levels)")  # fmt: skip
    logs = _field(document, "logs")
    if logs is not None and not (isinstance(logs, list) and all(isinstance(line, str) for line in logs)):
        what = _kind(logs) if not isinstance(logs, list) else "an array holding other things"
        raise InvalidReply(f"invalid worker stdout JSON: logs must be an array of strings, not {what}")
    reason = _field(document, "reason")
    if reason is not None and not isinstance(reason, str):
        raise InvalidReply(f"invalid worker stdout JSON: reason must be a string, not {_kind(reason)}")
    callback = _field(document, "callbackAfterSeconds")
    if callback is not None and (
        isinstance(callback, bool)
        or not isinstance(callback, int | float)
        or callback != int(callback)
        or not 0 <= callback <= MAX_CALLBACK_SECONDS
    ):
        raise InvalidReply(
            f"invalid worker stdout JSON: callbackAfterSeconds must be whole seconds from 0 to "
            f"{MAX_CALLBACK_SECONDS}, not {json.dumps(callback)[:40]}"
        )
    status = STATUSES.get(status_text or "")
    if status is None:
        shown = "no status" if status_text is None else repr(status_text[:60])
        raise InvalidReply(
            f"invalid status from worker: {shown} (expected COMPLETED, FAILED, IN_PROGRESS or "
            "FAILED_WITH_TERMINAL_ERROR)",
            excerpt=False,
        )
    return StdioReply(
        status=status,
        output=dict(output or {}),
        logs=tuple((logs or [])[-MAX_LOG_ENTRIES:]),
        reason=reason or "",
        callback_after_seconds=int(callback or 0) if status is TaskStatus.IN_PROGRESS else 0,
    )


# --------------------------------------------------------------------------- the update


def _diagnostics(exit: ChildExit, *, stdout: bytes | None = None) -> dict[str, Any]:
    output: dict[str, Any] = {
        "exitCode": exit.exit_code,
        "signal": signal_name(exit.signal) if exit.signal is not None else None,
        "durationSeconds": round(exit.duration_seconds, 3),
        "stderrTail": exit.stderr_tail,
        "resources": resources(exit),
    }
    if stdout is not None:
        output["stdoutExcerpt"] = stdout[:STDOUT_EXCERPT_BYTES].decode("utf-8", "replace")
    return output


def to_stdio_result(
    task: Task, exit: ChildExit, spec: CommandSpec, *, worker_id: str, timed_out: bool = False
) -> TaskResult:
    """The update for ``task`` under the stdio contract; first match wins::

    exec timeout                    -> FAILED "exec timeout after 30s"
    OOM kills in the tree's group   -> FAILED "worker execution failed: memory limit 64 MiB exceeded: killed
                                       by the kernel's OOM killer" (whatever the exit, as natively)
    killed by a signal              -> FAILED "worker execution failed: killed by SIGKILL"
    exit in in_progress_exit_code   -> IN_PROGRESS (callbackAfterSeconds from the spec)
    exit in terminal_exit_codes     -> FAILED_WITH_TERMINAL_ERROR "worker execution failed: exit status 2"
    any other non-zero exit         -> FAILED "worker execution failed: exit status 3: <last stderr line>"
                                       (the terminal one gets the stderr line too; under a memory
                                       rlimit, "(under memory limit 64 MiB, a per-process rlimit)")
    exit 0, stdout over the limit   -> FAILED "worker stdout is too large: ..."
    exit 0, stdout not the document -> FAILED "invalid worker stdout JSON: <why>; stdout began: '...'"
    exit 0, an unknown status       -> FAILED "invalid status from worker: 'DONE' (...)"
    exit 0, the document            -> its status, output -> outputData, reason -> reasonForIncompletion,
                                       logs -> the task's execution log (``TaskResult.logs``)

    ``FAILED_WITH_TERMINAL_ERROR`` from the document is honoured (conductor-cli turns it into FAILED, and
    so into a retry the script asked not to have). An IN_PROGRESS document without
    ``callbackAfterSeconds`` is re-queued at once, as with conductor-cli. A valid document's ``output``
    is the whole of outputData, as with conductor-cli (no ``resources`` added); the failures above carry
    ``exitCode``, ``signal``, ``durationSeconds``, ``stderrTail``, ``resources`` (and ``stdoutExcerpt``
    when stdout was the trouble). ``reasons.py`` holds what this mapping and the native one share.
    """
    document = exit.stdout_document or b""
    # The exit alone decides (the document is not read) unless it was 0.
    decided = exit_verdict(exit, spec, timed_out, failed="worker execution failed: ", exited="exit status")
    if decided is not None:
        status, reason = decided
        in_progress = status is TaskStatus.IN_PROGRESS
        return TaskResult(
            task_id=task.task_id, workflow_id=task.workflow_id, status=status,
            output_data=_diagnostics(exit), reason_for_incompletion=bounded(reason) or None,
            callback_after_seconds=callback_seconds(spec, exit.exit_code) if in_progress else 0,
            worker_id=worker_id,
        )  # fmt: skip
    try:
        reply = parse_reply(document, total_bytes=exit.stdout_bytes)
        size = json_size(reply.output)
        if size > OUTPUT_DATA_LIMIT_BYTES:  # the whole outputData, as the server measures it
            raise InvalidReply(too_large("the document's output (outputData)", size), excerpt=False)
    except InvalidReply as exc:
        reason = str(exc)
        if exc.excerpt:
            reason = f"{reason}; stdout began: {excerpt(document)}"
        return TaskResult(
            task_id=task.task_id, workflow_id=task.workflow_id, status=TaskStatus.FAILED,
            output_data=_diagnostics(exit, stdout=document), reason_for_incompletion=bounded(reason),
            worker_id=worker_id,
        )  # fmt: skip
    return TaskResult(
        task_id=task.task_id,
        workflow_id=task.workflow_id,
        status=reply.status,
        output_data=reply.output,
        reason_for_incompletion=bounded(reply.reason) or None,
        callback_after_seconds=reply.callback_after_seconds,
        worker_id=worker_id,
        # streamed by the runner, see runner/loop/runner.py
        logs=tuple(TaskLog(line, 0) for line in reply.logs),
    )
