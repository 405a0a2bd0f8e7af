"""From a child's exit to the task result Conductor gets, under the native protocol (DESIGN.md §3).

Owns ``to_task_result``: the status (the table in its docstring: the runner's own verdicts, then the
exit-code policy, then the child's ``"$status"``, then the exit code), ``reasonForIncompletion`` and the
outputData of the update (the output file's object, then ``exitCode``, ``signal``,
``durationSeconds``, ``stdoutTail``, ``stderrTail``, ``resources`` and ``outputError``: these keys
win over the file's). Its size is bounded: the file object by ``OUTPUT_FILE_LIMIT_BYTES`` (checked when it
is read), each tail by the capture's ``TAIL_BYTES``: well under Conductor's 3 MB externalisation
threshold. A spec with ``protocol = "stdio"`` is handed to ``stdio_protocol.to_stdio_result``.

Must not touch: anything but its arguments. Pure: no I/O, no clock; ``reasons.py`` words what both
mappings share. Threads: any (it holds no state); the runner maps an exit on its main thread.
"""

from __future__ import annotations

from typing import Any

from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.payload import OUTPUT_DATA_LIMIT_BYTES, json_size, too_large
from leasecore.process.results.decisions import decided_reason, take_decision
from leasecore.process.results.reasons import (
    bounded,
    callback_seconds,
    exit_rule,
    exit_verdict,
    resources,
    signal_name,
)
from leasecore.process.results.stdio_protocol import to_stdio_result
from leasecore.process.spec import STDIO, ChildExit, CommandSpec

# Without an output file's object, outputData holds only the runner's keys: an exit code, a signal's
# name, a duration, the resources (three numbers) and, of any length, the two tails and the error.
# In compact UTF-8 JSON a character takes at most 6 bytes (a control character's \u escape).
_MAX_BYTES_PER_CHAR = 6
_OWN_KEYS_BYTES = 4096  # the keys, the numbers and the signal's name: a few hundred bytes, bounded


def _may_be_too_large(exit: ChildExit, error: str | None) -> bool:
    """Whether outputData without a file's object could pass the limit (else it is not encoded to
    be measured: a ``json.dumps`` of the tails per task, tens of µs for a chatty child)."""
    chars = len(exit.stdout_tail) + len(exit.stderr_tail) + len(error or "")
    return _MAX_BYTES_PER_CHAR * chars + _OWN_KEYS_BYTES > OUTPUT_DATA_LIMIT_BYTES


def to_task_result(
    task: Task, exit: ChildExit, spec: CommandSpec, *, worker_id: str, timed_out: bool = False
) -> TaskResult:
    """The update to send for ``task`` now that its child ended as ``exit``; first match wins::

    timed_out=True                 -> FAILED "exec timeout after 30s"
    OOM kills in the tree's group  -> FAILED "memory limit 64 MiB exceeded: killed by the kernel's OOM
                                      killer" (from the group's events, whatever the exit was)
    killed by a signal             -> FAILED "killed by SIGKILL"
    a code in the exit-code policy -> its status (spec.exit_codes, then the shorthands: in
                                      spec.in_progress_exit_code -> IN_PROGRESS, in
                                      spec.terminal_exit_codes -> FAILED_WITH_TERMINAL_ERROR "exit code 2:
                                      <last stderr line>")
    "$status" in the output file   -> that status (the child decides)
    exit 0                         -> COMPLETED
    any other exit code            -> FAILED "exit code 3: <last stderr line>"

    Then an unusable output file, or an invalid ``$`` key, turns COMPLETED or IN_PROGRESS into FAILED
    with the reason. ``"$reason"`` replaces the reason of any status but COMPLETED (not the runner's
    own: a timeout, a kill, an unusable file); ``"$callbackAfterSeconds"`` replaces an IN_PROGRESS's
    callback (else the policy's, else ``spec.callback_after_seconds``). The ``$`` keys never reach
    outputData (``decisions.take_decision``).
    """
    if spec.protocol == STDIO:  # conductor-cli's contract: the result is the stdout document
        return to_stdio_result(task, exit, spec, worker_id=worker_id, timed_out=timed_out)
    output: dict[str, Any] = dict(exit.output or {})
    decision, decision_error = take_decision(output)
    verdict = exit_verdict(exit, spec, timed_out)
    observed = timed_out or exit.oom_kills > 0 or exit.signal is not None  # the runner saw how it ended
    if verdict is not None and (observed or exit_rule(spec, exit.exit_code) is not None):
        status, reason = verdict
    elif decision.status is not None:
        status, reason = decision.status, decided_reason(decision.status, exit.exit_code)
    else:
        status, reason = verdict or (TaskStatus.COMPLETED, "")
    if decision.reason is not None and not observed and status is not TaskStatus.COMPLETED:
        reason = decision.reason
    error = exit.output_error or decision_error
    if error and status in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
        status, reason = TaskStatus.FAILED, error
    callback = 0
    if status is TaskStatus.IN_PROGRESS:
        asked = decision.callback_after_seconds
        callback = callback_seconds(spec, exit.exit_code) if asked is None else asked
    output.update(
        exitCode=exit.exit_code,
        signal=signal_name(exit.signal) if exit.signal is not None else None,
        durationSeconds=round(exit.duration_seconds, 3),
        stdoutTail=exit.stdout_tail,
        stderrTail=exit.stderr_tail,
        resources=resources(exit),
    )
    if error:
        output["outputError"] = error
    size = json_size(output) if exit.output or _may_be_too_large(exit, error) else 0
    if size > OUTPUT_DATA_LIMIT_BYTES:  # the file's object fit, but not with what is added to it
        status, callback = TaskStatus.FAILED, 0
        reason = too_large("outputData (the output file's object, the tails, ...)", size)
        kept = ("exitCode", "signal", "durationSeconds", "stderrTail", "resources")
        output = {key: output[key] for key in kept}
        output["outputError"] = reason
    reason = bounded(reason)
    return TaskResult(
        task_id=task.task_id,
        workflow_id=task.workflow_id,
        status=status,
        output_data=output,
        reason_for_incompletion=reason or None,
        callback_after_seconds=callback,
        worker_id=worker_id,
    )
