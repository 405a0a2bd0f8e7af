"""What both result mappings (``task_result.py`` native, ``stdio_protocol.py`` stdio) say the same way.

Owns the verdict of the exit alone (``exit_verdict``: exec timeout, OOM kill in the tree's group,
a signal, a non-zero exit code; None for a clean exit), the last stderr line a reason quotes
(``last_line``), a signal's name (``signal_name``), the bound on ``reasonForIncompletion``
(``bounded`` to ``REASON_LIMIT_CHARS``) and the ``resources`` object of outputData.

Must not touch: anything but its arguments. Pure: no I/O, no clock, no processes; the two mappings
decide what to do with the verdict, this module only words it.

Threads: any (it holds no state); the runner maps an exit on its main thread.
"""

from __future__ import annotations

import signal as signal_module
from typing import Any

from leasecore.limits import format_size, memory_reason
from leasecore.models import TaskStatus
from leasecore.process.spec import ChildExit, CommandSpec, ExitRule

REASON_LIMIT_CHARS = 500
RESOURCE_KEYS = ("max_rss_bytes", "cpu_user_seconds", "cpu_system_seconds")


def last_line(text: str) -> str:
    """The last non-blank line of ``text``, stripped ("" when there is none)."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return ""


def signal_name(number: int) -> str:
    try:
        return signal_module.Signals(number).name
    except ValueError:
        return f"signal {number}"


def bounded(reason: str) -> str:
    """``reason`` cut to ``REASON_LIMIT_CHARS`` characters (with "..." when cut)."""
    return reason if len(reason) <= REASON_LIMIT_CHARS else reason[: REASON_LIMIT_CHARS - 3] + "..."


def resources(exit: ChildExit) -> dict[str, Any]:
    """outputData's ``resources``: every key present, None where the accounting did not know it."""
    return {name: (exit.resources or {}).get(name) for name in RESOURCE_KEYS}


def exit_verdict(
    exit: ChildExit, spec: CommandSpec, timed_out: bool, *, failed: str = "", exited: str = "exit code"
) -> tuple[TaskStatus, str] | None:
    """The status and reason the exit alone gives; None for exit 0 (the caller's output decides).

    First match wins: the exec timeout; OOM kills in the tree's group (``limits.memory_reason``,
    whatever the exit was: from the group's events, never guessed from a SIGKILL); a signal; a
    code the exit-code policy maps to COMPLETED or IN_PROGRESS (``exit_rule``); any other code, with
    the last stderr line (and, under a per-process memory rlimit, the limit that was in force: not a
    verdict, no group tells why it failed), FAILED or as the policy maps it.
    ``failed`` prefixes the failures' reasons but the timeout's,
    ``exited`` names the code ("exit code 3" natively; the stdio protocol says "exit status 3").
    """
    if timed_out:
        return TaskStatus.FAILED, f"exec timeout after {spec.exec_timeout_seconds:g}s"
    if exit.oom_kills > 0:
        return TaskStatus.FAILED, failed + memory_reason(spec.limits.memory_max)
    if exit.signal is not None:
        return TaskStatus.FAILED, f"{failed}killed by {signal_name(exit.signal)}"
    code = exit.exit_code
    if code == 0:
        return None
    rule = exit_rule(spec, code)
    if rule is not None and rule.status in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
        return rule.status, ""
    last = last_line(exit.stderr_tail)
    reason = f"{failed}{exited} {code}" + (f": {last}" if last else " (nothing on stderr)")
    if exit.memory_limit_by == "rlimit" and spec.limits.memory_max is not None:
        reason += f" (under memory limit {format_size(spec.limits.memory_max)}, a per-process rlimit)"
    return (rule.status if rule is not None else TaskStatus.FAILED), reason


def exit_rule(spec: CommandSpec, code: int | None) -> ExitRule | None:
    """What the exit-code policy says of ``code``: ``exit_codes``, then its shorthands
    (``terminal_exit_codes``, ``in_progress_exit_code``); None: the code is not in it (exit 0 never is)."""
    if not code:
        return None
    rule = spec.exit_codes.get(code)
    if rule is not None:
        return rule
    if code == spec.in_progress_exit_code:
        return ExitRule(TaskStatus.IN_PROGRESS)
    if code in spec.terminal_exit_codes:
        return ExitRule(TaskStatus.FAILED_WITH_TERMINAL_ERROR)
    return None


def callback_seconds(spec: CommandSpec, code: int | None) -> int:
    """``callbackAfterSeconds`` of an IN_PROGRESS exit with ``code``: its rule's, else the spec's."""
    rule = exit_rule(spec, code)
    if rule is not None and rule.callback_after_seconds is not None:
        return rule.callback_after_seconds
    return spec.callback_after_seconds
