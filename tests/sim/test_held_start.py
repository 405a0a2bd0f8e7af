"""The held start's read-back, driven by the simulator: a re-delivery held on one runner while its
previous holder's late FAILED lands on it just before the hold ends (after the held lease's last
ownership check) is never started; the same hold with nothing landing starts once. The decisions are
the product's (``leasecore.runner.loop.decisions``); the world, server and trees are simulated."""

from __future__ import annotations

from collections.abc import Callable

from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.runner import SimRunner
from leasecore.sim.setting import Bugs, RunnerConfig, TreeProfile
from leasecore.sim.trees import Copies
from leasecore.sim.world import World


def _setup() -> tuple[World, SimConductor, Copies, str, str]:
    world = World(7, keep_trace=True)
    server = SimConductor(world)
    store = server.store
    store.register_task_defs([{"name": "sim", "responseTimeoutSeconds": 30, "retryCount": 1,
                               "retryDelaySeconds": 0, "timeoutSeconds": 0}])
    store.register_workflow_def({"name": "simwf", "version": 1, "tasks": [
        {"name": "sim", "taskReferenceName": "t0", "type": "SIMPLE"}]})
    store.start_workflow("simwf", {})
    server.arm_timer()
    # An earlier holder ("gone", not simulated: its copy is assumed fenced by the hold) polled it, then
    # the queue handed it out again: the next poll is pollCount 2, a re-delivery that must wait.
    (task,) = store.poll("sim", count=1, timeout_ms=0, worker_id="gone")
    task_id = str(task["taskId"])
    assert server.requeue(task_id)
    return world, server, Copies(world), task_id, str(task["workflowInstanceId"])


def _runner(world: World, server: SimConductor, copies: Copies) -> SimRunner:
    config = RunnerConfig(slots=1, kill_grace=2.0, check_interval=5.0)
    profile = TreeProfile(mean_seconds=5.0, fail=0.0, yields=0.0, ignore_term=0.0, escapee=0.0)
    return SimRunner(world, server, copies, "b", config, profile, Bugs())


def test_a_late_failed_landing_just_before_the_hold_ends_stops_the_start() -> None:
    world, server, copies, task_id, workflow_id = _setup()
    runner = _runner(world, server, copies)
    world.run_until(world.now + 1.0)  # b polls it and holds it
    start_at = runner.gate.start_at(task_id)
    assert start_at is not None and start_at - world.now > 5.0, "the re-delivery was not held"

    def late_failed() -> None:  # the previous holder's FAILED of its lost lease, landing late
        server.store.update_task({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "FAILED",
                                  "workerId": "gone",
                                  "reasonForIncompletion": "lease expired"})

    world.at(start_at - 0.05, "late FAILED", late_failed)
    world.run_until(start_at + 20.0)
    trace = "\n".join(world.lines)
    assert "no longer ours once held" in trace, trace[-3000:]
    labels = [c.label for cs in copies.by_key.values() for c in cs]
    assert not [x for x in labels if x.startswith(f"b/{task_id}/")], labels  # never a copy of a task over
    assert labels, "the retry the server created was not run"  # (the FAILED's retry, a new task id)
    assert task_id not in runner.runs and not world.violations


def test_a_held_redelivery_still_ours_starts_once_read_back() -> None:
    world, server, copies, task_id, _ = _setup()
    runner = _runner(world, server, copies)
    world.run_until(world.now + 1.0)
    start_at = runner.gate.start_at(task_id)
    assert start_at is not None
    reads: list[float] = []
    read = server.read

    def counted(name: str, tid: str, reply: Callable[[Answer], None], timeout: float) -> None:
        reads.append(world.now)
        read(name, tid, reply, timeout)

    server.read = counted  # type: ignore[method-assign]
    world.run_until(start_at + 1.0)
    labels = [c.label for cs in copies.by_key.values() for c in cs]
    assert labels == [f"b/{task_id}/p2"] and not world.violations
    assert any(t >= start_at for t in reads)  # read back once the hold was over, then started
