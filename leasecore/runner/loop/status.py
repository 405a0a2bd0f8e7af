"""The runner's per-task state and how it is shown: snapshots for ``StatePublisher``.

``InFlight`` is written only by the runner's main thread (``tail`` is the exception: it is a
thread-safe ``OutputTail`` fed by the child's reader threads). The functions here turn that state,
the lease engine's views and the pollers' health into the frozen snapshot values of
``leasecore.snapshot``, converting monotonic deadlines to wall-clock UTC.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import Enum
from typing import NamedTuple, Protocol

from leasecore.clock import Clock
from leasecore.lease import FenceReason, LeasePolicy, LeaseView
from leasecore.masking import Masker
from leasecore.models import Task, TaskOwnership, TaskStatus
from leasecore.process.checkpoint import CheckpointWatch, progress_of
from leasecore.runner.loop.decisions import Read
from leasecore.runner.ports import ChildPort, StatusPort, TaskTypePlan
from leasecore.runner.upstream.poller import Poller
from leasecore.runner.upstream.server_contact import ServerContact
from leasecore.snapshot import (
    OutputTail,
    RunnerInfo,
    RunnerSnapshot,
    ServerHealth,
    TaskSnapshot,
    TaskState,
    wall_time,
)


class NextRun(NamedTuple):
    """A delivery of a task that waits behind its run still here (its report, or its copy being
    killed for lost ownership): ``TaskStarts.admit``'s arguments, replayed once that run is forgotten."""

    task: Task
    polled_at: float
    policy: LeasePolicy | None  # tracked at poll time (its lease may end with the earlier run's)
    surplus: bool  # took no slot and no budget
    chained: bool


class Phase(Enum):
    WAITING = "waiting"  # polled, lease held; the command starts once a previous holder must have stopped
    RUNNING = "running"  # the child runs
    STOPPING = "stopping"  # its tree was told to stop (TERM or KILL)
    REPORTING = "reporting"  # the child is gone; the final update is on its way


@dataclass(eq=False)
class InFlight:
    """Main-thread state of one task, from its poll to its report."""

    task: Task
    plan: TaskTypePlan
    index: int  # position in the run's outcomes (start order)
    started_at: datetime
    policy: LeasePolicy | None = None
    child: ChildPort | None = None
    tracked: bool = False  # the lease engine knows this task
    phase: Phase = Phase.RUNNING
    slot_held: bool = True  # counts against the task type's concurrency
    report_held: bool = False  # its result is being reported: counts against the reports that may wait
    chain_slot: bool = False  # its update-v2 is in flight: its slot is kept for the task it claims
    fence: FenceReason | None = None  # why the tree was stopped, known once the child is dead
    ended_by_switch: bool = False  # the fork server's dead-man's switch ended it (the runner stalled)
    stalled_seconds: float | None = None  # its server deadline's fence came this late: the runner stalled
    result_status: TaskStatus | None = None  # what is being reported
    tail: OutputTail = field(default_factory=OutputTail)
    log_lines: Callable[[str, list[str]], None] | None = None  # its task-log stream, while open
    checkpoint: CheckpointWatch | None = None  # its CONDUCTOR_CHECKPOINT_FILE, once its child started
    masker: Masker | None = None  # its secret values (the type's and its runtime metadata's), once known
    read: Read = Read.NOT_SENT  # a held task's read-back before its start (decisions.held_start)
    ownership: TaskOwnership | None = None  # that read-back's answer (None: a 404, or none yet)


class _Views(Protocol):
    def view(self, task_id: str) -> LeaseView: ...


_STATES = {Phase.WAITING: TaskState.WAITING, Phase.RUNNING: TaskState.RUNNING,
           Phase.STOPPING: TaskState.TERMINATING, Phase.REPORTING: TaskState.REPORTING}


def task_snapshot(entry: InFlight, engine: _Views, clock: Clock) -> TaskSnapshot:
    """One task as ``conductor-run status`` shows it."""
    view: LeaseView | None = None
    if entry.tracked:
        try:
            view = engine.view(entry.task.task_id)
        except KeyError:  # the engine already forgot it (reported)
            view = None
    fence = entry.fence or (view.fence_reason if view else None)
    return TaskSnapshot(
        task_id=entry.task.task_id,
        workflow_id=entry.task.workflow_id,
        task_type=entry.task.task_type,
        state=_STATES[entry.phase],
        started_at=entry.started_at,
        child_pid=(entry.child.pid or None) if entry.child is not None else None,  # 0: starting
        last_ack_at=wall_time(view.last_ack_at, clock) if view else None,
        next_heartbeat_at=wall_time(view.next_heartbeat_at, clock) if view else None,
        lease_deadline_at=wall_time(view.lease_deadline, clock) if view else None,
        lease_timeout_seconds=entry.policy.lease_timeout_seconds if entry.policy else None,
        hard_deadline_at=wall_time(view.hard_deadline, clock) if view else None,
        consecutive_failures=view.consecutive_failures if view else 0,
        fence_reason=fence.value if fence is not None else None,
        fenced_by=_fenced_by(entry, fence),
        recent_output=entry.tail.lines(),
        memory_bytes=_memory_of(entry.child),
        progress=progress_of_entry(entry),
    )


def progress_of_entry(entry: InFlight) -> float | None:
    """The task's progress: its checkpoint file's as last seen, else the checkpoint it started from."""
    if entry.checkpoint is not None and entry.checkpoint.text is not None:
        return entry.checkpoint.progress
    return progress_of(entry.task.checkpoint)


def _memory_of(child: ChildPort | None) -> int | None:
    """The tree's memory now (``Child.memory_bytes``: its group, else the child's RSS); None for a
    child handle that cannot tell or one not running yet."""
    return child.memory_bytes() if child is not None and child.pid else None


def undelivered_snapshot(entry: InFlight) -> TaskSnapshot:
    """A task whose result waits in the outbox: no child, no lease left to keep."""
    fence = entry.fence
    return TaskSnapshot(
        task_id=entry.task.task_id,
        workflow_id=entry.task.workflow_id,
        task_type=entry.task.task_type,
        state=TaskState.UNDELIVERED,
        started_at=entry.started_at,
        fence_reason=fence.value if fence is not None else None,
        fenced_by=_fenced_by(entry, fence),
        recent_output=entry.tail.lines(),
    )


def _fenced_by(entry: InFlight, fence: FenceReason | None) -> str | None:
    if entry.ended_by_switch:
        return "switch"
    return None if fence is None else "runner"


def server_health(pollers: Iterable[Poller], contact: ServerContact, clock: Clock) -> ServerHealth:
    """The server as every call of the runner saw it (polls, heartbeats, ownership checks, log posts,
    updates: ``server_contact``): the newest answer, the failed calls since, and the pollers' current wait."""
    failing = contact.consecutive_failures
    return ServerHealth(
        last_ok_at=wall_time(contact.last_ok_at, clock),
        consecutive_failures=failing,
        backoff_seconds=max((p.backoff_seconds for p in pollers), default=0.0),
        last_error=contact.last_error if failing else None,
    )


class StatusTee:
    """A ``StatusPort`` that hands every snapshot to ``on_snapshot`` too (the CLI's live view).

    ``on_snapshot`` runs on the runner's main thread at every publish (at least once a second): it
    must be quick (store the value; render elsewhere).
    """

    def __init__(
        self, inner: StatusPort, runner: RunnerInfo, on_snapshot: Callable[[RunnerSnapshot], None],
        *, clock: Clock,
    ) -> None:
        self._inner = inner
        self._runner = runner
        self._on_snapshot = on_snapshot
        self._clock = clock

    def publish(self, tasks: Sequence[TaskSnapshot], *, server: ServerHealth, paused: Sequence[str] = (),
                stopping: bool = False) -> bool:
        self._on_snapshot(RunnerSnapshot(self._runner, server, tuple(tasks), updated_at=self._clock.now(),
                                         paused=tuple(paused), stopping=stopping))
        return self._inner.publish(tasks, server=server, paused=paused, stopping=stopping)

    def remove(self) -> None:
        self._inner.remove()
