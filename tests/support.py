"""The one condition wait of the test suite (and the house rule it serves).

Tests wait for something to happen (a child to start, a status file to appear, a server to answer)
with :func:`wait_until`: a predicate polled against a deadline, failing with what was awaited. A fixed
``time.sleep`` of 0.5 s or more in a test is a guess that is either too long (a slow suite) or too
short (a flaky one); ``tests/unit/test_no_fixed_sleeps.py`` fails on one outside this module, its
documented exceptions aside.

Owns: polling with a deadline. Touches nothing else: no fixtures, no product code. Runs on whichever
thread calls it (the test's, usually).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_SECONDS = 30.0
DEFAULT_INTERVAL_SECONDS = 0.02


def wait_until(
    predicate: Callable[[], T],
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    what: str | None = None,
    *,
    interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that value.

    The deadline is checked after each call: the predicate runs at least once, and once more after a
    pause in which the deadline passed. Past ``timeout_seconds`` it fails with an ``AssertionError``
    naming ``what`` was awaited (by default the predicate's source line) and its last value.
    ``interval_seconds`` is the pause between calls, a polling interval: raise it for predicates that
    cost something (one that asks the real server to decide a workflow).
    """
    deadline = time.monotonic() + timeout_seconds
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_seconds:g} s waiting for {what or describe(predicate)}"
                f" (last value: {value!r})"
            )
        time.sleep(interval_seconds)


def describe(predicate: Callable[[], object]) -> str:
    """The predicate's source line (a lambda's text), else its name: a message for a wait with no ``what``."""
    try:
        source = inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        source = ""
    if source.startswith("def ") or not source:
        return getattr(predicate, "__qualname__", repr(predicate))
    return source if len(source) <= 160 else source[:157] + "..."
