"""No fixed sleeps of 0.5 s or more in the tests (house rule), read from the source with ``ast``.

A test that sleeps to let something happen is too slow where the machine is idle and flaky where it is
loaded: it waits for the condition instead (``tests.support.wait_until``). This walks every ``.py`` file
under ``tests/`` except ``tests/support.py`` (the one place that sleeps, as a polling interval) and
fails on a call of ``time.sleep(x)`` (however ``sleep`` was imported) or ``threading.Event().wait(x)``
(a fresh event nobody sets is a sleep too) whose ``x`` is a number >= 0.5 or not a number literal at
all (an expression could be anything), unless the call is listed in ``EXCEPTIONS`` with its reason.
Child scripts held in strings are data, not calls of the test process: a child sleeping is what many
tests are about. The walker is also run on planted violations, so a walker that finds nothing fails.
"""

from __future__ import annotations

import ast
import bisect
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
LIMIT_SECONDS = 0.5
SUPPORT = "support.py"

# (file relative to tests/, enclosing function) -> why a sleep there is no wait for an event.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("adapters/test_lean_http.py",
     "test_a_wait_cut_short_by_the_kept_timeout_goes_on_until_the_answer.late"): (
        "a scripted server's latency (1.4 s) past the 1 s receive timeout the connection keeps: what is "
        "tested is a wait that outlasts the kept timeout; there is no event to wait for"
    ),
    ("integration/test_runner_chain_fakes.py", "ChainingConductor.update_v2"): (
        "a fake server's latency inside update-v2 (0.3 s): the test checks that the claimed task's "
        "lease counts from the send time, not from the answer; there is no event to wait for"
    ),
    ("conformance/harness.py", "Harness.keep_alive"): (
        "the pace of the heartbeats a test sends (every 0.4 s by default): what is measured is the "
        "server keeping the lease, there is no event to wait for"
    ),
    ("conformance/harness.py", "sleep_past"): (
        "lets a server-side deadline pass in the timeout tests, whose subject is time itself; the real "
        "server's clock cannot be injected (the embedded one's FakeClock tests are in adapters/)"
    ),
    ("integration/sdk_worker.py", "sleep_then_complete"): (
        "the body of the SDK worker's task, run in a child process (the task that takes a while), "
        "not a wait of the test"
    ),
    (
        "adapters/test_server_timing.py",
        "test_idle_server_with_pending_deadlines_and_waiting_polls_does_not_spin",
    ): (
        "a one-second window to measure the server's CPU over while nothing should happen: an "
        "absence has no event to wait for"
    ),
    (
        "integration/test_held_start_e2e.py",
        "test_a_held_redelivery_whose_previous_holder_failed_it_meanwhile_is_never_started",
    ): (
        "the scenario's moment: the previous holder's FAILED must land after the held lease's first "
        "ownership check and before the hold ends (the runner's checks cannot be observed from outside); "
        "the time is the subject, there is no event to wait for"
    ),
}


@dataclass(frozen=True)
class Sleep:
    path: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        return f"tests/{self.path}:{self.line} in {self.function}: {self.code}"


def _is_short(arg: ast.expr) -> bool:
    """A number literal under the limit (the only argument known to be short)."""
    return (
        isinstance(arg, ast.Constant)
        and isinstance(arg.value, int | float)
        and not isinstance(arg.value, bool)
        and arg.value < LIMIT_SECONDS
    )


class _Finder(ast.NodeVisitor):
    """One pass in source order: imports bind the names (they come before their use) that calls use."""

    def __init__(self, path: str, candidates: list[int]) -> None:
        self.path = path
        self.found: list[Sleep] = []
        self._candidates = candidates  # sorted numbers of the lines that mention sleep or .wait(
        self._scope: list[str] = []
        self._time_names = {"time"}  # names bound to the time module
        self._sleep_names: set[str] = set()  # names bound to time.sleep
        self._event_names = {"Event"}  # names bound to threading.Event
        self._threading_names = {"threading"}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name == "time":
                self._time_names.add(alias.asname or "time")
            if alias.name == "threading":
                self._threading_names.add(alias.asname or "threading")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for alias in node.names:
            if node.module == "time" and alias.name == "sleep":
                self._sleep_names.add(alias.asname or "sleep")
            if node.module == "threading" and alias.name == "Event":
                self._event_names.add(alias.asname or "Event")

    def generic_visit(self, node: ast.AST) -> None:
        """Only into the subtrees that span a candidate line (imports always): the walk stays cheap."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import | ast.ImportFrom) or self._spans_candidate(child):
                self.visit(child)

    def _spans_candidate(self, node: ast.AST) -> bool:
        first, last = getattr(node, "lineno", None), getattr(node, "end_lineno", None)
        if first is None or last is None:
            return True
        at = bisect.bisect_left(self._candidates, first)
        return at < len(self._candidates) and self._candidates[at] <= last

    def _visit_scope(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope

    def _is_sleep(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self._sleep_names
        return (
            isinstance(func, ast.Attribute) and func.attr == "sleep"
            and isinstance(func.value, ast.Name) and func.value.id in self._time_names
        )

    def _is_fresh_event_wait(self, func: ast.expr) -> bool:
        if not (isinstance(func, ast.Attribute) and func.attr == "wait" and isinstance(func.value, ast.Call)):
            return False
        made = func.value.func
        if isinstance(made, ast.Name):
            return made.id in self._event_names
        return (
            isinstance(made, ast.Attribute) and made.attr == "Event"
            and isinstance(made.value, ast.Name) and made.value.id in self._threading_names
        )

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_sleep(node.func) or self._is_fresh_event_wait(node.func):
            arg = node.args[0] if node.args else (node.keywords[0].value if node.keywords else None)
            if arg is None or not _is_short(arg):
                self.found.append(
                    Sleep(self.path, node.lineno, ".".join(self._scope) or "<module>", ast.unparse(node))
                )
        self.generic_visit(node)


def find_sleeps(path: str, source: str) -> list[Sleep]:
    aliases = re.findall(r"\bsleep\s+as\s+(\w+)", source)  # from time import sleep as nap
    words = ("sleep", ".wait(", *aliases)
    candidates = [n for n, line in enumerate(source.splitlines(), 1) if any(w in line for w in words)]
    if not candidates:
        return []  # neither call can be in it: spares the parse
    finder = _Finder(path, candidates)
    finder.visit(ast.parse(source))
    return finder.found


def _test_sources() -> Iterator[tuple[str, str]]:
    for file in sorted(TESTS.rglob("*.py")):
        relative = file.relative_to(TESTS).as_posix()
        if relative == SUPPORT or relative.startswith("support/"):
            continue
        yield relative, file.read_text(encoding="utf-8")


@functools.cache
def _suite_sleeps() -> tuple[Sleep, ...]:
    return tuple(s for path, source in _test_sources() for s in find_sleeps(path, source))


def test_no_test_sleeps_half_a_second_or_more_outside_the_support_module() -> None:
    found = _suite_sleeps()
    unexplained = [str(s) for s in found if (s.path, s.function) not in EXCEPTIONS]
    assert not unexplained, (
        "fixed sleeps (wait for the condition with tests.support.wait_until instead, or add the call to "
        "EXCEPTIONS with the reason it waits for no event):\n" + "\n".join(unexplained)
    )


def test_every_exception_still_names_a_sleep() -> None:
    found = {(s.path, s.function) for s in _suite_sleeps()}
    stale = sorted(set(EXCEPTIONS) - found)
    assert not stale, f"EXCEPTIONS lists calls that no longer sleep (remove them): {stale}"


def test_the_walker_finds_each_kind_of_planted_sleep() -> None:
    planted = '''
import time
import time as clock
from time import sleep as nap
import threading
from threading import Event

CHILD = "import time; time.sleep(600)"  # a child's script: data, not a call


def fine():
    time.sleep(0.05)
    threading.Event().wait(0.01)
    nap(0.49)


def long_literal():
    time.sleep(0.5)


class Waits:
    def unknown(self, seconds):
        clock.sleep(seconds)


def imported_sleep():
    nap(2)


def fresh_events():
    threading.Event().wait(1)
    Event().wait(timeout=3.0)
'''
    found = find_sleeps("planted.py", planted)
    assert [(s.function, s.code) for s in found] == [
        ("long_literal", "time.sleep(0.5)"),
        ("Waits.unknown", "clock.sleep(seconds)"),
        ("imported_sleep", "nap(2)"),
        ("fresh_events", "threading.Event().wait(1)"),
        ("fresh_events", "Event().wait(timeout=3.0)"),
    ]
