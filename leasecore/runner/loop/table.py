"""The runner's table of tasks: what is in flight, what waits behind it, and how the started ones ended.

Owns: ``TaskTable`` (the in-flight entries by task id, the next runs waiting behind them, the tasks
being handed back, the results shown as undelivered, whether a stop began, options and plans as last
reloaded) handed to the parts of the runner that share it (``task_start.TaskStarts``,
``task_end.TaskEnds``, ``operate.LiveControl``, ``runner.Runner``); ``NextRuns`` (which delivery of a
task waits behind its run still here, and whether a slot goes back when one replaces another);
``Tally`` (the outcome of every started task, bounded: counts plus the newest statuses).
Must not: decide admissions or exits (``decisions``), do I/O, or be touched off the main thread.
Threads: main thread only (the probes read ``stopping_since`` as a plain attribute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from leasecore.models import TaskStatus
from leasecore.runner.loop.status import InFlight, NextRun
from leasecore.runner.ports import RunOptions, TaskTypePlan
from leasecore.snapshot import TaskSnapshot

__all__ = ["NextRuns", "Tally", "TaskTable"]

TALLY_KEPT = 10_000  # statuses of finished tasks kept (the newest); older ones are only counted
_RUNNING = object()  # a started task's outcome before it is known


class Tally:
    """Per started task, in start order, its final status (None: nothing reported). Bounded: at most
    ``kept`` are listed (the newest; an unfinished one is never dropped, and those are bounded by the
    slots); older ones are folded into counts, so ``started`` and ``all_completed`` stay exact in a
    long run."""

    def __init__(self, kept: int = TALLY_KEPT) -> None:
        self._kept = kept
        self._slots: dict[int, object] = {}  # index -> status or _RUNNING, in start order
        self.started = 0
        self.folded = 0  # finished tasks whose status is no longer listed
        self.folded_not_completed = 0  # of which ended other than COMPLETED / IN_PROGRESS

    def start(self) -> int:
        index = self.started
        self.started += 1
        self._slots[index] = _RUNNING
        return index

    def end(self, index: int, status: TaskStatus | None) -> None:
        if index in self._slots:
            self._slots[index] = status
        if len(self._slots) > self._kept:
            self._fold()

    def _fold(self) -> None:
        # The oldest finished ones, as many as are over the bound (unfinished ones stay): found by a
        # walk that stops there, not a copy of every slot (in a long run, each end folds one).
        excess = len(self._slots) - self._kept
        doomed: list[tuple[int, object]] = []
        for index, status in self._slots.items():  # oldest first
            if len(doomed) >= excess:
                break
            if status is not _RUNNING:
                doomed.append((index, status))
        for index, status in doomed:
            del self._slots[index]
            self.folded += 1
            if status not in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
                self.folded_not_completed += 1

    def statuses(self) -> tuple[TaskStatus | None, ...]:
        """The listed statuses in start order (an unfinished task's is None)."""
        return tuple(None if s is _RUNNING else s for s in self._slots.values())  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._slots)


class NextRuns:
    """A task's next delivery polled while its run here still ends: kept by task id, one per task."""

    def __init__(self) -> None:
        self._runs: dict[str, NextRun] = {}

    def keep(self, run: NextRun) -> int:
        """Keep ``run``; a run kept already for the task (delivered yet again meanwhile) is the same
        run: the newer (by pollCount) stays, holding one slot. Returns how many slots (and units of
        budget) go back: 1 when both had taken one, else 0."""
        task_id = run.task.task_id
        older = self._runs.get(task_id)
        given_back = 0
        if older is not None:
            if older.task.poll_count > run.task.poll_count:  # (arrived out of order)
                run, older = older, run
            if not older.surplus and not run.surplus:  # both took a slot and budget: one goes back
                given_back = 1
            elif not older.surplus:  # the kept one took none: it takes over the other's
                run = run._replace(surplus=False)
        self._runs[task_id] = run
        return given_back

    def pop(self, task_id: str) -> NextRun | None:
        return self._runs.pop(task_id, None)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._runs

    def __len__(self) -> int:
        return len(self._runs)


@dataclass(eq=False)
class TaskTable:
    """The state the runner's parts share (see the module docstring); set up by ``Runner``."""

    options: RunOptions
    plans: dict[str, TaskTypePlan]
    tasks: dict[str, InFlight] = field(default_factory=dict)
    next_runs: NextRuns = field(default_factory=NextRuns)
    tally: Tally = field(default_factory=Tally)
    handing_back: set[str] = field(default_factory=set)  # surplus tasks whose hand-back is in flight
    # Tasks whose result the reporter saved to the outbox, shown by ``status`` as undelivered until
    # the file is gone (delivered or dropped by the outbox's redelivery); the newest 100.
    undelivered: dict[str, tuple[Path, TaskSnapshot]] = field(default_factory=dict)
    stopping_since: float | None = None
    forced: bool = False

    def plan_for(self, task_type: str) -> TaskTypePlan:
        return self.plans.get(task_type) or next(iter(self.plans.values()))
