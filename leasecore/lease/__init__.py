"""The lease of a polled task, pure: the model this codebase is built around.

``from leasecore.lease import Lease, LeasePolicy, FenceReason, ...`` is how callers use it; the parts:

* ``machine``: ``Lease``, the per-task state machine (events in, actions out, ``next_wakeup``);
* ``policy``: ``LeasePolicy`` and the measured constants (deadlines, grace cap, heartbeat cadence);
* ``ownership``: what an ownership check's answer means (``ownership_lost_reason``);
* ``actions``: the values a lease returns and shows (``SendHeartbeat`` ... ``LeaseView``);
* ``finalcheck``: making a final result stick after a heartbeat of unknown fate (park, read back);
* ``finalfailure``: what a failed final update means (``decide``: retry, read back, outbox, give up).

Must not touch: a clock, I/O, threads, processes (``tests/unit/test_layering.py`` checks it). The
lease engine (``leasecore.runner.leasing.engine``) carries the actions out.

Threads: none. A ``Lease`` is not thread-safe; its caller serialises the calls (the engine's lock).
"""

from __future__ import annotations

from leasecore.lease.actions import (
    Action,
    CheckOwnership,
    FenceAction,
    FenceReason,
    KillTree,
    LeaseState,
    LeaseView,
    SendHeartbeat,
    TerminateTree,
)
from leasecore.lease.machine import Lease
from leasecore.lease.ownership import ownership_lost_reason
from leasecore.lease.policy import (
    FENCE_MARGIN_SECONDS,
    HEARTBEAT_RETRY_BACKOFF,
    KILL_GRACE_SHARE,
    MIN_RETRY_GAP_SECONDS,
    LeasePolicy,
)

__all__ = [
    "FENCE_MARGIN_SECONDS",
    "HEARTBEAT_RETRY_BACKOFF",
    "KILL_GRACE_SHARE",
    "MIN_RETRY_GAP_SECONDS",
    "Action",
    "CheckOwnership",
    "FenceAction",
    "FenceReason",
    "KillTree",
    "Lease",
    "LeasePolicy",
    "LeaseState",
    "LeaseView",
    "SendHeartbeat",
    "TerminateTree",
    "ownership_lost_reason",
]
