"""The ownership window: a lease is kept by its acks AND by its ownership checks, so that a holder whose
checks never get through cannot outlive the re-delivery wait of the task's next holder.

Heartbeats to a task the server has handed to someone else still succeed (extendLease only refuses a
terminal task), so only a check can tell a holder its copy must stop. These tests drive one lease with
a FakeClock, answering every beat and choosing how each check is answered; no threads, no sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from leasecore.clock import FakeClock
from leasecore.lease import (
    CheckOwnership,
    FenceReason,
    KillTree,
    Lease,
    LeasePolicy,
    SendHeartbeat,
    TerminateTree,
)
from leasecore.models import Task, TaskOwnership, TaskStatus

T0 = 1000.0
OURS = TaskOwnership(TaskStatus.IN_PROGRESS, 1, "host")


def policy(r: float = 20.0, **overrides: object) -> LeasePolicy:
    values: dict[str, object] = {"ownership_check_interval_seconds": 5.0, "kill_grace_seconds": 2.0,
                                 "fence_margin_seconds": 0.4}
    values.update(overrides)
    return LeasePolicy(response_timeout_seconds=r, **values)  # type: ignore[arg-type]


class Driven:
    """A lease ticked at each wake-up; every beat acked at once, each check answered by ``check``
    (True: still ours, False: the check failed)."""

    def __init__(self, p: LeasePolicy, check: Callable[[float], bool]) -> None:
        self.clock = FakeClock(start=T0)
        self.lease = Lease(p, polled_at=T0, poll_count=1)
        self.check = check
        self.log: list[tuple[float, object]] = []
        self.checks: list[tuple[float, bool]] = []

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def run_until(self, t: float) -> None:
        lease = self.lease
        while (wake := lease.next_wakeup()) is not None and wake <= T0 + t:
            self.clock.advance(max(0.0, wake - self.now))
            pending = list(lease.on_tick(self.now))
            while pending:
                action = pending.pop(0)
                self.log.append((self.now - T0, action))
                if isinstance(action, SendHeartbeat):
                    pending += lease.on_heartbeat_ok(self.now, self.now)
                elif isinstance(action, CheckOwnership):
                    ok = self.check(self.now - T0)
                    self.checks.append((self.now - T0, ok))
                    answered = lease.on_ownership(self.now, OURS) if ok else None
                    pending += answered if answered is not None else lease.on_ownership_check_failed(self.now)
        self.clock.advance(max(0.0, T0 + t - self.now))

    def fences(self) -> list[tuple[float, object]]:
        return [(t, a) for t, a in self.log if isinstance(a, TerminateTree | KillTree)]


def test_checks_that_keep_answering_ours_keep_the_lease_as_long_as_the_beats_do() -> None:
    d = Driven(policy(), check=lambda t: True)
    d.run_until(600)
    assert d.fences() == []
    assert len(d.checks) > 100  # checked all along (every 5 s)
    assert len([a for _, a in d.log if isinstance(a, SendHeartbeat)]) > 30  # and beaten


def test_a_holder_whose_checks_all_fail_is_fenced_one_window_after_its_last_confirmed_check() -> None:
    # The first check (at 5 s) says ours; every later one fails, while every heartbeat is acknowledged
    # (as the server does for a task it has handed to someone else).
    d = Driven(policy(), check=lambda t: t < 6)
    d.run_until(100)
    confirmed = d.checks[0][0]
    assert d.checks[0] == (confirmed, True) and confirmed == pytest.approx(5.0)
    # window = R = 20 s after that check's start: TERM at window - grace - margin, KILL at - margin
    fences = d.fences()
    assert [type(a) for _, a in fences] == [TerminateTree, KillTree]
    assert fences[0][0] == pytest.approx(confirmed + 20 - 2.0 - 0.4)
    assert fences[1][0] == pytest.approx(confirmed + 20 - 0.4)
    assert d.lease.fence_reason is FenceReason.LEASE_EXPIRED
    # the failed checks were retried sooner than every 5 s as the window ran out (at most half the time
    # left to the TERM point), so a healthy lease gets several chances
    failed = [t for t, ok in d.checks if not ok]
    assert len(failed) >= 4 and min(b - a for a, b in itertools.pairwise(failed)) < 5.0


def test_the_fork_servers_kill_by_follows_the_ownership_window() -> None:
    # A stalled runner cannot fence: its fork server enforces kill_by(), which must not lie beyond the
    # window either (the stall of a previous holder is the case the re-delivery wait must cover).
    d = Driven(policy(), check=lambda t: t < 6)
    d.run_until(14.5)  # a beat acked at 14.08 (0.8 x (20 - 2.4)); the check at 5 confirmed, at 10 failed
    term_at, kill_at = d.lease.kill_by()  # type: ignore[misc]
    assert (term_at - T0, kill_at - T0) == pytest.approx((5 + 20 - 2.4, 5 + 20 - 0.4))
    # a check that finds the task ours moves it, as an ack does (here up to the ack's own bound)
    d.clock.advance(d.lease.next_wakeup() - d.now)  # type: ignore[operator]
    assert [type(a) for a in d.lease.on_tick(d.now)] == [CheckOwnership]  # a retry of the failed ones
    d.lease.on_ownership(d.now, OURS)
    term_at, _ = d.lease.kill_by()  # type: ignore[misc]
    assert term_at - T0 == pytest.approx(0.8 * (20 - 2.4) + 20 - 2.4)


def test_a_redelivery_to_us_confirms_ownership_like_a_check() -> None:
    d = Driven(policy(), check=lambda t: False)
    d.run_until(3)
    d.lease.on_redelivered(d.now, d.now, poll_count=2)
    term_at, _ = d.lease.kill_by()  # type: ignore[misc]
    assert term_at - T0 == pytest.approx(3 + 20 - 2.4)


def test_after_the_child_exits_the_beats_alone_keep_the_lease_for_its_report() -> None:
    # The window bounds a running copy; once the child is gone nothing of ours runs, and a slow final
    # update still needs the lease (checks stop at the exit).
    d = Driven(policy(), check=lambda t: t < 6)
    d.run_until(10)
    d.lease.on_child_exited(d.now)
    d.run_until(200)
    assert d.fences() == []
    assert d.lease.fence_reason is None
    assert d.lease.lease_deadline - T0 > 190  # still kept by the beats


def test_checks_come_often_enough_to_fit_the_window() -> None:
    # R = 10 (grace capped at 2.5, so 10 - 2.5 - 0.4 = 7.1 s from a confirming check to its TERM
    # point): a 30 s interval would let the window lapse between two checks of a healthy lease.
    p = policy(r=10.0, ownership_check_interval_seconds=30.0, kill_grace_seconds=10.0)
    assert p.ownership_check_every_seconds == pytest.approx(0.8 * (10 - 2.5 - 0.4))
    assert policy(r=300.0).ownership_check_every_seconds == 5.0  # a long lease keeps the interval
    d = Driven(p, check=lambda t: True)
    d.run_until(300)
    assert d.fences() == []


def test_no_checks_or_no_lease_deadline_means_no_window() -> None:
    assert policy(ownership_check_interval_seconds=0.0).ownership_window_seconds == 0.0
    assert policy(r=0.0).ownership_window_seconds == 0.0
    assert policy(r=0.0, heartbeat_timeout_seconds=30.0).ownership_window_seconds == 30.0
    assert policy(check_queue_seconds=1.5).ownership_window_seconds == 20.0 + 3.0
    # without checks, failing or not, nothing but the beats keeps (or ends) the lease
    d = Driven(policy(ownership_check_interval_seconds=0.0), check=lambda t: False)
    d.run_until(300)
    assert d.fences() == [] and d.checks == []


def _delivery(poll_count: int, r: int) -> Task:
    return Task.from_json({"taskId": "t1", "workflowInstanceId": "w1", "taskType": "x",
                           "pollCount": poll_count, "referenceTaskName": "x_ref",
                           "responseTimeoutSeconds": r})


@pytest.mark.parametrize(("r", "heartbeat_timeout", "interval", "expected"), [
    (60, None, 5.0, 60.0),  # the task's R: the longest any holder's window is
    (60, 30.0, 5.0, 60.0),  # (R even when ours is shorter: another runner may be set otherwise)
    (0, 30.0, 5.0, 30.0),  # no R: our own lease timeout
    (0, None, 5.0, 5.0 + 0.5 + 10.0 + 0.4),  # no lease deadline at all: counts on the checks
    (60, None, 0.0, 10.0 + 0.4),  # no checks: nothing bounds it, the grace and the margin
])
def test_the_redelivery_wait_is_the_previous_holders_ownership_window(
    r: int, heartbeat_timeout: float | None, interval: float, expected: float
) -> None:
    p = LeasePolicy.from_task(_delivery(2, r), heartbeat_timeout_seconds=heartbeat_timeout,
                              kill_grace_seconds=10.0, ownership_check_interval_seconds=interval)
    assert p.start_delay_seconds == pytest.approx(expected)
    first = LeasePolicy.from_task(_delivery(1, r), heartbeat_timeout_seconds=heartbeat_timeout,
                                  kill_grace_seconds=10.0, ownership_check_interval_seconds=interval)
    assert first.start_delay_seconds == 0.0


def test_a_previous_holder_is_dead_before_the_next_holders_wait_ends_whatever_its_checks_do() -> None:
    """The two halves together: a holder whose last confirming check started before the re-poll (any
    later one would have seen the new pollCount) is killed by the time the wait after that re-poll ends,
    for each R the simulator draws and each way its checks can fail."""
    for r in (10, 20, 30, 60):
        for last_ok in (0.5, 7.0, 33.0):
            holder = Driven(policy(r=float(r), kill_grace_seconds=10.0), check=lambda t, x=last_ok: t < x)
            holder.run_until(last_ok + 3 * r)
            confirmed = max(t for t, ok in holder.checks if ok) if any(ok for _, ok in holder.checks) else 0.0
            repoll = confirmed + 0.001  # the earliest the re-poll can be: right after that check
            wait = LeasePolicy.from_task(_delivery(2, r), kill_grace_seconds=10.0,
                                         ownership_check_interval_seconds=5.0).start_delay_seconds
            kills = [t for t, a in holder.fences() if isinstance(a, KillTree)]
            assert kills, (r, last_ok)
            assert kills[0] < repoll + wait, (r, last_ok, kills[0], repoll + wait)
