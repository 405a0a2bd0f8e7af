"""A stalled runner's result of its lost lease, driven by the simulator: the task was re-queued and
polled by another holder while the runner was stalled; when it runs again its FAILED "lease expired"
is read back first (``decisions.report_check``, ``finalfailure.lost_lease_read``) and dropped, so it
never ends the other holder's delivery (an update carries no pollCount). The world, server and trees
are simulated; the decisions are the product's."""

from __future__ import annotations

from leasecore.sim.conductor import SimConductor
from leasecore.sim.runner import SimRunner
from leasecore.sim.setting import Bugs, RunnerConfig, TreeProfile
from leasecore.sim.trees import Copies
from leasecore.sim.world import World

R = 30


def test_a_stalled_holders_failed_never_lands_on_the_delivery_polled_meanwhile() -> None:
    world = World(11, keep_trace=True)
    server = SimConductor(world)
    store = server.store
    store.register_task_defs([{"name": "sim", "responseTimeoutSeconds": R, "retryCount": 1,
                               "retryDelaySeconds": 0, "timeoutSeconds": 0}])
    store.register_workflow_def({"name": "simwf", "version": 1, "tasks": [
        {"name": "sim", "taskReferenceName": "t0", "type": "SIMPLE"}]})
    workflow_id = store.start_workflow("simwf", {})
    server.arm_timer()
    copies = Copies(world)
    profile = TreeProfile(mean_seconds=10_000.0, fail=0.0, yields=0.0, ignore_term=0.0, escapee=0.0)
    a = SimRunner(world, server, copies, "a", RunnerConfig(slots=1, kill_grace=2.0, check_interval=5.0),
                  profile, Bugs())  # fmt: skip
    world.run_until(world.now + 1.0)
    (task_id,) = a.runs
    a.stall(3 * R)  # its lease runs out meanwhile (its tree is fenced when it runs again)

    def other_holder() -> None:  # the queue hands the task out again; the test polls it
        assert server.requeue(task_id)
        (task,) = store.poll("sim", count=1, timeout_ms=0, worker_id="other")
        assert task["pollCount"] == 2
        keep()

    def keep() -> None:  # the other holder's heartbeats
        store.update_task({"taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS",
                           "extendLease": True, "workerId": "other"})
        world.after(R / 3, "other beats", keep)

    world.after(2.0, "other holder", other_holder)
    world.run_until(world.now + 3 * R + 30.0)
    trace = "\n".join(world.lines)
    record = server.record(task_id)
    assert record is not None
    assert (record.status, record.poll_count, record.worker_id) == ("IN_PROGRESS", 2, "other"), trace[-3000:]
    assert "lease over, not reported: the task was polled again" in trace, trace[-3000:]
    assert len(store.get_workflow(workflow_id)["tasks"]) == 1  # no retry next to the other holder's copy
    assert task_id not in a.runs and not world.violations
