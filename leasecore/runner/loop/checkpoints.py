"""Checkpoints across a task's runs (``leasecore.process.checkpoint``): found, watched, sent on.

Owns the runner's side of CONDUCTOR_CHECKPOINT_FILE (DESIGN.md §3):

* ``resume_retry``: a retry (``retriedTaskId``) polled without a checkpoint of its own gets its earlier
  attempt's: that task's ``outputData.checkpoint`` on the server, else the last checkpoint it streamed
  to its task log (an attempt whose runner died, or that the server timed out, sent no update). For
  an attempt TIMED_OUT or CANCELED the log comes first: its output, if any, is an earlier run's.
  On the poller's thread (or a reporter's sender thread for a chained task), before the task reaches
  the main thread: its lease is heartbeated meanwhile; a failed look-up only costs the resume.
* ``CheckpointScan``: the main thread's look at every running task's file, at most once per
  ``SCAN_SECONDS``: a changed, valid checkpoint goes to the task log as one marked line (so at most
  one line per task per scan), an unusable one is said there once.
* ``with_checkpoint``: every update the runner makes for a task carries its last valid checkpoint as
  ``outputData.checkpoint`` (a yield's next run, a retry, or a surplus hand-back then keep it).
* ``child_deadline``: CONDUCTOR_DEADLINE, from the lease policy and the engine's hard deadline.

Must not touch: the task's files other than through a ``CheckpointWatch``; lease state.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, cast

from leasecore.conductor.calls import Reply, path_segment
from leasecore.errors import ConductorError
from leasecore.lease import LeasePolicy
from leasecore.models import Task
from leasecore.process.checkpoint import CheckpointWatch, from_log, from_output, log_line, seed_of

if TYPE_CHECKING:
    from leasecore.runner.ports import ChildPort

log = logging.getLogger("conductor_run.runner")

SCAN_SECONDS = 2.0  # how often running tasks' checkpoint files are looked at (and at most one log line)
LOOKUP_TIMEOUT_SECONDS = 5.0  # per call of a retry's look-up (two calls at most)
_NOT_ENDED_BY_US = frozenset({"TIMED_OUT", "CANCELED"})  # statuses no worker's update sets


class ResumePort(Protocol):
    """What finding a retried attempt's checkpoint asks of the server (``ConductorClient``)."""

    def get_task(self, task_id: str, *, timeout_seconds: float | None = None) -> dict[str, Any]: ...
    def request(self, method: str, path: str, *, timeout_seconds: float | None = None,
                uri: str | None = None) -> Reply: ...


def task_log(port: ResumePort, task_id: str) -> list[Any]:
    """``GET /tasks/{id}/log``: the entries, oldest first ([] for 204, or for anything but a list)."""
    reply = port.request("GET", f"/tasks/{path_segment(task_id)}/log", timeout_seconds=LOOKUP_TIMEOUT_SECONDS,
                         uri="/tasks/{taskId}/log")  # fmt: skip
    if reply.status_code == 204 or not reply.body.strip():
        return []
    data = reply.json()
    return data if isinstance(data, list) else []


def resume_port(conductor: object) -> ResumePort | None:
    """``conductor`` if it can look a retried attempt up (the client can; small fakes may not)."""
    has = all(callable(getattr(conductor, name, None)) for name in ("get_task", "request"))
    return cast(ResumePort, conductor) if has else None


def resume_retry(task: Task, port: ResumePort | None) -> Task:
    """``task`` with its earlier attempt's checkpoint when it is a retry that has none (else as is)."""
    retried = task.raw.get("retriedTaskId")
    if task.checkpoint is not None or not isinstance(retried, str) or not retried or port is None:
        return task
    try:
        earlier = port.get_task(retried, timeout_seconds=LOOKUP_TIMEOUT_SECONDS)
        value, where = from_output(earlier.get("outputData")), "output"
        # Timed out or cancelled: no runner's final update set that output; it is an earlier run's
        # (a yield's), and the task log may hold a newer checkpoint of the run that died.
        if value is None or earlier.get("status") in _NOT_ENDED_BY_US:
            logged = from_log(task_log(port, retried))
            if logged is not None:
                value, where = logged, "task log"
    except ConductorError as exc:
        log.warning("task %s: could not read its earlier attempt %s for a checkpoint (%s): it starts "
                    "without one", task.task_id, retried, exc)
        return task
    if value is None:
        return task
    log.info("task %s: resuming from the checkpoint of its earlier attempt %s (from its %s)",
             task.task_id, retried, where)
    return dataclasses.replace(task, checkpoint=value)


def open_watch(task: Task, child: ChildPort) -> CheckpointWatch | None:
    """The watch of a just-started child's checkpoint file (None: a child without one)."""
    path = child.checkpoint_path
    if not path:
        return None
    return CheckpointWatch(path, seed_of(task.checkpoint))


def start_line(watch: CheckpointWatch | None) -> str | None:
    """The marked line that starts a run's log when it resumes: a later attempt finds it there even if
    this run dies before its checkpoint changes."""
    return log_line(watch.text) if watch is not None and watch.text is not None else None


def child_deadline(
    policy: LeasePolicy, hard_deadline: float | None, now: float, epoch_now: float
) -> float | None:
    """CONDUCTOR_DEADLINE (epoch seconds) for a child started at ``now`` (monotonic; ``epoch_now`` is
    the same moment on the wall clock): the earliest TERM the runner knows of in advance, the exec
    timeout from now or the timeoutSeconds fence (``hard_deadline``, monotonic, the engine's: TERMed
    ``fence_lead_seconds`` ahead of it); None when there is neither."""
    points = []
    if policy.exec_timeout_seconds > 0:
        points.append(now + policy.exec_timeout_seconds)
    if hard_deadline is not None:
        points.append(hard_deadline - policy.fence_lead_seconds)
    return epoch_now + max(0.0, min(points) - now) if points else None


class CheckpointScan:
    """When the running tasks' files are looked at next (main thread)."""

    def __init__(self, now: float, interval_seconds: float = SCAN_SECONDS) -> None:
        self._interval = interval_seconds
        self._next_at = now + interval_seconds

    def due(self, now: float) -> bool:
        if now < self._next_at:
            return False
        self._next_at = now + self._interval
        return True

    @staticmethod
    def look(watches: Iterable[tuple[CheckpointWatch, Callable[[str], None]]]) -> None:
        """Look at each file; send what changed (``send(line)``: the task's log stream)."""
        for watch, send in watches:
            line = watch.look()
            if line is not None:
                send(line)
