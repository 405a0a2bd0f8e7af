"""The child's own word on its result: top-level ``"$status"``, ``"$reason"`` and
``"$callbackAfterSeconds"`` in CONDUCTOR_OUTPUT_FILE (DESIGN.md §3; the precedence against the exit
code and the exit-code policy is ``task_result.to_task_result``'s).

Owns ``take_decision``: the three keys taken out of the output object (they never reach outputData)
and checked: a value that is not allowed is an error saying which key and what is allowed, which the
result turns into FAILED. Must not touch: anything but its arguments (pure). Threads: any.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leasecore.models import TaskStatus

STATUS_KEY, REASON_KEY, CALLBACK_KEY = "$status", "$reason", "$callbackAfterSeconds"
DECISION_KEYS = (STATUS_KEY, REASON_KEY, CALLBACK_KEY)
ALLOWED_STATUSES = ("COMPLETED", "FAILED", "FAILED_WITH_TERMINAL_ERROR", "IN_PROGRESS")
MAX_CALLBACK_SECONDS = 365 * 24 * 3600
_WHERE = "CONDUCTOR_OUTPUT_FILE"


@dataclass(frozen=True, eq=False)
class Decision:
    """What the child asked for (None: not asked)."""

    status: TaskStatus | None = None
    reason: str | None = None
    callback_after_seconds: int | None = None


NONE = Decision()


def take_decision(output: dict[str, Any]) -> tuple[Decision, str | None]:
    """Remove the ``$`` keys from ``output`` and check them: ``(decision, None)``, or ``(what is
    valid of it, why the rest is not)``."""
    if not any(key in output for key in DECISION_KEYS):
        return NONE, None
    status_value = output.pop(STATUS_KEY, None)
    reason_value = output.pop(REASON_KEY, None)
    callback_value = output.pop(CALLBACK_KEY, None)
    errors: list[str] = []
    status = None
    if status_value is not None:
        if isinstance(status_value, str) and status_value in ALLOWED_STATUSES:
            status = TaskStatus(status_value)
        else:
            allowed = ", ".join(ALLOWED_STATUSES)
            errors.append(f"{STATUS_KEY} must be one of {allowed}, not {_show(status_value)}")
    reason = None
    if reason_value is not None:
        if isinstance(reason_value, str):
            reason = reason_value
        else:
            errors.append(f"{REASON_KEY} must be a string, not {_show(reason_value)}")
    callback = None
    if callback_value is not None:
        if type(callback_value) is int and 0 <= callback_value <= MAX_CALLBACK_SECONDS:
            callback = callback_value
        else:
            errors.append(f"{CALLBACK_KEY} must be whole seconds from 0 to {MAX_CALLBACK_SECONDS}, "
                          f"not {_show(callback_value)}")
    error = f"{_WHERE}: " + "; ".join(errors) if errors else None
    return Decision(status, reason, callback), error


def decided_reason(status: TaskStatus, exit_code: int | None) -> str:
    """The reason of a failure the child set with ``$status`` and no ``$reason``."""
    if status in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
        return ""
    return f"the command set {STATUS_KEY} {status.value} (exit code {exit_code})"


def _show(value: Any) -> str:
    """A value as JSON would name it, short: 'DONE', -1, true, an object, an array."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "an array"
    text = "true" if value is True else "false" if value is False else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
