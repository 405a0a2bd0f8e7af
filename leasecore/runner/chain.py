"""update-v2 chaining: when a final update may claim the next task, and what a claimed task becomes. Pure.

``POST /api/tasks/update-v2`` is the final update plus a poll: for a terminal result the server claims
one more task of the same type and domain for the result's workerId and returns it (204: none). The
runner uses it only when it can run what it gets (``may_chain``, checked on its main thread; the
poller then keeps the finished task's slot and one unit of the work budget for it), so the claim never
outruns the slots. A task it gets goes through the start rules of a polled task (the lease from the
update's send time, ``leasecore.handover``'s holds); one it can no longer run (the runner began to
stop meanwhile) goes straight back (``hand_back``), never left to sit under a lease until R.

A server without the endpoint answers 404 or 405 (``refusal``). 405 says so; 404 may also mean the task
or its workflow is gone, so the same result goes out through v1 at once, and only if v1 takes it is
update-v2 turned off for good (the endpoint is missing); if v1 answers 404 too, the task was gone.

No I/O, no threads, no clock: the reporter (sender threads) and the runner (main thread) call these.
"""

from __future__ import annotations

from enum import Enum

from leasecore.handover import mark_yield, may_run_elsewhere, with_checkpoint
from leasecore.lease import FenceReason
from leasecore.lease.finalfailure import Attempt, FallBackToV1, decide, failure_of_status
from leasecore.models import Task, TaskResult, TaskStatus

__all__ = ["CHAINABLE", "Refusal", "hand_back", "may_chain", "refusal"]

# Results whose update-v2 claims a task (the server claims only after a terminal update).
CHAINABLE = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.FAILED_WITH_TERMINAL_ERROR})
# Fences after which the lease is still sound: a timeout of the task's own. After a lost lease (the
# server out of reach, most likely) or a stop, nothing new is claimed.
_SOUND_FENCES = frozenset({None, FenceReason.EXEC_TIMEOUT, FenceReason.HARD_TIMEOUT})


def may_chain(result: TaskResult, *, stopping: bool, fence: FenceReason | None, enabled: bool) -> bool:
    """May the final update of ``result`` claim the next task (update-v2)? ``enabled``: the server
    answers update-v2 (not switched off by a refusal) and the port has the call. A free slot and
    the work budget are the poller's to grant on top (``Poller.keep_for_chain``)."""
    return enabled and not stopping and result.status in CHAINABLE and fence in _SOUND_FENCES


class Refusal(Enum):
    """What a refused update-v2 call says about the endpoint."""

    MISSING = "missing"  # 405: no such endpoint here; v1 from now on
    UNSURE = "unsure"  # 404: the endpoint, or the task, is missing; v1 tells (see the module doc)


def refusal(status_code: int | None) -> Refusal | None:
    """How a refused update-v2 call is read (None: an ordinary refusal of the result, as v1's): the
    final-update table's ``FallBackToV1`` (``leasecore.lease.finalfailure``)."""
    decision = decide(failure_of_status(status_code),
                      Attempt(TaskStatus.COMPLETED, v2=True, status_code=status_code, left=0.0))
    if not isinstance(decision, FallBackToV1):
        return None
    return Refusal.MISSING if decision.endpoint_missing else Refusal.UNSURE


def hand_back(task: Task, worker_id: str | None) -> TaskResult:
    """The update that hands a claimed, never-started ``task`` back: IN_PROGRESS with
    callbackAfterSeconds 0 makes it SCHEDULED again at once for any worker (CONDUCTOR_PROTOCOL.md §3
    step 5; on the 3.32.1 jar re-polled 0.07 s later), and unlike FAILED it spends no retry. Marked
    as our yield (its next holder starts at once: nothing of ours ran it) unless a previous holder
    may still run it, in which case its next holder waits as we would have."""
    result = TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS, callback_after_seconds=0,
                        worker_id=worker_id)
    # The update replaces outputData: the task's checkpoint goes back with it, or its next run loses it.
    result = with_checkpoint(result, task.checkpoint)
    return result if may_run_elsewhere(task) else mark_yield(result, task.poll_count)
