"""``tests.support.wait_until``: the one condition wait of the suite, and that it stays the one."""

from __future__ import annotations

import ast
import itertools
import re
import time
from pathlib import Path

import pytest

from tests.support import wait_until

TESTS = Path(__file__).resolve().parents[1]


def test_returns_the_first_truthy_value() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: (n := next(calls)) >= 3 and f"call {n}", 5, "the third call") == "call 3"


def test_fails_at_the_deadline_naming_what_was_awaited_and_the_last_value() -> None:
    started = time.monotonic()
    expected = r"timed out after 0.1 s waiting for the moon \(last value: \[\]\)"
    with pytest.raises(AssertionError, match=expected):
        wait_until(lambda: [], 0.1, "the moon")
    assert 0.1 <= time.monotonic() - started < 5


def test_without_what_the_message_quotes_the_predicate() -> None:
    with pytest.raises(AssertionError, match=r"waiting for .*lambda: 1 > 2"):
        wait_until(lambda: 1 > 2, 0.01)

    def never() -> bool:
        return False

    with pytest.raises(AssertionError, match=r"waiting for .*never"):
        wait_until(never, 0.01)


def test_the_interval_paces_the_calls() -> None:
    calls: list[float] = []
    with pytest.raises(AssertionError):
        wait_until(lambda: calls.append(time.monotonic()), 0.3, "nothing", interval_seconds=0.1)
    assert 2 <= len(calls) <= 5  # about 0.3 / 0.1 + 1, never a busy loop


def test_a_deadline_passed_during_the_pause_still_gets_a_last_look() -> None:
    calls = itertools.count(1)
    assert wait_until(lambda: next(calls) >= 2, 0.05, "a second look", interval_seconds=0.1)


def test_wait_until_is_defined_once_in_the_suite() -> None:
    definitions = []
    for file in sorted(TESTS.rglob("*.py")):
        source = file.read_text(encoding="utf-8")
        if not re.search(r"def\s+wait_until\b", source):
            continue  # no definition can be in it: spares the parse
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "wait_until":
                definitions.append(file.relative_to(TESTS).as_posix())
    assert definitions == ["support.py"], f"copies of wait_until (import tests.support's): {definitions}"
