"""What both result mappings (``result.py`` native, ``stdio_protocol.py`` stdio) say the same way. Pure.

The last stderr line of a reason, a signal's name, the bound on ``reasonForIncompletion``, the
``resources`` object of outputData, and the memory limit's part in a failure (``limits.memory_reason``
when the kernel's OOM killer hit the tree's group; a plain note when only a per-process rlimit was in
force).
"""

from __future__ import annotations

import signal as signal_module
from typing import TYPE_CHECKING, Any

from leasecore.limits import format_size, memory_reason

if TYPE_CHECKING:  # spec.py imports stdio_protocol, which imports this module: only the types
    from leasecore.process.spec import ChildExit, CommandSpec

REASON_LIMIT = 500
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
    """``reason`` cut to ``REASON_LIMIT`` characters (with "..." when cut)."""
    return reason if len(reason) <= REASON_LIMIT else reason[: REASON_LIMIT - 3] + "..."


def resources(exit: ChildExit) -> dict[str, Any]:
    """outputData's ``resources``: every key present, None where the accounting did not know it."""
    return {name: (exit.resources or {}).get(name) for name in RESOURCE_KEYS}


def oom_reason(exit: ChildExit, spec: CommandSpec) -> str | None:
    """The reason when the kernel's OOM killer hit the tree's group (whatever the exit was), else None."""
    return memory_reason(spec.limits.memory_max) if exit.oom_kills > 0 else None


def rlimit_note(exit: ChildExit, spec: CommandSpec) -> str:
    """For a non-zero exit under a per-process memory rlimit: the limit that was in force, said plainly
    (not a verdict: no group tells why it failed). "" otherwise."""
    if exit.memory_limit_by == "rlimit" and spec.limits.memory_max is not None:
        return f" (under memory limit {format_size(spec.limits.memory_max)}, a per-process rlimit)"
    return ""
