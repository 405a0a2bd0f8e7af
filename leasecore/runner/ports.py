"""The runner's vocabulary: the events its main thread consumes, the ports it drives, its outcome.

Every input of the runner (a polled task, a child's exit, a fence from the lease engine, a finished
report, a signal) is one of the frozen events below, put on one ``queue.SimpleQueue`` that only the
main thread reads: the main thread is the only writer of per-task state. The ports are Protocols
that the real adapters (``ConductorClient``, ``LeaseEngine``, ``Supervisor``, ``StatePublisher``)
satisfy structurally, so tests can drive the runner with small fakes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from leasecore.lease import FenceAction, FenceReason, LeasePolicy, LeaseView
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.poller import PollSettings
from leasecore.runner.reporter import ReportOutcome
from leasecore.snapshot import ServerHealth, TaskSnapshot

# ---------------------------------------------------------------- events (main-thread queue)


@dataclass(frozen=True)
class TaskPolled:
    task: Task
    polled_at: float  # monotonic send time of the poll that delivered it
    policy: LeasePolicy | None = None  # set: the poller's thread already tracked it (engine.track)
    surplus: bool = False  # beyond what the poller may run (no slot, no budget): hand it back
    poller: str = ""  # the task type of the poller that claimed it ("": unknown, the first one)
    # The task whose final update (update-v2) claimed this one: it comes with that task's slot and a
    # unit of the work budget (leasecore.runner.chain), never counted as a poll's unstarted claim.
    chained_from: str = ""


@dataclass(frozen=True)
class ChainEnded:
    """The update-v2 of ``task_id`` claimed nothing (204, refused, failed): free its kept slot."""

    task_id: str


@dataclass(frozen=True)
class ChildExited:
    task_id: str
    exit: Any | None  # ChildExit; None when the runner lost track of the child (wait() failed)


@dataclass(frozen=True)
class Fence:
    task_id: str
    action: FenceAction  # from the lease engine's timer thread


@dataclass(frozen=True)
class ReportDone:
    outcome: ReportOutcome


@dataclass(frozen=True)
class ShutdownRequested:
    force: bool
    signum: int | None = None  # None: the runner stops itself (--once found nothing, ...)


@dataclass(frozen=True)
class PollerExited:
    task_type: str
    failed: bool = False  # it ended on an unexpected error (a bug), logged with its traceback
    refused: Exception | None = None  # its first polls were refused (401/403): the run stops, exit 4


@dataclass(frozen=True)
class Tick:
    pass


Event = (TaskPolled | ChainEnded | ChildExited | Fence | ReportDone | ShutdownRequested | PollerExited
         | Tick)

# ---------------------------------------------------------------- ports


class ConductorPort(Protocol):
    """What the runner needs from ``ConductorClient``."""

    def poll(
        self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[Task]: ...

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None: ...

    # Optional: ``update_v2(result, *, timeout_seconds) -> Task | None`` (a port without it never
    # chains; ``leasecore.runner.chain``).

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None: ...


class EnginePort(Protocol):
    """What the runner needs from ``LeaseEngine`` (ARCHITECTURE.md "Lease engine")."""

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def track(self, task: Task, policy: LeasePolicy, *, polled_at: float | None = None) -> None: ...
    def start_held(self, task_id: str) -> None: ...
    def child_started(self, task_id: str) -> None: ...
    def child_exited(self, task_id: str) -> None: ...
    def reported(self, task_id: str, *, poll_count: int | None = None) -> None: ...
    # The final update's guard (``heartbeat.FinalUpdates``, which the runner wraps around every update).
    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool: ...
    def final_update_failed(self, task_id: str) -> None: ...
    def shutdown(
        self, task_id: str | None = None, *, drain_deadline: float | None = None, force: bool = False
    ) -> None: ...
    def fence_reason(self, task_id: str) -> FenceReason | None: ...
    def view(self, task_id: str) -> LeaseView: ...


class ChildPort(Protocol):
    """A task tree (``leasecore.process`` child handle), started or being started. Its exit reaches
    the runner through ``SupervisorPort.start(on_done=...)``; ``wait`` is for callers that have a
    thread to block. ``pid`` is 0 until the command runs."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None) -> Any | None: ...
    def wait_gone(self, timeout: float | None = None) -> bool: ...  # every process of the tree reaped
    def terminate_tree(self, grace_seconds: float | None = None, *, since: float | None = None) -> None: ...
    def kill_tree(self) -> None: ...


class SupervisorPort(Protocol):
    """What the runner needs from ``Supervisor``: ``start`` returns without waiting for the exec; a
    command that never runs ends as ``on_done(exit)`` with ``exit.start_error`` set."""

    def start(
        self, task: Task, spec: Any, *, worker_id: str,
        on_lines: Callable[[str, list[str]], None] | None = None,
        on_done: Callable[[Any], None] | None = None,
        on_started: Callable[[Any], None] | None = None,
    ) -> ChildPort: ...


class StatusPort(Protocol):
    """Where status snapshots go (``StatePublisher``); the runner calls it on its main thread."""

    def publish(self, tasks: Sequence[TaskSnapshot], *, server: ServerHealth) -> bool: ...
    def remove(self) -> None: ...


# ---------------------------------------------------------------- plan and outcome


@dataclass(frozen=True)
class TaskTypePlan:
    """Everything the runner needs to serve one task type, already resolved from the configuration."""

    poll: PollSettings
    spec: Any  # CommandSpec
    worker_id: str
    make_policy: Callable[[Task], LeasePolicy]
    kill_grace_seconds: float = 10.0


@dataclass(frozen=True)
class RunOptions:
    once: bool = False
    max_tasks: int | None = None
    drain: bool = False
    drain_timeout_seconds: float = 300.0
    once_wait_seconds: float = 30.0  # --once: how long to wait for a task before giving up (--once-wait)
    report_retry_seconds: float = 60.0  # retry a final update this long (heartbeats go on meanwhile)
    shutdown_report_retry_seconds: float = 10.0  # ... but no longer than this once stopping
    status_interval_seconds: float = 1.0
    status_min_interval_seconds: float = 0.2  # status snapshots are built at most this often


@dataclass(frozen=True)
class RunOutcome:
    """How the run ended; ``cli.run`` turns it into an exit code."""

    signum: int | None = None  # the signal that stopped the run, if one did
    started: int = 0
    statuses: tuple[TaskStatus | None, ...] = field(default=())  # per started task; None: not reported
    poller_failed: bool = False  # a poller ended on an unexpected error: exit 1, not a clean stop
    # The server refused a poller's first polls (a ConductorAuthError): the worker raises it, exit 4.
    refused: Exception | None = field(default=None, compare=False)

    @property
    def all_completed(self) -> bool:
        ok = (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS)
        return bool(self.statuses) and all(s in ok for s in self.statuses)
