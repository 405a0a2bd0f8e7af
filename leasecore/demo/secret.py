"""The demo's server-side secret: its name, how the child's line about it reads, and the judge's
checks of its way to the child and of its masking. Pure: the scene player (``leasecore.demo.scenes``)
reads the task log and the files, the scene's tracker (``leasecore.demo.judge``) holds what was found.

The task def declares ``SECRET_NAME`` (``runtimeMetadata``; declared by the demo when it registers
the def, not in the sample file, so that a def registered by hand needs no secret); each scene's
server holds a fresh random value for it; the sample task prints a line holding that value, which the
runner must mask (``***``) in the task log, the task's output and its own log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

SECRET_NAME = "DEMO_API_TOKEN"
SECRET_LINE_START = f"secret {SECRET_NAME}: "  # how the sample task's line about it begins
# What the line says when the variable and the file agree (sample_tasks/demo_long.py).
SAME_IN_BOTH = f"the same in ${SECRET_NAME} and in $CONDUCTOR_SECRETS_FILE"


def secret_line(log_entries: Iterable[Mapping[str, Any]]) -> str | None:
    """The child's line about the secret among a task's log entries (``{"log": text, ...}``; an entry
    may hold several lines: the runner sends a batch of output as one)."""
    for entry in log_entries:
        text = entry.get("log")
        for line in text.splitlines() if isinstance(text, str) else ():
            if line.startswith(SECRET_LINE_START):
                return line
    return None


def leaks(value: str, texts: Mapping[str, str]) -> tuple[str, ...]:
    """The places (``texts``: place -> what it holds) where ``value`` appears as it is."""
    return tuple(place for place, text in texts.items() if value in text)


def secret_checks(line: str | None, leaked: Sequence[str] | None) -> list[tuple[bool, str]]:
    """The scene's claims about the secret: reached the child both ways, masked in the task log,
    unmasked nowhere (``leaked`` None: the places were never read, which fails too)."""
    checks = [
        (
            line is not None and line.startswith(SECRET_LINE_START + SAME_IN_BOTH),
            f"the child got the server's secret {SECRET_NAME} as a variable and in $CONDUCTOR_SECRETS_FILE "
            f"(its line: {line or 'not in the task log'})",
        ),
        (line is not None and line.endswith("***"), "the value the child printed is *** in the task log"),
    ]
    if leaked is None:
        checks.append((False, "nothing was read for the secret's value (task log, task output, runner log)"))
    elif leaked:
        checks.append((False, f"the secret's value is unmasked in: {', '.join(leaked)}"))
    else:
        checks.append((True, "the secret's value is nowhere unmasked (task log, task output, runner log)"))
    return checks
