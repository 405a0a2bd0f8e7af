"""The ports the runner and its parts depend on, and what the wiring hands the runner and gets back.

Owns: every Protocol between the runner's parts and the adapters that satisfy them structurally
(``ConductorClient``, ``LeaseEngine``, ``Supervisor``, ``StatePublisher``), so that tests drive each
part with small fakes: the server calls (``ConductorPort`` for the runner, and the one-call views of
it a part needs: ``PollPort``, ``UpdatePort``, ``LogPort``, ``LeasePort`` for the lease engine), the
engine (``EnginePort``, and ``FinalUpdateGuard``, the three calls a final update makes), the process
layer (``SupervisorPort``, ``ChildPort``; the values that cross them are the process layer's own
``CommandSpec`` and ``ChildExit``), the status file (``StatusPort``); and the runner's input
and output values (``TaskTypePlan``, ``RunOptions``, ``RunOutcome``). The events are ``runner.loop.events``.

Must not: hold behaviour or import an adapter at run time (pure: the layering test lists it).
Threads: none of its own; a port's threads are its implementation's (each Protocol says who calls).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from leasecore.lease import FenceReason, LeasePolicy, LeaseView
from leasecore.lease.finalcheck import LateBeats
from leasecore.masking import Masker
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.snapshot import ServerHealth, TaskSnapshot

if TYPE_CHECKING:  # values only: the process layer is an adapter, never imported here at run time
    from leasecore.process.spec import ChildExit, CommandSpec

__all__ = [
    "ChainPort",
    "ChildPort",
    "ConductorPort",
    "EnginePort",
    "FinalUpdateGuard",
    "LeasePort",
    "LiveChange",
    "LogPort",
    "PollPort",
    "PollSettings",
    "RunOptions",
    "RunOutcome",
    "StatusPort",
    "SupervisorPort",
    "TaskTypePlan",
    "TimedChainPort",
    "UpdatePort",
]

# ---------------------------------------------------------------- the server's calls


class PollPort(Protocol):
    """The one call a poller needs; ``ConductorClient`` satisfies it."""

    def poll(
        self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[Task]: ...


class UpdatePort(Protocol):
    """The one call the reporter needs; ``ConductorClient`` satisfies it."""

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None: ...


@runtime_checkable
class ChainPort(UpdatePort, Protocol):
    """An update port that can also claim the next task with the update (``ConductorClient.update_v2``,
    ``leasecore.runner.chain``); a port without it never chains."""

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None: ...


class TimedChainPort(ChainPort, Protocol):
    """A chain port that also says when its update-v2 request went out (``ChainUpdates``: after the
    wait for a heartbeat in flight), so that a claimed task's lease counts from the send, not from
    before that wait."""

    def update_v2_timed(self, result: TaskResult, *, timeout_seconds: float | None = None
                        ) -> tuple[Task | None, float]: ...


class LogPort(Protocol):
    """The one call the log streamer needs; ``ConductorClient`` satisfies it."""

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None: ...


class ConductorPort(PollPort, UpdatePort, LogPort, Protocol):
    """What the runner needs from ``ConductorClient``: poll, update and append_log."""


class LeasePort(Protocol):
    """The two server calls the lease engine makes (raising only ``leasecore.errors`` types)."""

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        """POST /api/tasks with extendLease; ``ConductorNotFound`` when the task is gone."""
        ...

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        """GET /api/tasks/{id}: the task's status, pollCount and workerId; None for a 404."""
        ...


# ---------------------------------------------------------------- the lease engine


class FinalUpdateGuard(Protocol):
    """The engine calls ``FinalUpdates`` makes (``LeaseEngine`` and the runner's ``EnginePort``)."""

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool: ...
    def late_beats(self, task_id: str) -> LateBeats | None: ...
    def final_update_failed(self, task_id: str) -> None: ...
    def reported(self, task_id: str) -> None: ...


@runtime_checkable
class TaskReader(Protocol):
    """Reads a task back (``ConductorClient``): a final update's read-back after a late heartbeat."""

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None: ...


class EnginePort(Protocol):
    """What the runner needs from ``LeaseEngine`` (ARCHITECTURE.md, "The cores and their drivers":
    lease engine)."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def track(self, task: Task, policy: LeasePolicy, *, polled_at: float | None = None) -> None: ...
    def start_held(self, task_id: str) -> None: ...
    def child_started(self, task_id: str) -> None: ...
    def child_exited(self, task_id: str) -> FenceReason | None: ...  # its fence_reason right after
    def reported(self, task_id: str, *, poll_count: int | None = None) -> None: ...
    # The final update's guard (``finalupdates.FinalUpdates``, which the runner wraps around every update).
    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool: ...
    def late_beats(self, task_id: str) -> LateBeats | None: ...
    def final_update_failed(self, task_id: str) -> None: ...
    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None: ...
    def fence_reason(self, task_id: str) -> FenceReason | None: ...
    def view(self, task_id: str) -> LeaseView: ...
    # (fence reason, lease deadline, hard deadline) in one look; None: not tracked
    def lease_times(self, task_id: str) -> tuple[FenceReason | None, float | None, float | None] | None: ...


# ---------------------------------------------------------------- the process layer and the status file


class ChildPort(Protocol):
    """A task tree (``leasecore.process`` child handle), started or being started. Its exit reaches
    the runner through ``SupervisorPort.start(on_done=...)``; ``wait`` is for callers that have a
    thread to block. ``pid`` is 0 until the command runs. ``ended_by_switch``: the fork server's
    dead-man's switch ended the tree before the runner fenced it (the runner was stalled), and
    ``switch_late_seconds`` how late after its point it acted; both are set before ``on_done``."""

    ended_by_switch: bool
    switch_late_seconds: float | None

    @property
    def pid(self) -> int: ...

    @property
    def checkpoint_path(self) -> str:
        """The child's CONDUCTOR_CHECKPOINT_FILE ("": none)."""
        ...

    def memory_bytes(self) -> int | None: ...  # the tree's memory now; None when it cannot tell
    def wait(self, timeout: float | None) -> ChildExit | None: ...
    def wait_gone(self, timeout: float | None = None) -> bool: ...  # every process of the tree reaped
    def terminate_tree(self, grace_seconds: float | None = None, *, since: float | None = None) -> None: ...
    def kill_tree(self) -> None: ...


class SupervisorPort(Protocol):
    """What the runner needs from ``Supervisor``: ``start`` returns without waiting for the exec; a
    command that never runs ends as ``on_done(exit)`` with ``exit.start_error`` set."""

    def start(
        self, task: Task, spec: CommandSpec, *, worker_id: str,
        on_lines: Callable[[str, list[str]], None] | None = None,
        on_done: Callable[[ChildExit], None] | None = None,
        on_started: Callable[[ChildPort], None] | None = None,
        deadline: float | None = None,  # the child's CONDUCTOR_DEADLINE (epoch seconds)
    ) -> ChildPort: ...


class StatusPort(Protocol):
    """Where status snapshots go (``StatePublisher``); the runner calls it on its main thread."""

    def publish(self, tasks: Sequence[TaskSnapshot], *, server: ServerHealth, paused: Sequence[str] = (),
                stopping: bool = False) -> bool: ...
    def remove(self) -> None: ...


# ---------------------------------------------------------------- plan and outcome


@dataclass(frozen=True, eq=False)
class PollSettings:
    """What one task type's poller asks for: the type, slots, long-poll time, identity, pacing."""

    task_type: str
    concurrency: int = 1
    timeout_ms: int = 1000
    worker_id: str | None = None
    domain: str | None = None
    paused: bool = False
    interval_seconds: float = 0.1  # pause after an empty poll (doubling while polls stay empty)
    # Tasks claimed but not yet taken up by the runner (spawned, handed back...): a poll never claims
    # beyond this, so with a large concurrency the claims follow the spawns instead of running ahead
    # of them (1000 claimed at once took seconds to start, all under lease, starving the heartbeats).
    max_unstarted: int = 32


@dataclass(frozen=True, eq=False)
class TaskTypePlan:
    """Everything the runner needs to serve one task type, already resolved from the configuration."""

    poll: PollSettings
    spec: CommandSpec
    worker_id: str
    make_policy: Callable[[Task], LeasePolicy]
    kill_grace_seconds: float = 10.0
    # Secrets (docs/secrets.md): the values every task of the type masks (credentials, the values of
    # the variables kept from the child), and runtime metadata names this worker requires.
    masker: Masker = field(default_factory=lambda: Masker.of(()))
    required_metadata: tuple[str, ...] = ()


@dataclass(frozen=True, eq=False)
class RunOptions:
    """How the run ends and how long its final updates are retried (the run's flags)."""

    once: bool = False
    max_tasks: int | None = None
    drain: bool = False
    drain_timeout_seconds: float = 300.0
    once_wait_seconds: float = 30.0  # --once: how long to wait for a task before giving up (--once-wait)
    report_retry_seconds: float = 60.0  # retry a final update this long (heartbeats go on meanwhile)
    shutdown_report_retry_seconds: float = 10.0  # ... but no longer than this once stopping
    status_interval_seconds: float = 1.0
    status_min_interval_seconds: float = 0.2  # status snapshots are built at most this often
    update_v2: bool = True  # final updates may claim the next task when the port has update_v2


@dataclass(frozen=True, eq=False)
class LiveChange:
    """What a reload hands the runner: every task type's plan built again from the reloaded
    configuration (used by the tasks started from now on; running ones keep theirs), the new
    options, the task types whose configured ``paused`` changed (the configuration wins over a
    live pause or resume only then), and one line per changed value (logged, and the answer)."""

    plans: tuple[TaskTypePlan, ...]
    options: RunOptions
    paused: tuple[tuple[str, bool], ...] = ()
    changes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunOutcome:
    """How the run ended; ``cli.run`` turns it into an exit code."""

    signum: int | None = None  # the signal that stopped the run, if one did
    started: int = 0
    statuses: tuple[TaskStatus | None, ...] = field(default=())  # per started task; None: not reported
    # Started tasks whose status is no longer in ``statuses`` (the newest are kept) and that ended
    # other than COMPLETED or IN_PROGRESS: a long run's outcome stays exact with bounded memory.
    folded_not_completed: int = 0
    poller_failed: bool = False  # a poller ended on an unexpected error: exit 1, not a clean stop
    forced: bool = False  # a second signal ended the running tasks instead of letting them finish
    # The server refused a poller's first polls (a ConductorAuthError): the worker raises it, exit 4.
    refused: Exception | None = field(default=None, compare=False)

    @property
    def all_completed(self) -> bool:
        ok = (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS)
        return (bool(self.statuses) and self.folded_not_completed == 0
                and all(s in ok for s in self.statuses))


@dataclass(frozen=True, eq=False)
class EngineMetrics:
    """How the engine keeps up; ``queued`` > 0 for long means the sender pool is saturated."""

    tracked: int
    senders: int
    busy_senders: int
    queued: int
    oldest_queued_seconds: float
    saturated_waits: int  # requests that had to queue with every sender busy and the pool at max
    heartbeats_sent: int
    heartbeat_lateness_p99_seconds: float  # from due time to the port call, recent beats
    heartbeat_lateness_max_seconds: float
