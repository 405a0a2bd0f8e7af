"""A held run whose hold is over, in the simulation: the product's ``decisions.held_start`` (read the
task back, start it only while it is still ours) carried out by the simulated runner.

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from leasecore.handover import StartGate
from leasecore.lease import Lease
from leasecore.models import TaskOwnership, TaskStatus
from leasecore.runner.leasing import core as ec
from leasecore.runner.loop import decisions as d
from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.setting import Run
from leasecore.sim.world import World


class HeldRunner(Protocol):
    """What ``held_step`` uses of its runner (``leasecore.sim.runner.SimRunner``)."""

    world: World
    server: SimConductor
    name: str
    gate: StartGate
    runs: dict[str, Run]
    held_reads: dict[str, tuple[d.Read, TaskOwnership | None]]

    def reply(self, fn: Callable[[Answer], None]) -> Callable[[Answer], None]: ...
    def step(self, event: ec.Event) -> None: ...
    def forget(self, run: Run) -> None: ...
    def start(self, run: Run) -> None: ...
    def arm_gate(self) -> None: ...


def lease_now(lease: Lease, now: float) -> d.LeaseNow:
    """The lease as admission sees it: fenced, past its TERM point, or live."""
    if lease.fence_reason is not None:
        return d.LeaseNow.FENCED
    return d.LeaseNow.PAST_TERM if now >= lease.term_point else d.LeaseNow.LIVE


def held_step(r: HeldRunner, run: Run) -> None:
    """One step of a held run whose hold is over (again after each answer of its read-back)."""
    tid, now = run.task.task_id, r.world.now
    read, ownership = r.held_reads.pop(tid, (d.Read.NOT_SENT, None))
    step, why = d.held_start(d.HeldView(run.task.poll_count, lease_now(run.lease, now), read, ownership))
    if step is d.HeldStart.READ_BACK:
        r.held_reads[tid] = (d.Read.IN_FLIGHT, None)

        def got(answer: Answer) -> None:
            if r.runs.get(tid) is run and run.phase == "held":
                own = TaskOwnership(TaskStatus(answer.body[0]), answer.body[1]) if answer.ok else None
                ok = answer.ok or answer.status == 404
                r.held_reads[tid] = (d.Read.ANSWERED, own) if ok else (d.Read.FAILED, None)
                held_step(r, run)

        r.server.read(r.name, tid, r.reply(got), run.policy.http_timeout_seconds)
    elif step is d.HeldStart.READ_AGAIN:
        r.gate.hold(run.task, now + d.READ_AGAIN_SECONDS, now)
        r.arm_gate()
    elif step is d.HeldStart.NOT_OURS:
        r.world.log(f"runner {r.name}: {tid} is no longer ours once held ({why}): not started")
        run.phase = "exited"
        r.step(ec.ChildExited(tid))
        r.forget(run)
    elif step is d.HeldStart.START:
        r.start(run)
    # WAIT: its lease's fence ends it (a read-back is never in flight here: the gate released it)
