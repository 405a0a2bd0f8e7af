"""A task held before its start ('waiting' for a previous holder) occupies its slot in the gauges, shows in
conductor_run_tasks_waiting, and a fence while it waits counts in conductor_run_fences_total."""

from __future__ import annotations

from leasecore.clock import FakeClock
from leasecore.config.loader import parse_toml, resolve
from leasecore.lease import FenceReason
from leasecore.metrics.service import MetricsService
from tests.adapters.test_metrics_endpoint import (
    FakeContact,
    FakeEngine,
    FakeOutbox,
    FakeRunner,
    FakeSupervisor,
    value,
)


def test_a_held_task_takes_its_slot_and_its_fence_is_counted() -> None:
    text = '[worker]\nmetrics_port = 0\n[[task]]\ntype = "demo"\ncommand = ["true"]\nconcurrency = 3\n'
    config = resolve(parse_toml(text, "conductor.toml"), {}, {}, cwd="/work", hostname="h")
    service = MetricsService(config, clock=FakeClock())
    service.attach(runner=FakeRunner(), engine=FakeEngine(), supervisor=FakeSupervisor(),
                   contact=FakeContact(), outbox=FakeOutbox())  # fmt: skip
    obs = service.observer
    obs.on_task_started("demo")
    obs.on_task_held("demo", True)
    obs.on_task_held("demo", True)
    assert value(obs, "conductor_run_tasks_waiting", taskType="demo") == 2
    assert value(obs, "conductor_run_slots_free", taskType="demo") == 0  # 3 - 1 running - 2 waiting
    obs.on_task_held("demo", False)  # started
    obs.on_task_held("demo", False, FenceReason.OWNERSHIP_LOST)  # fenced before it started
    assert value(obs, "conductor_run_tasks_waiting", taskType="demo") == 0
    assert value(obs, "conductor_run_slots_free", taskType="demo") == 2
    assert value(obs, "conductor_run_fences_total", taskType="demo", reason="ownership_lost") == 1
