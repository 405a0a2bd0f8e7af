"""Tasks a dead runner held, reported FAILED by the next start so the server retries them now.

A runner that is SIGKILLed (or OOM-killed) while tasks run reports none of them: the fork server (or
the next start's leftovers sweep) kills their trees, and the server would only retry each task once
its ``responseTimeoutSeconds`` ran out, which for a long job can be a long wait. So every tree's
record in the state directory carries what names its task (``tree_meta``: task and workflow id,
task type, the pollCount we held, our worker id, and ``outbox.server_key`` of the server URL, never
the URL itself, which may carry credentials). The next start's sweep hands the dead runner's records
to ``save_orphans`` once their trees are dead, which saves a FAILED result for each in the outbox of
the server it came from; the outbox then delivers it as any saved result, only while the task is
still ours (not terminal, not re-queued, not polled again since: ``lease.ownership_lost_reason``).
A result of the same task already in the outbox (the real one, kept because the final update could
not get through) is left as it is. A record without this meta (an older runner) or without a
pollCount is not reported: without it another worker's run of the task could not be told apart.
:func:`take_over` is the sweep's callback as the wiring passes it: the FAILED results saved, and the
dead runner's status snapshot deleted (it would show those tasks running under a dead pid).

Must not: kill anything (the sweep, ``process.linux.leftovers``, has, before the hand-over), or raise out
of ``take_over``: a start must never fail on a dead runner's leftovers.
Threads: the runner's main thread, at start, during the sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from leasecore.clock import Clock
from leasecore.errors import ConfigError
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.linux.leftovers import TreeRecord
from leasecore.state.directory import StateDir
from leasecore.state.outbox import Outbox, server_key
from leasecore.state.statefile import forget_runners

log = logging.getLogger("conductor_run.orphans")

_REASON = "the worker running this task died (runner pid {pid}); its process tree was killed"
_SURVIVORS = ("the worker running this task died (runner pid {pid}); {count} process{es} of its tree "
              "could not be killed")


def orphan_reason(runner_pid: int, survivors: int = 0) -> str:
    """The ``reasonForIncompletion`` of a task whose runner died while it ran: its tree was killed
    only when every member is confirmed gone (``survivors``: how many the sweep saw still alive)."""
    if survivors > 0:
        return _SURVIVORS.format(pid=runner_pid, count=survivors, es="" if survivors == 1 else "es")
    return _REASON.format(pid=runner_pid)


def tree_meta(server_url: str) -> Callable[[Task, str], dict[str, Any]]:
    """The Supervisor's ``tree_meta`` for a runner serving ``server_url``."""
    key = server_key(server_url)

    def meta(task: Task, worker_id: str) -> dict[str, Any]:
        return {"server": key, "task_id": task.task_id, "workflow_id": task.workflow_id,
                "task_type": task.task_type, "poll_count": task.poll_count, "worker_id": worker_id}

    return meta


def orphan_result(
    runner_pid: int, meta: dict[str, Any] | None, survivors: int = 0
) -> tuple[str, TaskResult, int] | None:
    """``(server key, FAILED result, pollCount held)`` for a tree's meta; None when it names no task
    that can be reported safely (no meta, a field missing or of the wrong type, pollCount unknown)."""
    if meta is None:
        return None
    key, task_id, workflow_id = meta.get("server"), meta.get("task_id"), meta.get("workflow_id")
    poll_count, worker_id = meta.get("poll_count"), meta.get("worker_id")
    if not (isinstance(key, str) and key and isinstance(task_id, str) and task_id
            and isinstance(workflow_id, str) and workflow_id):
        return None
    if not isinstance(poll_count, int) or isinstance(poll_count, bool) or poll_count <= 0:
        return None
    result = TaskResult(task_id, workflow_id, TaskStatus.FAILED,
                        reason_for_incompletion=orphan_reason(runner_pid, survivors),
                        worker_id=worker_id if isinstance(worker_id, str) else None)
    return key, result, poll_count


def save_orphans(
    directory: Path, runner_pid: int, trees: list[TreeRecord], *, clock: Clock | None = None
) -> int:
    """The sweep's ``on_orphans``: save a FAILED result for each task of ``trees`` in ``directory``
    (the outbox directory), in the outbox of its own server; returns how many were saved."""
    saved = 0
    latest: dict[str, tuple[TreeRecord, str, TaskResult, int]] = {}
    for tree in trees:
        found = orphan_result(runner_pid, tree.meta, tree.survivors)
        if found is None:
            if tree.meta is not None:
                log.warning("a task tree of the dead runner pid %d names no task that can be reported "
                            "(no pollCount?): the server retries it after its response timeout",
                            runner_pid)
            continue
        key, result, poll_count = found
        # One task, two trees (the runner was handed the task again): only the latest claim can
        # still be ours; an older pollCount would be dropped as "polled again" at delivery.
        held = latest.get(result.task_id)
        if held is None or poll_count > held[3]:
            latest[result.task_id] = (tree, key, result, poll_count)
    for tree, key, result, poll_count in latest.values():
        try:
            outbox = Outbox.for_key(directory, key, clock=clock)
            if outbox.has_saved(result.task_id):
                log.info("task %s: a result of it is already saved (delivered first); not adding the "
                         "dead runner's FAILED", result.task_id)
                continue
            outbox.save(result, poll_count=poll_count)
        except OSError as exc:
            log.error("task %s: could not save its FAILED report (%s): the server retries it after its "
                      "response timeout", result.task_id, exc)
            continue
        saved += 1
        fate = ("is killed" if not tree.survivors
                else f"could not be killed entirely ({tree.survivors} still alive)")
        log.warning("task %s (%s, workflow %s) was running under runner pid %d, which died; its tree "
                    "%s: reporting it FAILED, if still ours, so the server retries it now",
                    result.task_id, tree.meta.get("task_type") if tree.meta else "?", result.workflow_id,
                    runner_pid, fate)
    return saved


def take_over(state: StateDir, runner_pid: int, trees: list[TreeRecord]) -> None:
    """The start-up sweep's ``on_orphans`` for a run in ``state``: a dead runner's trees (already
    killed) handed over. Their tasks' FAILED results go into the outbox (:func:`save_orphans`), and
    the runner's status snapshot goes: it would go on showing those tasks as running under a dead
    pid. Best effort, never raises: nothing here may keep the runner from starting (the server retries
    the tasks after their response timeout anyway), so the dead runner's record is let go."""
    try:
        save_orphans(state.outbox, runner_pid, trees)
    except Exception:
        log.exception("could not queue the FAILED reports of the dead runner pid %d's tasks; the server "
                      "retries them after their response timeout", runner_pid)
    try:
        forget_runners(state, [runner_pid], datetime.now(UTC))
    except (ConfigError, OSError) as exc:  # cosmetic: never a reason not to start
        log.debug("could not remove the dead runner pid %d's snapshot: %s", runner_pid, exc)
