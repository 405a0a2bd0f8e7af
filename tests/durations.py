"""``slow`` by measurement: a pytest plugin that marks the tests ``tests/durations.json`` says are slow.

The file holds every test that took ``SLOW_SECONDS`` or more (setup, call and teardown added up) when
it was last measured. At collection this plugin adds the ``slow`` mark to those tests, before ``-m``
deselects anything, so ``./scripts/test --fast`` (``-m "not slow and not real_server"``) leaves them
out without a hand-written mark that goes stale when a test gets faster or slower.

Refresh it after adding or speeding up tests (the file is checked in; a refresh is a normal diff)::

    .venv/bin/python -m pytest --record-durations            # the whole suite
    .venv/bin/python -m pytest --record-durations tests/cli  # only what ran is updated

A test that passed is written (or dropped, when it is now under the threshold); a test that failed or
was skipped keeps its old entry; entries of test files that no longer exist are dropped. Every run
ends with a short list of the tests that took over ``STALE_FACTOR`` times the threshold but are not
marked slow: the hint that the file needs a refresh.

Owns ``tests/durations.json`` and the ``slow`` marks it implies. Runs in pytest's main thread only.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).with_name("durations.json")
SLOW_SECONDS = 0.5
STALE_FACTOR = 3.0  # an unmarked test this many times over the threshold is worth a line at the end


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("durations file")
    group.addoption(
        "--record-durations", action="store_true",
        help="rewrite the durations file from this run's measured times (tests that ran and passed)",
    )
    group.addoption(
        "--durations-file", default=str(DATA), metavar="PATH",
        help="the measured durations that mark tests slow (default: tests/durations.json)",
    )


def load(path: Path) -> dict[str, float]:
    """The measured tests of ``path`` ({} when the file does not exist yet)."""
    if not path.exists():
        return {}
    document = json.loads(path.read_text(encoding="utf-8"))
    return {str(node): float(seconds) for node, seconds in document["tests"].items()}


def merged(
    old: dict[str, float], measured: dict[str, float], passed: set[str], root: Path
) -> dict[str, float]:
    """``old`` updated with this run: passed tests rewritten (kept only if slow), gone files dropped."""
    result = {node: seconds for node, seconds in old.items() if (root / node.split("::", 1)[0]).exists()}
    for node in passed:
        result.pop(node, None)
        if measured[node] >= SLOW_SECONDS:
            result[node] = round(measured[node], 1)
    return dict(sorted(result.items()))


def dump(path: Path, tests: dict[str, float]) -> None:
    document: dict[str, Any] = {
        "about": (
            f"tests that took {SLOW_SECONDS:g} s or more when last measured: tests/durations.py marks "
            "them slow. Refresh: .venv/bin/python -m pytest --record-durations [PATHS]"
        ),
        "slow_seconds": SLOW_SECONDS,
        "tests": tests,
    }
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")


class _Durations:
    def __init__(self, config: pytest.Config) -> None:
        self.path = Path(config.getoption("--durations-file"))
        self.record = bool(config.getoption("--record-durations"))
        self.root = config.rootpath
        self.known = load(self.path)
        self.seconds: dict[str, float] = defaultdict(float)
        self.passed: set[str] = set()
        self.spoiled: set[str] = set()  # failed or skipped in some phase: its time says nothing
        self.marked: set[str] = set()

    @pytest.hookimpl(tryfirst=True)  # before the mark plugin deselects with -m
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if self.known.get(item.nodeid, 0.0) >= SLOW_SECONDS:
                item.add_marker(pytest.mark.slow)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # Under pytest-xdist the workers collect and mark; the reports reach the controller here,
        # their keywords (marks included) with them.
        node = report.nodeid
        self.seconds[node] += report.duration
        if "slow" in report.keywords:
            self.marked.add(node)
        if report.failed or report.skipped:
            self.spoiled.add(node)
        elif report.when == "call":
            self.passed.add(node)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.record and not hasattr(session.config, "workerinput"):  # the controller writes
            passed = self.passed - self.spoiled
            dump(self.path, merged(self.known, dict(self.seconds), passed, self.root))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        stale = sorted(
            ((s, n) for n, s in self.seconds.items()
             if n in self.passed and n not in self.marked and s >= STALE_FACTOR * SLOW_SECONDS),
            reverse=True,
        )
        if self.record:
            terminalreporter.write_line(f"durations: wrote {self.path}")
        if stale:
            over = f"{len(stale)} tests over {STALE_FACTOR * SLOW_SECONDS:g} s not marked slow"
            terminalreporter.write_sep("-", over)
            for seconds, node in stale[:10]:
                terminalreporter.write_line(f"{seconds:6.1f} s  {node}")
            terminalreporter.write_line("refresh: .venv/bin/python -m pytest --record-durations [PATHS]")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Durations(config), "tests-durations")
