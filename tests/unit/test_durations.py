"""``tests/durations.py``: measured durations mark tests ``slow``, ``-m "not slow"`` leaves them out,
``--record-durations`` rewrites the file from what passed. Run in an inner pytest (``pytester``) on a
throwaway suite with its own durations file, so the real tests/durations.json is never touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REAL_SERVER_MODULES, schedule_scope
from tests.durations import DATA, SLOW_SECONDS, load, merged

pytest_plugins = ["pytester"]

SUITE = """
import time
import pytest

def test_quick():
    pass

def test_was_slow():
    pass

def test_takes_a_while():
    time.sleep(0.2)

def test_fails():
    assert False

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
"""


def _write(path: Path, tests: dict[str, float]) -> None:
    path.write_text(json.dumps({"slow_seconds": SLOW_SECONDS, "tests": tests}), encoding="utf-8")


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the inner runs load tests.durations only
    pytester.makepyfile(test_inner=SUITE)
    durations = pytester.path / "durations.json"
    _write(durations, {
        "test_inner.py::test_was_slow": 5.0,
        "test_inner.py::test_fails": 7.0,
        "test_inner.py::test_skipped": 9.0,
        "test_inner.py::test_quick": 0.2,  # under the threshold: not slow
        "gone.py::test_old": 3.0,
    })
    return durations


def _run(pytester: pytest.Pytester, durations: Path, *args: str) -> pytest.RunResult:
    return pytester.runpytest_inprocess(
        "-p", "tests.durations", "--durations-file", str(durations), "-o", "addopts=",
        "-o", "markers=slow: measured", *args,
    )


def test_measured_tests_are_marked_slow_before_m_deselects(pytester: pytest.Pytester, suite: Path) -> None:
    result = _run(pytester, suite, "-m", "not slow", "-q")
    result.assert_outcomes(passed=2)  # test_quick and test_takes_a_while; the three measured ones are out
    assert "3 deselected" in result.stdout.str()


def test_recording_rewrites_what_passed_keeps_what_failed_and_names_the_unmarked(
    pytester: pytest.Pytester, suite: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tests.durations.SLOW_SECONDS", 0.05)  # test_takes_a_while (0.2 s) is now slow
    result = _run(pytester, suite, "--record-durations", "-q")
    recorded = load(suite)
    assert set(recorded) == {
        "test_inner.py::test_takes_a_while",  # measured now: slow
        "test_inner.py::test_fails",  # failed: its old entry stays
        "test_inner.py::test_skipped",  # skipped: likewise
    }  # test_was_slow and test_quick passed quickly: dropped; gone.py no longer exists: dropped
    assert 0.2 <= recorded["test_inner.py::test_takes_a_while"] < 5
    assert recorded["test_inner.py::test_fails"] == 7.0
    # It was not marked slow when the run began and took over 3 x the threshold: the summary says so.
    summary = result.stdout.str()
    assert "1 tests over 0.15 s not marked slow" in summary and "test_inner.py::test_takes_a_while" in summary


def test_merge_is_pure_and_rounds(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("")
    old = {"a.py::t1": 4.0, "a.py::t2": 2.0, "b.py::t": 9.0}
    measured = {"a.py::t1": 0.1, "a.py::t3": 1.234}
    assert merged(old, measured, {"a.py::t1", "a.py::t3"}, tmp_path) == {"a.py::t2": 2.0, "a.py::t3": 1.2}


def test_the_checked_in_file_names_only_tests_that_exist_and_are_slow() -> None:
    root = DATA.parents[1]
    tests = load(DATA)
    assert tests, "tests/durations.json lists no test: the fast lane would run everything"
    missing = sorted({node.split("::", 1)[0] for node in tests} - {
        p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py")
    })
    assert not missing, f"tests/durations.json names files that do not exist: {missing}"
    assert min(tests.values()) >= SLOW_SECONDS


def test_xdist_runs_a_module_at_a_time_and_every_real_server_module_together() -> None:
    assert schedule_scope("tests/unit/test_x.py::test_y[a]") == "tests/unit/test_x.py"
    assert {schedule_scope(f"{module}::test_z[real]") for module in REAL_SERVER_MODULES} == {"real_server"}
