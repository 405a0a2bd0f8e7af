"""The state the runner's main thread owns, declared once for the parts that share it.

``Runner`` (``leasecore.runner.loop.runner``: the loop, stopping, status) is built from two parts, each a
class in its own module: ``TaskStarts`` (``task_start``: a polled or chained task up to its running
child) and ``TaskEnds`` (``task_end``: fences, the child's exit, its result and report, forgetting it).
This base declares the attributes they read and write (``Runner.__init__`` sets every one) and the
two calls that cross from ``task_end`` back into ``task_start``. Only the main thread touches any of it; the
other threads only put events on ``_events``. Holds no logic of its own.
"""

from __future__ import annotations

import queue
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from leasecore.clock import Clock
from leasecore.handover import StartGate, YieldHold
from leasecore.lease import LeasePolicy
from leasecore.metrics import Observer
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.loop.checkpoints import CheckpointScan, ResumePort
from leasecore.runner.loop.events import Event
from leasecore.runner.loop.status import InFlight, NextRun
from leasecore.runner.ports import EnginePort, RunOptions, SupervisorPort, TaskTypePlan
from leasecore.runner.secretbook import SecretBook
from leasecore.runner.upstream.logsink import LogStreamer
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.reporter import Reporter
from leasecore.snapshot import TaskSnapshot

if TYPE_CHECKING:
    from leasecore.process.spec import ChildExit, CommandSpec


class ToResult(Protocol):
    """``leasecore.process.to_task_result`` as the runner calls it (``exit_``: a ChildExit)."""

    def __call__(
        self, task: Task, exit_: ChildExit, spec: CommandSpec, worker_id: str, *, timed_out: bool = False
    ) -> TaskResult: ...


class RunnerCore:
    """Attributes of the runner's main thread (see the module docstring); set by ``Runner``."""

    options: RunOptions
    _clock: Clock
    _metrics: Observer
    _events: queue.SimpleQueue[Event]
    _plans: dict[str, TaskTypePlan]
    _engine: EnginePort
    _supervisor: SupervisorPort
    _to_result: ToResult
    _reporter: Reporter
    _logs: LogStreamer
    _budget: WorkBudget
    _pollers: dict[str, Poller]
    _tasks: dict[str, InFlight]
    _statuses: list[TaskStatus | None]  # per started task, in start order
    _gate: StartGate
    _yields: YieldHold
    _handing_back: set[str]
    # A task's next delivery polled while its previous run is still here: started once it is forgotten.
    _next_runs: dict[str, NextRun]
    _resume_port: ResumePort | None  # where a retry's earlier checkpoint is looked up (None: nowhere)
    _checkpoint_scan: CheckpointScan
    _undelivered: dict[str, tuple[Path, TaskSnapshot]]
    _stopping_since: float | None
    _forced: bool
    _chaining: bool  # the conductor port has update_v2 (leasecore.runner.chain)
    _secrets: SecretBook  # values masked in the runner's log (leasecore.runner.secretbook)

    def _on_task(
        self, task: Task, polled_at: float, policy: LeasePolicy | None = None, *, surplus: bool = False,
        chained: bool = False,
    ) -> None:
        raise NotImplementedError  # TaskStarts

    def _end_unstarted(self, entry: InFlight, wait_left: float, *, held: bool = True) -> None:
        raise NotImplementedError  # TaskStarts

    def _on_chained(self, task: Task | None, sent_at: float, *, from_task: str, poller: str) -> None:
        raise NotImplementedError  # TaskStarts (on a reporter's sender thread)
