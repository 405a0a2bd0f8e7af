"""The embedded server's store is composed, not inherited: its due schedule on its own, and the shape.

The schedule is a plain data structure (no lock, no clock, no thread): driven here with store times
directly. The shape test walks the server package's classes with ``ast`` so that a part can only be
handed in, never become a base of another part.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from leasecore.clock import FakeClock
from leasecore.server.records import WorkflowRecord
from leasecore.server.store import Store
from leasecore.server.timers import DueSchedule, coarse_tick, next_check

SERVER = Path(__file__).resolve().parents[2] / "leasecore" / "server"


def _workflow(wf_id: str, *, timeout_seconds: int, created: float = 0.0) -> WorkflowRecord:
    definition = {"name": "wf", "version": 1, "tasks": [], "timeoutSeconds": timeout_seconds,
                  "timeoutPolicy": "TIME_OUT_WF"}  # fmt: skip
    return WorkflowRecord(workflow_id=wf_id, name="wf", version=1, definition=definition, input={},
                          correlation_id=None, task_to_domain={}, priority=0,
                          create_time=created)  # fmt: skip


class Wakes:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def test_the_schedule_keeps_one_live_time_per_workflow_and_hands_them_out_in_order() -> None:
    wakes = Wakes()
    schedule = DueSchedule("ideal", 0.0, wakes)
    a, b = _workflow("a", timeout_seconds=30), _workflow("b", timeout_seconds=10)
    schedule.reschedule(a)
    schedule.reschedule(b)
    assert wakes.count == 2  # each one was the earliest when it came
    a.create_time = -25.0  # a's time moves to 5: the old entry at 30 must never come out
    schedule.reschedule(a)
    assert schedule.earliest() == 5.0 and wakes.count == 3
    assert schedule.pop_due(4.9) is None
    assert [schedule.pop_due(100.0) for _ in range(3)] == ["a", "b", None]
    assert schedule.earliest() is None


def test_a_later_time_does_not_wake_the_timer_and_a_forgotten_workflow_never_comes_out() -> None:
    wakes = Wakes()
    schedule = DueSchedule("ideal", 0.0, wakes)
    schedule.reschedule(_workflow("a", timeout_seconds=10))
    schedule.reschedule(_workflow("b", timeout_seconds=20))
    assert wakes.count == 1
    schedule.forget("a")
    assert schedule.pop_due(50.0) == "b" and schedule.pop_due(50.0) is None


def test_a_finished_workflow_leaves_the_schedule() -> None:
    schedule = DueSchedule("ideal", 0.0, Wakes())
    wf = _workflow("a", timeout_seconds=10)
    schedule.reschedule(wf)
    wf.status = "COMPLETED"
    assert next_check(wf) is None
    schedule.reschedule(wf)
    assert schedule.earliest() is None


@pytest.mark.parametrize(
    ("requested", "expected"),
    [(0.0, 120.0), (10.0, 120.0), (59.9, 120.0), (60.0, 180.0), (61.0, 180.0)],
)
def test_coarse_ticks_land_more_than_60_s_after_the_request(requested: float, expected: float) -> None:
    origin = 1000.0
    assert coarse_tick(origin + requested, origin) == origin + expected
    assert 60.0 < coarse_tick(origin + requested, origin) - (origin + requested) <= 120.0


def test_coarse_mode_moves_only_the_checks_after_a_workflows_first_timer_driven_one() -> None:
    schedule = DueSchedule("coarse", 0.0, Wakes())
    wf = _workflow("a", timeout_seconds=10)
    schedule.reschedule(wf)
    assert schedule.earliest() == 10.0  # the first one is on time
    wf.timer_fired = True
    schedule.reschedule(wf)
    assert schedule.earliest() == 120.0


def test_the_store_exposes_its_facts_and_the_environment_it_reads() -> None:
    clock = FakeClock()
    store = Store(clock=clock, sweep_mode="coarse", max_finished_workflows=7, max_logs_per_task=3)
    assert (store.clock, store.sweep_mode, store.max_finished_workflows, store.max_logs_per_task) == (
        clock, "coarse", 7, 3)  # fmt: skip
    assert store.runtime_environ is None and store.evicted_workflows == 0
    store.runtime_environ = {"CONDUCTOR_ENV_REGION": "eu-1"}
    store.register_workflow_def({"name": "wf", "version": 1, "schemaVersion": 2, "tasks": [
        {"name": "t", "taskReferenceName": "t", "type": "SIMPLE", "inputParameters": {
            "region": "${workflow.env.REGION}"}}]})  # fmt: skip
    wf_id = store.start_workflow("wf", {})
    (task,) = store.poll("t", timeout_ms=0)
    assert task["inputData"] == {"region": "eu-1"}
    assert store.count_terminal([task["taskId"], "unknown"]) == 0
    store.terminate_workflow(wf_id, "enough")
    assert store.count_terminal([task["taskId"], "unknown"]) == 1


def _server_classes() -> dict[str, tuple[str, list[str]]]:
    """Every class of the server package: name -> (module, the names of its bases)."""
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(SERVER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else ast.unparse(b) for b in node.bases]
                found[node.name] = (path.name, bases)
    return found


def test_no_class_of_the_server_is_built_on_another_of_its_classes() -> None:
    classes = _server_classes()
    assert {"Store", "StoreState", "Decider", "DueSchedule", "TaskCalls"} <= set(classes)  # the walk saw them
    inherited = {name: bases for name, (_, bases) in classes.items() if set(bases) & set(classes)}
    assert inherited == {}
