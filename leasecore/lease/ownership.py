"""What an ownership check's answer means: the task is still ours, lost, or to be looked at again.

Owns the reading of a task read back from the server (``TaskOwnership``: status, pollCount, workerId)
against the newest pollCount delivered to us. The task is no longer ours on a 404 (also a 404 on a
heartbeat), a terminal status, SCHEDULED (re-queued: a bare IN_PROGRESS update or an admin requeue),
or IN_PROGRESS with a pollCount above ours (someone polled it again; pollCount grows by one per poll).
A re-delivery to us raises the pollCount we hold, and may still be on its way to the runner when a
check sees it: a higher pollCount is confirmed by one more check ``redelivery_grace_seconds`` later
before it counts. workerId is not compared (runners on one host share the default id); pollCount 0
means unknown and is never compared. ``outbox`` uses ``ownership_lost_reason`` for its leftovers too.

Must not touch: when checks happen or what a loss does to the tree (``leasecore.lease.machine``),
time, I/O, threads.

Threads: none; pure functions of their arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from leasecore.models import TaskOwnership, TaskStatus

__all__ = ["OwnershipVerdict", "judge_ownership", "ownership_lost_reason"]


@dataclass(frozen=True, eq=False)
class OwnershipVerdict:
    """One answer, weighed: ``lost_reason`` (not None: fence, report nothing) or ``confirm_poll_count``
    (not None: a higher pollCount seen for the first time; look again after the grace). Both None:
    still ours."""

    lost_reason: str | None = None
    confirm_poll_count: int | None = None


def ownership_lost_reason(ownership: TaskOwnership | None, held_poll_count: int) -> str | None:
    """Why the task read back is no longer ours (None: still ours). ``held_poll_count`` 0: unknown."""
    if ownership is None:
        return "the server no longer knows the task (404)"
    if ownership.status.is_terminal:
        return f"the task is {ownership.status.value} on the server"
    if ownership.status is TaskStatus.SCHEDULED:
        return "the task was re-queued (SCHEDULED) and will be handed out again"
    if held_poll_count > 0 and ownership.poll_count > held_poll_count:
        by = f" by worker {ownership.worker_id!r}" if ownership.worker_id else ""
        return f"the task was polled again{by} (pollCount {ownership.poll_count}, ours {held_poll_count})"
    return None


def _repolled_count(ownership: TaskOwnership | None, held_poll_count: int) -> int | None:
    """The higher pollCount of a task someone polled again while IN_PROGRESS (None: not that case)."""
    if ownership is None or ownership.status is not TaskStatus.IN_PROGRESS or held_poll_count <= 0:
        return None
    return ownership.poll_count if ownership.poll_count > held_poll_count else None


def judge_ownership(
    ownership: TaskOwnership | None,
    held_poll_count: int,
    *,
    unconfirmed_poll_count: int | None,
    redelivery_grace_seconds: float,
) -> OwnershipVerdict:
    """Weigh one answer (None: a 404). ``unconfirmed_poll_count``: a higher pollCount an earlier check
    saw and this one confirms (None: none pending); a grace of 0 confirms at once."""
    repolled = _repolled_count(ownership, held_poll_count)
    if repolled is not None and redelivery_grace_seconds > 0 and unconfirmed_poll_count is None:
        # Maybe a re-delivery to us still on its way to the runner: give it the grace to arrive.
        return OwnershipVerdict(confirm_poll_count=repolled)
    return OwnershipVerdict(lost_reason=ownership_lost_reason(ownership, held_poll_count))
