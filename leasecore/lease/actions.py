"""The lease's vocabulary: what a lease asks its caller to do, why a tree is fenced, how it looks.

Owns the action values a ``Lease`` returns (``SendHeartbeat``, ``CheckOwnership``, ``TerminateTree``,
``KillTree``), ``FenceReason`` (which tells the runner how to report), ``LeaseState`` and the
``LeaseView`` snapshot for the status display. Plain frozen values, nothing else.

Must not touch: time (every time in here is a monotonic second handed in by the caller), I/O,
threads, or any decision: when an action is due is ``leasecore.lease.machine``'s business and the
numbers behind it ``leasecore.lease.policy``'s.

Threads: none of its own. The values are immutable, so any thread may hold or compare them (the lease
engine's timer and senders make them; the runner's loop reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "FINAL_FENCES",
    "Action",
    "CheckOwnership",
    "FenceAction",
    "FenceReason",
    "KillTree",
    "LeaseState",
    "LeaseView",
    "SendHeartbeat",
    "TerminateTree",
]


class FenceReason(StrEnum):
    """Why the child's tree was (or is being) stopped; tells the runner how to report."""

    SHUTDOWN = "shutdown"
    LEASE_EXPIRED = "lease_expired"
    OWNERSHIP_LOST = "ownership_lost"
    HARD_TIMEOUT = "hard_timeout"
    EXEC_TIMEOUT = "exec_timeout"


# After these fences the lease is worthless: no more heartbeats or ownership checks.
FINAL_FENCES = frozenset({FenceReason.OWNERSHIP_LOST, FenceReason.LEASE_EXPIRED})


class LeaseState(StrEnum):
    """Where a lease is in its life, for the status display."""

    RUNNING = "running"
    TERMINATING = "terminating"
    KILLING = "killing"
    REPORTING = "reporting"
    DONE = "done"


@dataclass(frozen=True)
class SendHeartbeat:
    """Send one extendLease; ``expires_at`` is the lease's TERM point, which the attempt must not outlive."""

    timeout_seconds: float
    due_at: float
    expires_at: float


@dataclass(frozen=True)
class CheckOwnership:
    """Read the task's status from the server (GET /api/tasks/{id})."""

    timeout_seconds: float
    due_at: float
    expires_at: float


@dataclass(frozen=True)
class TerminateTree:
    """Send TERM to the child's whole tree; its KILL is due ``grace_seconds`` after ``at``.

    ``at``: when the fence came due (the TERM point itself, not when this action was carried out), so
    that a TERM carried out late (a runner stopping 500 trees hands them out one by one) does not
    push its KILL back. ``grace_seconds``: the (capped) kill grace, shortened so that the KILL comes
    no later than a server deadline's KILL point (None: the process layer's own). Neither is part of
    equality: they are times, the action is what to do.
    """

    reason: FenceReason
    at: float | None = field(default=None, compare=False)
    grace_seconds: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class KillTree:
    """Send KILL to the child's whole tree."""

    reason: FenceReason


Action = SendHeartbeat | CheckOwnership | TerminateTree | KillTree
FenceAction = TerminateTree | KillTree


@dataclass(frozen=True, eq=False)
class LeaseView:
    """A snapshot of one lease for the status display (monotonic seconds; None = not applicable)."""

    polled_at: float
    last_ack_at: float  # send time of the newest acknowledged heartbeat, or the poll
    next_heartbeat_at: float | None
    lease_deadline: float | None
    hard_deadline: float | None
    exec_deadline: float | None
    consecutive_failures: int
    heartbeat_in_flight: bool
    state: LeaseState
    fence_reason: FenceReason | None
