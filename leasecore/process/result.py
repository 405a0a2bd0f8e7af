"""From a child's exit to the task result Conductor gets (DESIGN.md §3). Pure.

    exit 0                         -> COMPLETED
    in spec.in_progress_exit_code  -> IN_PROGRESS, callbackAfterSeconds = spec.callback_after_seconds
    in spec.terminal_exit_codes    -> FAILED_WITH_TERMINAL_ERROR "exit code 2: <last stderr line>"
    any other exit code            -> FAILED "exit code 3: <last stderr line>"
    killed by a signal             -> FAILED "killed by SIGKILL"
    OOM kills in the tree's group  -> FAILED "memory limit 64 MiB exceeded: killed by the kernel's OOM
                                      killer" (from the group's events, whatever the exit was)
    timed_out=True                 -> FAILED "exec timeout after 30s"
    output file unusable           -> FAILED with the reason (when the exit alone meant success)

outputData = the output-file object, then ``exitCode``, ``signal``, ``durationSeconds``,
``stdoutTail``, ``stderrTail``, ``resources`` (``max_rss_bytes``, ``cpu_user_seconds``,
``cpu_system_seconds``; None where unknown) (these keys win over the file's), and ``outputError``.
``protocol = "stdio"`` maps differently: ``stdio_protocol.to_stdio_result``.
Its size is bounded: the file object by ``OUTPUT_FILE_LIMIT`` (checked when it is read), each tail by
the capture's ``TAIL_BYTES``: well under Conductor's 3 MB externalisation threshold.
"""

from __future__ import annotations

import signal as signal_module
from typing import Any

from leasecore.limits import format_size, memory_reason
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.spec import ChildExit, CommandSpec
from leasecore.process.stdio_protocol import STDIO, to_stdio_result

REASON_LIMIT = 500
RESOURCE_KEYS = ("max_rss_bytes", "cpu_user_seconds", "cpu_system_seconds")


def _last_line(text: str) -> str:
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def _signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _seconds(value: float) -> str:
    return f"{value:g}s"


def _status_and_reason(exit: ChildExit, spec: CommandSpec, timed_out: bool) -> tuple[TaskStatus, str]:
    if timed_out:
        return TaskStatus.FAILED, f"exec timeout after {_seconds(spec.exec_timeout_seconds)}"
    if exit.oom_kills > 0:
        return TaskStatus.FAILED, memory_reason(spec.limits.memory_max)
    if exit.signal is not None:
        return TaskStatus.FAILED, f"killed by {_signal_name(exit.signal)}"
    code = exit.exit_code
    if code == 0:
        return TaskStatus.COMPLETED, ""
    if code is not None and code == spec.in_progress_exit_code:
        return TaskStatus.IN_PROGRESS, ""
    last = _last_line(exit.stderr_tail)
    reason = f"exit code {code}: {last}" if last else f"exit code {code} (nothing on stderr)"
    if exit.memory_limit_by == "rlimit" and spec.limits.memory_max is not None:
        # Not a verdict (no group tells why it failed): the limit that was in force, said plainly.
        reason += f" (under memory limit {format_size(spec.limits.memory_max)}, a per-process rlimit)"
    if code in spec.terminal_exit_codes:
        return TaskStatus.FAILED_WITH_TERMINAL_ERROR, reason
    return TaskStatus.FAILED, reason


def to_task_result(
    task: Task, exit: ChildExit, spec: CommandSpec, *, worker_id: str, timed_out: bool = False
) -> TaskResult:
    """The update to send for ``task`` now that its child ended as ``exit``."""
    if spec.protocol == STDIO:  # conductor-cli's contract: the result is the stdout document
        return to_stdio_result(task, exit, spec, worker_id=worker_id, timed_out=timed_out)
    status, reason = _status_and_reason(exit, spec, timed_out)
    if exit.output_error and status in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
        status, reason = TaskStatus.FAILED, exit.output_error
    output: dict[str, Any] = dict(exit.output or {})
    output.update(
        exitCode=exit.exit_code,
        signal=_signal_name(exit.signal) if exit.signal is not None else None,
        durationSeconds=round(exit.duration_seconds, 3),
        stdoutTail=exit.stdout_tail,
        stderrTail=exit.stderr_tail,
        resources={name: (exit.resources or {}).get(name) for name in RESOURCE_KEYS},
    )
    if exit.output_error:
        output["outputError"] = exit.output_error
    if len(reason) > REASON_LIMIT:
        reason = reason[: REASON_LIMIT - 3] + "..."
    return TaskResult(
        task_id=task.task_id,
        workflow_id=task.workflow_id,
        status=status,
        output_data=output,
        reason_for_incompletion=reason or None,
        callback_after_seconds=spec.callback_after_seconds if status == TaskStatus.IN_PROGRESS else 0,
        worker_id=worker_id,
    )
