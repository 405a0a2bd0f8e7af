"""The events the runner's main thread consumes: one queue, one reader, one writer of per-task state.

Owns: the frozen event values put on the runner's ``queue.SimpleQueue`` (a polled or chained task,
an update-v2 that claimed nothing, a child's exit, a fence from the lease engine, a finished report,
a stop request, a poller's end, an operator's control request or SIGHUP's reload, a tick) and
their union :data:`Event`. Every input of the runner is one of them, so the main thread is the only
writer of per-task state (STYLE.md 2.2: a signal handler only puts ``ShutdownRequested`` or
``ReloadRequested``; the control socket's thread only puts ``ControlRequest``).

Must not: carry behaviour or I/O; values only. The ports the runner drives are ``runner.ports``.
Threads: made on any thread (pollers, the engine's timer and senders, the supervisor's reader, the
reporter, signal handlers), read only by the runner's main thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from leasecore.lease import FenceAction, LeasePolicy
from leasecore.models import Task, TaskOwnership
from leasecore.runner.upstream.reporter import ReportOutcome

if TYPE_CHECKING:
    from leasecore.process.spec import ChildExit

__all__ = [
    "ChainEnded",
    "ChildExited",
    "ControlRequest",
    "Event",
    "Fence",
    "HeldRead",
    "PollerExited",
    "ReloadRequested",
    "ReportDone",
    "ShutdownRequested",
    "TaskPolled",
    "Tick",
]


@dataclass(frozen=True, eq=False)
class TaskPolled:
    """A task a poller claimed, for the main loop to start (or hand back)."""

    task: Task
    polled_at: float  # monotonic send time of the poll that delivered it
    policy: LeasePolicy | None = None  # set: the poller's thread already tracked it (engine.track)
    surplus: bool = False  # beyond what the poller may run (no slot, no budget): hand it back
    poller: str = ""  # the task type of the poller that claimed it ("": unknown, the first one)
    # The task whose final update (update-v2) claimed this one: it comes with that task's slot and a
    # unit of the work budget (leasecore.runner.chain), never counted as a poll's unstarted claim.
    chained_from: str = ""


@dataclass(frozen=True, eq=False)
class ChainEnded:
    """The update-v2 of ``task_id`` claimed nothing (204, refused, failed): free its kept slot."""

    task_id: str


@dataclass(frozen=True, eq=False)
class ChildExited:
    """A task's child ended (its exit from the supervisor)."""

    task_id: str
    exit: ChildExit | None  # None when the runner lost track of the child (wait() failed)


@dataclass(frozen=True, eq=False)
class Fence:
    """The lease engine fenced a task: its tree is to be terminated or killed (``action``)."""

    task_id: str
    action: FenceAction  # from the lease engine's timer thread


@dataclass(frozen=True, eq=False)
class HeldRead:
    """A held task read back before its start (``ok`` False: the read failed; ``ownership`` None with
    ``ok``: a 404). From a read-back thread."""

    task_id: str
    poll_count: int  # the delivery that was read back
    ok: bool
    ownership: TaskOwnership | None = None


@dataclass(frozen=True, eq=False)
class ReportDone:
    """A task's final update is done (its outcome from the reporter)."""

    outcome: ReportOutcome


@dataclass(frozen=True, eq=False)
class ShutdownRequested:
    """Stop: a signal (``force``: the second one) or the runner itself."""

    force: bool
    signum: int | None = None  # None: the runner stops itself (--once found nothing, ...)


@dataclass(frozen=True, eq=False)
class PollerExited:
    """A task type's poller thread ended."""

    task_type: str
    failed: bool = False  # it ended on an unexpected error (a bug), logged with its traceback
    refused: Exception | None = None  # its first polls were refused (401/403): the run stops, exit 4


@dataclass(frozen=True, eq=False)
class ControlRequest:
    """An operator's request from the control socket (``leasecore.state.control``): pause, resume,
    reload or drain. ``answer(reply)`` is called once, by the main thread, with the JSON-able reply."""

    command: str
    task_types: tuple[str, ...] = ()
    timeout_seconds: float | None = None  # drain: how long the running tasks may take
    answer: Callable[[dict[str, Any]], None] = field(default=lambda _reply: None, compare=False)


@dataclass(frozen=True, eq=False)
class ReloadRequested:
    """SIGHUP: re-read the configuration file, as ``conductor-run reload`` does (result logged)."""


@dataclass(frozen=True, eq=False)
class Tick:
    """No event came within the main loop's wait: its periodic checks run."""


Event = (TaskPolled | ChainEnded | ChildExited | Fence | HeldRead | ReportDone | ShutdownRequested
         | PollerExited | ControlRequest | ReloadRequested | Tick)
