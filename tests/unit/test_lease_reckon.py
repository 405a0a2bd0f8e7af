"""The lease's derived times (kept by ``Lease._reckon``) always equal what their inputs give now.

Since the derived times became attributes worked out when an ack, a confirming check or the exit
moves them, a new input that ``_reckon`` forgets would leave a stale deadline: a fence too early or too
late. This walks random event sequences and, after every event, works each time out again the way
the machine did before (a property per read) and compares.
"""

from __future__ import annotations

import math
import random

import pytest

from leasecore.lease.machine import Lease
from leasecore.lease.policy import LeasePolicy
from leasecore.models import TaskOwnership, TaskStatus

NEVER = math.inf


def _expected(lease: Lease) -> tuple[float, float, tuple[float, float] | None]:
    """(lease deadline, TERM point, kill_by) from the lease's inputs, worked out afresh."""
    p = lease.policy
    timeout, window = p.lease_timeout_seconds, p.ownership_window_seconds
    if timeout <= 0:
        deadline = NEVER
    elif window > 0 and not lease._child_exited:
        deadline = min(lease._acked_sent_at + timeout, lease._confirmed_at + window)
    else:
        deadline = lease._acked_sent_at + timeout
    term = deadline - p.fence_lead_seconds
    hard = p.hard_timeout_seconds
    hard_at = lease._polled_at + hard - p.hard_elapsed_seconds if hard > 0 else NEVER
    kill_at = min(deadline, hard_at) - p.fence_margin_seconds
    kill_by = None if kill_at == NEVER else (min(term, hard_at - p.fence_lead_seconds), kill_at)
    return deadline, term, kill_by


def _policy(rng: random.Random) -> LeasePolicy:
    hard = rng.choice([0.0, 0.0, 7.0, 30.0])
    return LeasePolicy(
        response_timeout_seconds=rng.choice([0.0, 2.0, 2.0, 5.0, 60.0]),
        ownership_check_interval_seconds=rng.choice([0.0, 1.0, 5.0]),
        check_queue_seconds=rng.choice([0.0, 0.5, 50.0]),
        first_attempt_spread=rng.choice([0.0, 0.2]),
        kill_grace_seconds=rng.choice([0.2, 10.0]),
        hard_timeout_seconds=hard,
        hard_elapsed_seconds=rng.choice([0.0, 1.5]) if hard else 0.0,
        exec_timeout_seconds=rng.choice([0.0, 4.0]),
    )


def _step(lease: Lease, rng: random.Random, now: float, poll_count: int) -> int:
    ev = rng.choices(range(14), weights=[20, 12, 6, 8, 4, 3, 2, 2, 3, 2, 2, 2, 1, 1])[0]
    if ev == 0:
        lease.on_tick(now)
    elif ev == 1:
        lease.on_heartbeat_ok(now, now - rng.choice([0.0, 0.2, 0.9, 1.5]))
    elif ev == 2:
        lease.on_heartbeat_failed(now)
    elif ev == 3:
        status = rng.choice([TaskStatus.IN_PROGRESS] * 6 + [TaskStatus.SCHEDULED])
        lease.on_ownership(now, TaskOwnership(status, rng.choice([poll_count] * 4 + [poll_count + 1, 0])))
    elif ev == 4:
        lease.on_ownership_check_failed(now)
    elif ev == 5:
        poll_count += rng.choice([0, 1])
        lease.on_redelivered(now, now - rng.choice([0.0, 0.3, 3.0]), poll_count)
    elif ev == 6:
        lease.on_start_held(now)
    elif ev == 7:
        lease.on_child_started(now)
    elif ev == 8:
        lease.on_child_exited(now)
    elif ev == 9:
        lease.on_final_update_started(now)
    elif ev == 10:
        lease.on_final_update_failed(now)
    elif ev == 11:
        lease.on_heartbeat_withdrawn(now)
    elif ev == 12:
        lease.on_shutdown(now, rng.choice([None, now + 3.0]))
    else:
        lease.on_heartbeat_not_found(now)
    return poll_count


@pytest.mark.parametrize("seed", range(200))
def test_derived_times_follow_every_input(seed: int) -> None:
    rng = random.Random(seed)
    jitter = random.Random(seed + 10_000)
    now = rng.uniform(0.0, 100.0)
    lease = Lease(_policy(rng), now, poll_count=1, random=jitter.random)
    poll_count = 1
    for _ in range(120):
        now += rng.choice([0.0, 0.01, 0.1, 0.3, 0.7, 1.0, 2.0])
        poll_count = _step(lease, rng, now, poll_count)
        deadline, term, kill_by = _expected(lease)
        assert lease.lease_deadline == deadline
        assert lease.term_point == term
        assert lease.kill_by() == kill_by
