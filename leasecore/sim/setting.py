"""The values a simulated runner is made of: its settings, planted bugs, tree profile, runs, state dir.

Owns ``Bugs`` (races planted in the simulated drivers, and the product behaviours this simulator found
wanting, each a switch), ``RunnerConfig``, ``TreeProfile``, ``StateDir`` (what survives a crash),
``Run`` (one delivery on one runner) and ``RunnerPort`` (what ``leasecore.sim.reports`` needs of a
runner). Plain values; the behaviour is in ``leasecore.sim.runner`` and ``leasecore.sim.reports``.

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from leasecore.lease import FenceReason, Lease, LeasePolicy
from leasecore.models import Task, TaskResult
from leasecore.runner.leasing.core import EngineCore, Event
from leasecore.runner.leasing.leasebook import LeaseEntry
from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.trees import SimTree
from leasecore.sim.world import World

__all__ = ["Bugs", "Run", "RunnerConfig", "RunnerPort", "StateDir", "TreeProfile"]


@dataclass(frozen=True)
class Bugs:
    """Races planted in the simulated drivers (never in production code), each re-introducing a fixed bug."""

    term_at_deadline: bool = False  # TERM at the lease deadline, KILL a grace later (not deadline - G - M)
    no_redelivery_hold: bool = False  # a re-delivery starts at once, without waiting for its previous holder
    no_final_wait: bool = False  # a final update goes out while a heartbeat of unknown fate may still land
    yield_unheld: bool = False  # a yield is marked at the leader's exit, escapees alive or not
    held_reported_failed: bool = False  # a held re-delivery, fenced, is reported FAILED (not handed back)
    no_dying_wait: bool = False  # a retry starts here while the previous attempt's tree is still dying
    # What the product does today (a finding of this simulator, not fixed yet): a FAILED result goes
    # out at the leader's exit while its escapees are still being stopped, so the retry the server
    # creates at once may start on another host next to them. Off: it waits like a yield (YieldHold).
    failed_before_tree_gone: bool = False
    # What the product does today (a finding, not fixed yet): a yield whose update's answer was lost
    # is sent again even after its next run was polled, so the retry re-queues that run (one result
    # applied twice; the run is fenced as no longer ours). Off: a poll of the next run proves it landed.
    retry_landed_yield: bool = False
    # The client's transport sends an IN_PROGRESS update (a yield, a park) once more when its
    # connection is reset under it, as it did terminal ones: a yield that landed, sent again after its
    # next run was polled, re-queues that run. Off: only a terminal update is resent.
    resend_in_progress: bool = False
    # The operator's rules (leasecore.sim.claims): a pause never reaches the poller (polls go on), or a
    # drain lets a held delivery wait out its hold and start instead of handing it back.
    pause_ignored: bool = False
    drain_starts_held: bool = False


@dataclass(frozen=True)
class RunnerConfig:
    task_type: str = "sim"
    slots: int = 4
    kill_grace: float = 10.0
    check_interval: float = 5.0
    http_timeout: float = 5.0
    outbox_every: float = 20.0
    chaining: bool = True
    kill_by: bool = False  # the fork server enforces each tree's kill-by time on its own


@dataclass(frozen=True)
class TreeProfile:
    """How the trees of a seed behave (drawn per tree from the world's random)."""

    mean_seconds: float = 60.0
    fail: float = 0.1
    yields: float = 0.05
    ignore_term: float = 0.2
    die_within: float = 20.0  # an obeying tree dies within this after TERM (may exceed the grace)
    escapee: float = 0.1
    max_factor: float = 4.0  # a leader runs at most this many mean durations
    max_runs: int = 3  # a task yields only on its first deliveries (then completes or fails)
    short_of_fds: float = 0.0  # a start finds no fd for its pipes (EMFILE): nothing runs, it goes back


@dataclass
class StateDir:
    """What survives a runner's crash: the outbox of undelivered results (taskId -> result, pollCount)."""

    outbox: dict[str, tuple[TaskResult, int]] = field(default_factory=dict)


@dataclass
class Run:
    """One delivery of a task on this runner."""

    task: Task
    entry: LeaseEntry
    policy: LeasePolicy
    tree: SimTree | None = None
    phase: str = "held"  # held / running / exited / reporting / done
    fence: FenceReason | None = None
    slot: bool = True
    chain_slot: bool = False
    report_held: bool = False  # counted among the poller's reports waiting (PollCore.reporting_started)
    label: str = ""

    @property
    def lease(self) -> Lease:
        return self.entry.lease


class RunnerPort(Protocol):
    """What the final-update half of the glue uses of its runner."""

    world: World
    server: SimConductor
    name: str
    config: RunnerConfig
    bugs: Bugs
    state: StateDir
    engine: EngineCore
    runs: dict[str, Run]
    next_runs: dict[str, tuple[Task, float]]
    stopping: bool

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]: ...
    def reply(self, fn: Callable[[Answer], None]) -> Callable[[Answer], None]: ...
    def release(self, n: int = 1, *, poll: bool = True) -> None: ...
    def step(self, event: Event) -> None: ...
    def keep_for_chain(self) -> bool: ...
    def reporting_started(self) -> None: ...
    def chain_ended(self) -> None: ...
    def forget(self, run: Run) -> None: ...
    def deliver(self, task: Task, polled_at: float) -> None: ...
    def may_run_elsewhere(self, task: Task) -> bool: ...
