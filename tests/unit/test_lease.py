"""The pure lease state machine, driven by a FakeClock and scripted events (no threads, no sleeps)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leasecore.backoff import Backoff
from leasecore.clock import FakeClock
from leasecore.errors import ConfigError
from leasecore.lease import (
    FENCE_MARGIN_SECONDS,
    Action,
    CheckOwnership,
    FenceReason,
    KillTree,
    Lease,
    LeasePolicy,
    LeaseState,
    SendHeartbeat,
    TerminateTree,
    ownership_lost_reason,
)
from leasecore.models import Task, TaskOwnership, TaskStatus

T0 = 1000.0  # FakeClock's start; the poll happens here


def policy(r: float = 10.0, **overrides: object) -> LeasePolicy:
    """R=10 s (beats every 8 s); no kill grace and no fence margin, so that the cadence tests count in
    whole seconds (a test of fencing sets both: TERM at deadline - grace - margin, KILL at deadline -
    margin); ownership checks off unless a test turns them on."""
    values: dict[str, object] = {
        "ownership_check_interval_seconds": 0.0, "kill_grace_seconds": 0.0, "fence_margin_seconds": 0.0,
    }
    values.update(overrides)
    return LeasePolicy(response_timeout_seconds=r, **values)  # type: ignore[arg-type]


def own(
    status: TaskStatus = TaskStatus.IN_PROGRESS, poll_count: int = 1, worker: str | None = "host"
) -> TaskOwnership:
    """What an ownership check reads back; by default: still ours (IN_PROGRESS, our pollCount 1)."""
    return TaskOwnership(status, poll_count, worker)


class Harness:
    """A lease with a perfect timer: ``run_until`` ticks it exactly at each ``next_wakeup``."""

    def __init__(self, lease_policy: LeasePolicy, *, poll_count: int = 1) -> None:
        self.clock = FakeClock(start=T0)
        self.lease = Lease(lease_policy, polled_at=T0, poll_count=poll_count)
        self.log: list[tuple[float, Action]] = []

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def run_until(self, until: float) -> list[tuple[float, Action]]:
        start = len(self.log)
        while (wake := self.lease.next_wakeup()) is not None and wake <= until:
            self.clock.advance(max(0.0, wake - self.now))
            actions = self.lease.on_tick(self.now)
            if not actions and self.lease.next_wakeup() == wake:
                raise AssertionError(f"busy loop: wake-up {wake} produced nothing")
            self.record(actions)
        self.clock.advance(max(0.0, until - self.now))
        return self.log[start:]

    def record(self, actions: list[Action]) -> list[Action]:
        self.log += [(self.now, action) for action in actions]
        return actions

    def at(self, t: float) -> float:
        """Run to T0 + t and return that time."""
        self.run_until(T0 + t)
        return self.now

    def beats(self) -> list[tuple[float, SendHeartbeat]]:
        return [(t, a) for t, a in self.log if isinstance(a, SendHeartbeat)]

    def fences(self) -> list[tuple[float, Action]]:
        return [(t, a) for t, a in self.log if isinstance(a, TerminateTree | KillTree)]


# ----- policy ------------------------------------------------------------------------------------


def test_policy_from_task_takes_r_and_the_hard_ceiling_from_the_task() -> None:
    # Given a polled task with R=30 and timeoutSeconds=600
    task = Task(
        task_id="t1", workflow_id="w1", task_type="x", response_timeout_seconds=30, timeout_seconds=600
    )
    # When the policy is derived with defaults
    p = LeasePolicy.from_task(task, kill_grace_seconds=3.0, exec_timeout_seconds=60.0)
    # Then R, the hard ceiling and the overrides are in it, and the heartbeat timeout defaults to R
    assert (p.response_timeout_seconds, p.hard_timeout_seconds, p.exec_timeout_seconds) == (30, 600, 60.0)
    assert p.kill_grace_seconds == 3.0
    assert p.lease_timeout_seconds == 30
    # beats at 0.8 of the time from an ack to its TERM point: R - grace - margin
    assert p.effective_kill_grace_seconds == 3.0 and not p.kill_grace_capped
    assert p.heartbeat_interval_seconds == pytest.approx(0.8 * (30 - 3.0 - FENCE_MARGIN_SECONDS))
    assert p.start_delay_seconds == 0.0  # a first delivery starts at once
    assert p.ownership_check_interval_seconds == 5.0
    assert p.http_timeout_seconds == 10.0


_DERIVED = ("lease_timeout_seconds", "kill_grace_cap_seconds", "effective_kill_grace_seconds",
            "fence_lead_seconds", "ownership_window_seconds", "ownership_check_every_seconds",
            "heartbeat_interval_seconds")  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    r=st.sampled_from([0, 2, 30]), timeout=st.sampled_from([0, 1, 30, 600]),
    elapsed_ms=st.integers(-2000, 900_000), poll_count=st.integers(0, 3),
    grace=st.sampled_from([0.0, 3.0, 10.0]), checks=st.sampled_from([0.0, 5.0]),
    queue=st.sampled_from([0.0, 0.5]),
)  # fmt: skip
def test_from_task_gives_the_policy_its_numbers_build_whatever_it_shares(
    r: int, timeout: int, elapsed_ms: int, poll_count: int, grace: float, checks: float, queue: float
) -> None:
    # from_task shares one policy per task type's numbers and puts each delivery's elapsed time and
    # start delay on a copy: the copy must be what building the policy from all its numbers gives,
    # fields and derived numbers alike, however many deliveries of the type came before.
    from leasecore.handover import redelivery_wait_seconds

    start = 1_700_000_000_000
    task = Task(task_id="t1", workflow_id="w1", task_type="x", response_timeout_seconds=r,
                timeout_seconds=timeout, poll_count=poll_count, start_time_ms=start,
                update_time_ms=start + elapsed_ms)  # fmt: skip
    built = LeasePolicy(response_timeout_seconds=r, kill_grace_seconds=grace, hard_timeout_seconds=timeout,
                        hard_elapsed_seconds=task.server_elapsed_seconds if timeout > 0 else 0.0,
                        ownership_check_interval_seconds=checks, check_queue_seconds=queue)  # fmt: skip
    wait = redelivery_wait_seconds(
        task, ownership_check_interval_seconds=checks,
        redelivery_grace_seconds=built.redelivery_grace_seconds,
        kill_grace_seconds=built.effective_kill_grace_seconds,
        fence_margin_seconds=built.fence_margin_seconds,
        check_queue_seconds=queue, lease_timeout_seconds=built.lease_timeout_seconds,
    )  # fmt: skip
    if wait > 0:
        built = dataclasses.replace(built, start_delay_seconds=wait)
    got = LeasePolicy.from_task(task, kill_grace_seconds=grace, ownership_check_interval_seconds=checks,
                                check_queue_seconds=queue)  # fmt: skip
    assert got == built and hash(got) == hash(built)
    assert [getattr(got, name) for name in _DERIVED] == [getattr(built, name) for name in _DERIVED]
    assert got.hard_elapsed_seconds == (max(0.0, elapsed_ms / 1000) if timeout > 0 else 0.0)
    if timeout > 0 and elapsed_ms > 0:  # a later delivery of the type shares the numbers, not the elapsed
        fresh = dataclasses.replace(task, update_time_ms=start)
        again = LeasePolicy.from_task(fresh, kill_grace_seconds=grace,
                                      ownership_check_interval_seconds=checks, check_queue_seconds=queue)
        assert again.hard_elapsed_seconds == 0.0 and got.hard_elapsed_seconds > 0


@pytest.mark.parametrize(
    ("kwargs", "interval"),
    [
        ({"r": 10.0}, 8.0),
        ({"r": 1.25}, 1.0),  # exactly the 1 s minimum: still beats
        ({"r": 1.0}, None),  # 0.8 s < 1 s: no heartbeats at all
        ({"r": 10.0, "lease_extend_enabled": False}, None),
        ({"r": 0.0}, None),  # no response timeout: nothing to extend
        ({"r": 10.0, "heartbeat_timeout_seconds": 5.0}, 4.0),  # beat before our own, shorter fence
        ({"r": 10.0, "heartbeat_timeout_seconds": 60.0}, 8.0),  # the server still needs a beat per R
    ],
)
def test_heartbeat_interval_is_0_8_of_the_shorter_window_and_at_least_1_second(
    kwargs: dict[str, object], interval: float | None
) -> None:
    got = policy(**kwargs).heartbeat_interval_seconds  # type: ignore[arg-type]
    assert got == (pytest.approx(interval) if interval is not None else None)


@pytest.mark.parametrize(
    "bad",
    [
        {"kill_grace_seconds": -1.0},
        {"heartbeat_timeout_seconds": -1.0},
        {"heartbeat_ratio": 0.0},
        {"heartbeat_ratio": 1.5},
        {"http_timeout_seconds": 0.0},
        {"hard_timeout_seconds": float("nan")},
    ],
)
def test_invalid_policies_are_config_errors(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        policy(**bad)


# ----- heartbeats --------------------------------------------------------------------------------


def test_first_heartbeat_is_due_at_0_8_r_after_the_poll_with_its_timeout_capped() -> None:
    # Given R=100 s (lease ends at poll+100, beat at poll+80) and an HTTP cap of 10 s
    h = Harness(policy(r=100.0))
    # When time reaches poll + 80
    actions = h.run_until(T0 + 80)
    # Then exactly one heartbeat went out, on time, with the 10 s cap as its timeout
    assert actions == [(T0 + 80, SendHeartbeat(timeout_seconds=10.0, due_at=T0 + 80, expires_at=T0 + 100))]


def test_heartbeat_timeout_never_exceeds_the_time_left_on_the_lease() -> None:
    # Given R=10 s: the beat at poll+8 has only 2 s of lease left
    h = Harness(policy(r=10.0))
    # When it is sent
    [(_, beat)] = h.run_until(T0 + 8)
    # Then its timeout is those 2 s, not the 10 s cap
    assert isinstance(beat, SendHeartbeat)
    assert beat.timeout_seconds == pytest.approx(2.0)


def test_next_heartbeat_counts_from_the_send_time_of_the_acknowledged_one() -> None:
    # Given a beat sent at poll+8 whose ack arrives 1.5 s later
    h = Harness(policy(r=10.0))
    h.at(8)
    sent_at = h.now
    h.clock.advance(1.5)
    h.lease.on_heartbeat_ok(h.now, sent_at)
    # When time runs on to poll+16
    actions = h.run_until(T0 + 16)
    # Then the next beat is due 8 s after the SEND time (poll+16), not after the ack (poll+17.5)
    assert [t for t, a in actions if isinstance(a, SendHeartbeat)] == [T0 + 16]
    assert h.lease.lease_deadline == pytest.approx(T0 + 18)


def test_a_beat_sent_late_keeps_the_cadence_but_the_deadline_counts_from_its_send() -> None:
    # Given R=10 s: a beat due at poll+8 that a busy sender only sent at poll+8.3 (acked at poll+8.4)
    h = Harness(policy(r=10.0))
    [(_, beat)] = h.run_until(T0 + 8)
    assert isinstance(beat, SendHeartbeat) and beat.due_at == T0 + 8
    h.clock.advance(0.4)
    h.lease.on_heartbeat_ok(h.now, sent_at=T0 + 8.3)
    # When time runs on
    actions = h.run_until(T0 + 17)
    # Then the next beat is due one interval after the late beat was PLANNED (poll+16, not poll+16.3):
    # the lateness is absorbed once instead of stretching every later gap the server sees ...
    assert [t for t, a in actions if isinstance(a, SendHeartbeat)] == [T0 + 16]
    # ... while the lease deadline still counts from the actual send time (conservative)
    assert h.lease.lease_deadline == pytest.approx(T0 + 18.3)


def test_a_very_late_beat_is_followed_after_at_least_half_an_interval() -> None:
    # Given R=10 s and beats every 3 s (ratio 0.3): the beat due at poll+3 only went out at poll+5
    h = Harness(policy(r=10.0, heartbeat_ratio=0.3))
    h.run_until(T0 + 3)
    h.clock.advance(2.1)
    h.lease.on_heartbeat_ok(h.now, sent_at=T0 + 5)
    # When time runs on
    actions = h.run_until(T0 + 9)
    # Then the next is not due on the plan (poll+6, only 1 s after the send: a burst after a stall)
    # but half an interval after the send (poll+6.5)
    assert [t for t, a in actions if isinstance(a, SendHeartbeat)] == [pytest.approx(T0 + 6.5)]


def test_a_task_never_has_two_heartbeats_in_flight() -> None:
    # Given a beat in flight that never answers (its timeout is bounded, but the engine is slow)
    h = Harness(policy(r=10.0))
    h.at(8)
    # When time runs on to the lease deadline
    h.at(10)
    # Then no second beat was started, and the lease fenced at its deadline (no grace, no margin here)
    assert len(h.beats()) == 1
    assert h.fences() == [
        (T0 + 10, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 10, KillTree(FenceReason.LEASE_EXPIRED)),
    ]


def test_failed_heartbeats_are_retried_after_1_then_1_5_seconds_then_sooner_until_the_term_point() -> None:
    # Given R=20, grace 2, margin 0.5: the TERM point is poll+17.5, beats every 0.8 x 17.5 = 14 s;
    # and every beat failing at once
    h = Harness(policy(r=20.0, kill_grace_seconds=2.0, fence_margin_seconds=0.5))
    while h.now < T0 + 30:
        actions = h.run_until(min(h.lease.next_wakeup() or T0 + 30, T0 + 30))
        for t, action in actions:
            if isinstance(action, SendHeartbeat):
                h.record(h.lease.on_heartbeat_failed(t))
    # Then attempts went out at 14, 15 (backoff 1 s), 16.25 (1.5 s would be past half the 2.5 s
    # left), then at half the time left, 16.875, 17.1875, each with its timeout bounded by the time
    # left before the TERM point, and none with less than the 0.1 s minimum left
    assert [round(t - T0, 4) for t, _ in h.beats()] == [14.0, 15.0, 16.25, 16.875, 17.1875]
    assert [round(b.timeout_seconds, 4) for _, b in h.beats()] == [3.5, 2.5, 1.25, 0.625, 0.3125]
    # And the tree was terminated at the TERM point and killed at deadline - margin
    assert [(round(t - T0, 4), a) for t, a in h.fences()] == [
        (17.5, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (19.5, KillTree(FenceReason.LEASE_EXPIRED)),
    ]
    assert h.lease.view().consecutive_failures == 5


def test_retries_continue_every_2_seconds_while_the_lease_lasts() -> None:
    # Given R=100 s and a server outage from the first beat on
    h = Harness(policy(r=100.0))
    h.at(80)
    for _ in range(8):
        h.record(h.lease.on_heartbeat_failed(h.now))
        h.run_until(h.lease.next_wakeup() or h.now)
    # Then the gaps between attempts are 1, 1.5, then 2 s each
    times = [t for t, _ in h.beats()]
    assert [round(b - a, 3) for a, b in itertools.pairwise(times)] == [1.0, 1.5] + [2.0] * 6


def test_no_attempt_starts_with_less_than_the_minimum_time_left() -> None:
    # Given a lease ending at poll+10 and a beat sent at poll+8 that fails at poll+9.72: its retry
    # comes MIN_RETRY_GAP (0.25 s) later, at poll+9.97, with 0.03 s left
    h = Harness(policy(r=10.0, retry_backoff=Backoff(initial_seconds=1.95, multiplier=1.0, max_seconds=1.95)))
    h.at(8)
    h.clock.advance(1.72)
    h.record(h.lease.on_heartbeat_failed(h.now))
    # When time runs to the deadline
    h.at(10)
    # Then that retry was never started
    assert [t for t, _ in h.beats()] == [T0 + 8]
    assert h.fences() == [
        (T0 + 10, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 10, KillTree(FenceReason.LEASE_EXPIRED)),
    ]


def test_a_404_on_a_heartbeat_fences_at_once_and_kills_after_the_grace() -> None:
    # Given a beat in flight (R=100: the 3 s grace is not capped, the beat is at poll+0.8 x 97)
    h = Harness(policy(r=100.0, kill_grace_seconds=3.0))
    h.at(77.6)
    # When the server answers 404
    h.clock.advance(0.2)
    actions = h.record(h.lease.on_heartbeat_not_found(h.now))
    # Then the tree is terminated at once for OWNERSHIP_LOST, killed 3 s later, and no beat follows
    assert actions == [TerminateTree(FenceReason.OWNERSHIP_LOST)]
    h.at(160)
    assert [(round(t - T0, 3), a) for t, a in h.fences()] == [
        (77.8, TerminateTree(FenceReason.OWNERSHIP_LOST)),
        (80.8, KillTree(FenceReason.OWNERSHIP_LOST)),
    ]
    assert len(h.beats()) == 1
    assert h.lease.fence_reason is FenceReason.OWNERSHIP_LOST


def test_an_older_ack_never_moves_the_lease_backwards() -> None:
    # Given a lease whose newest ack is for a beat sent at poll+8
    h = Harness(policy(r=10.0))
    h.at(8)
    h.lease.on_heartbeat_ok(h.now, T0 + 8)
    # When an ack for an older beat (sent at poll+3) arrives afterwards
    h.lease.on_heartbeat_ok(h.now, T0 + 3)
    # Then the deadline and the next beat still count from poll+8
    assert h.lease.lease_deadline == T0 + 18
    assert h.lease.view().next_heartbeat_at == T0 + 16


def test_an_ack_before_the_deadline_extends_the_lease_and_nothing_is_fenced() -> None:
    # Given a beat sent at poll+8 that hangs until just before the deadline
    h = Harness(policy(r=10.0))
    h.at(8)
    h.clock.advance(1.99)
    # When its ack arrives at poll+9.99
    h.record(h.lease.on_heartbeat_ok(h.now, T0 + 8))
    h.at(17.9)
    # Then the lease now ends at poll+18 and the tree was never touched
    assert h.fences() == []
    assert h.lease.state is LeaseState.RUNNING


def test_an_ack_processed_after_the_term_point_does_not_cancel_the_fence() -> None:
    # Given R=10, grace 2, margin 0.5: TERM point poll+7.5, KILL at poll+9.5, beats every 6 s; a beat
    # sent in time (poll+6) whose ack is only processed after the TERM point (poll+7.8)
    h = Harness(policy(r=10.0, kill_grace_seconds=2.0, fence_margin_seconds=0.5))
    h.at(6)
    assert len(h.beats()) == 1
    h.clock.advance(1.8)
    # When the late ack is fed in before any tick at the TERM point
    actions = h.record(h.lease.on_heartbeat_ok(h.now, T0 + 6))
    # Then the TERM point passed first: TerminateTree now, KillTree at deadline - margin, no more beats
    assert actions == [TerminateTree(FenceReason.LEASE_EXPIRED)]
    h.at(30)
    assert h.fences()[-1] == (T0 + 9.5, KillTree(FenceReason.LEASE_EXPIRED))
    assert len(h.beats()) == 1
    assert h.lease.view().lease_deadline == T0 + 10  # the late ack did not move the deadline
    assert h.lease.view().last_ack_at == T0


def test_the_kill_is_never_later_than_deadline_minus_margin_even_after_a_late_tick() -> None:
    # Given a lease that expires at poll+10, a 5 s grace (capped at R/4 = 2.5 s) and a 0.5 s margin:
    # TERM point poll+7, KILL at poll+9.5
    h = Harness(policy(r=10.0, lease_extend_enabled=False, kill_grace_seconds=5.0, fence_margin_seconds=0.5))
    # When the first tick after the TERM point only comes at poll+8 (a slow timer thread)
    h.clock.advance(8)
    h.record(h.lease.on_tick(h.now))
    h.at(30)
    # Then the KILL still lands at poll+9.5, before the deadline
    assert h.fences() == [
        (T0 + 8, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 9.5, KillTree(FenceReason.LEASE_EXPIRED)),
    ]
    # And the late TERM carries the TERM point and the capped grace, so the fork server's own KILL
    # lands at deadline - margin too
    term = h.fences()[0][1]
    assert isinstance(term, TerminateTree) and term.at == T0 + 7 and term.grace_seconds == 2.5


def test_with_lease_extension_disabled_no_beats_but_the_deadline_is_still_enforced() -> None:
    # Given --no-lease-extend and R=10: the server will time the task out at poll+10 anyway
    h = Harness(policy(r=10.0, lease_extend_enabled=False, kill_grace_seconds=1.0, fence_margin_seconds=0.5))
    # When time passes the deadline
    h.at(20)
    # Then no heartbeat was sent and the tree was dead by poll+10: TERM at 8.5, KILL at 9.5
    assert h.beats() == []
    assert h.fences() == [
        (T0 + 8.5, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 9.5, KillTree(FenceReason.LEASE_EXPIRED)),
    ]


def test_without_a_response_timeout_there_is_no_lease_deadline() -> None:
    # Given R=0 (the server never response-times this task out) and no explicit heartbeat timeout
    h = Harness(policy(r=0.0))
    # Then nothing is ever due
    assert h.lease.next_wakeup() is None
    assert h.lease.view().lease_deadline is None


@pytest.mark.parametrize("extend", [True, False])
def test_a_heartbeat_timeout_longer_than_r_is_capped_at_r(extend: bool) -> None:
    # Given R=2 and a configured heartbeat timeout of 10 s: past poll+2 the server may time the task
    # out and give its retry to another worker (review issue: two copies ran for ~8 s)
    p = policy(r=2.0, heartbeat_timeout_seconds=10.0, lease_extend_enabled=extend, kill_grace_seconds=1.0)
    h = Harness(p)
    # When no beat is ever acknowledged (cut off from the server, or extension off)
    for t, action in h.run_until(T0 + 20):
        if isinstance(action, SendHeartbeat):
            h.record(h.lease.on_heartbeat_failed(t))
    # Then the lease ends at R, not at 10 s, and the policy says it was capped; the grace too (R/4):
    # the tree is TERMed at poll+1.5 and KILLed at poll+2, when the server may time the task out
    assert p.lease_timeout_seconds == 2.0 and p.heartbeat_timeout_capped
    assert p.effective_kill_grace_seconds == 0.5 and p.kill_grace_capped
    assert h.fences() == [
        (T0 + 1.5, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 2, KillTree(FenceReason.LEASE_EXPIRED)),
    ]


@pytest.mark.parametrize(
    ("r", "configured", "lease", "capped"),
    [
        (10.0, None, 10.0, False),  # default: R
        (10.0, 5.0, 5.0, False),  # shorter than R: our own, earlier fence
        (10.0, 10.0, 10.0, False),
        (10.0, 60.0, 10.0, True),  # longer: cut down to R
        (0.0, 60.0, 60.0, False),  # no R: the heartbeat timeout is the only deadline
        (0.0, None, 0.0, False),  # neither: no deadline
    ],
)
def test_the_heartbeat_timeout_only_ever_shortens_the_lease(
    r: float, configured: float | None, lease: float, capped: bool
) -> None:
    p = policy(r=r, heartbeat_timeout_seconds=configured)
    assert (p.lease_timeout_seconds, p.heartbeat_timeout_capped) == (lease, capped)


def test_a_redelivered_poll_extends_the_lease_like_an_ack() -> None:
    # Given a running lease (deadline poll+10) that is delivered again at poll+5
    h = Harness(policy(r=10.0))
    h.at(5)
    h.lease.on_redelivered(h.now, T0 + 5)
    # Then the poll counts as an ack: deadline poll+15, next beat poll+13
    assert h.lease.lease_deadline == T0 + 15
    assert h.lease.view().next_heartbeat_at == T0 + 13


# ----- ownership ---------------------------------------------------------------------------------


def test_ownership_is_checked_every_interval_and_in_progress_changes_nothing() -> None:
    # Given checks every 5 s and a lease kept alive by acks
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0))
    # When each check answers IN_PROGRESS at once
    for _ in range(3):
        h.run_until(h.lease.next_wakeup() or h.now)
        h.record(h.lease.on_ownership(h.now, own()))
    # Then checks went out at 5, 10, 15 and the tree was not touched
    checks = [(t, a) for t, a in h.log if isinstance(a, CheckOwnership)]
    assert [t - T0 for t, _ in checks] == [5.0, 10.0, 15.0]
    assert h.fences() == []


@pytest.mark.parametrize(
    "status",
    [
        TaskStatus.CANCELED, TaskStatus.TIMED_OUT, TaskStatus.COMPLETED, TaskStatus.FAILED,
        TaskStatus.SCHEDULED,  # re-queued (a bare IN_PROGRESS update, an admin requeue): handed out again
        None,
    ],
)  # fmt: skip
def test_a_terminal_status_or_404_fences_for_ownership_lost_at_once(status: TaskStatus | None) -> None:
    # Given a check in flight
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0, kill_grace_seconds=2.0))
    h.at(5)
    # When it answers a terminal status (None = 404)
    actions = h.lease.on_ownership(h.now, None if status is None else own(status))
    # Then TERM at once, KILL after the grace, and the runner is told to report nothing
    assert actions == [TerminateTree(FenceReason.OWNERSHIP_LOST)]
    assert h.lease.on_tick(T0 + 7) == [KillTree(FenceReason.OWNERSHIP_LOST)]
    assert h.lease.fence_reason is FenceReason.OWNERSHIP_LOST


def test_a_failed_ownership_check_changes_nothing_and_is_retried_at_the_next_interval() -> None:
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0))
    h.at(5)
    # When the check fails (network)
    assert h.lease.on_ownership_check_failed(h.now) == []
    # Then the next check follows 5 s later and nothing was fenced
    actions = h.run_until(T0 + 10)
    assert [a for _, a in actions] == [
        CheckOwnership(timeout_seconds=10.0, due_at=T0 + 10, expires_at=T0 + 100)
    ]
    assert h.lease.state is LeaseState.RUNNING


def test_the_first_failed_heartbeat_brings_an_ownership_check_forward() -> None:
    # Given checks every 30 s (R = 100 leaves them that interval) and a beat failing at poll+8
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=30.0))
    h.at(8)
    actions = h.lease.on_heartbeat_failed(h.now)
    # Then a check goes out at once (is the task still ours at all?)
    assert [type(a) for a in actions] == [CheckOwnership]


def test_ownership_lost_overrides_a_shutdown_already_under_way() -> None:
    # Given a tree being terminated for SHUTDOWN
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0, kill_grace_seconds=10.0))
    assert h.lease.on_shutdown(h.now) == [TerminateTree(FenceReason.SHUTDOWN)]
    # When an ownership check then says CANCELED
    h.at(5)
    actions = h.lease.on_ownership(h.now, own(TaskStatus.CANCELED))
    # Then no second TERM is sent, but the runner must now report nothing
    assert actions == []
    assert h.lease.fence_reason is FenceReason.OWNERSHIP_LOST


def test_a_task_polled_again_by_someone_else_is_lost_once_a_second_look_confirms_it() -> None:
    # Given our delivery had pollCount 1, and checks every 5 s
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0, kill_grace_seconds=2.0))
    h.at(5)
    # When a check reads IN_PROGRESS with pollCount 2, from the same (default, hostname) worker id
    assert h.lease.on_ownership(h.now, own(poll_count=2, worker="host")) == []
    # Then it looks again after the 0.5 s grace (the new delivery might be ours, still on its way)
    actions = h.run_until(T0 + 6)
    assert [(t - T0, a) for t, a in actions] == [
        (5.5, CheckOwnership(timeout_seconds=10.0, due_at=T0 + 5.5, expires_at=T0 + 98))
    ]
    # And when that check still reads pollCount 2, the tree is fenced for OWNERSHIP_LOST
    assert h.lease.on_ownership(h.now, own(poll_count=2)) == [TerminateTree(FenceReason.OWNERSHIP_LOST)]
    assert h.lease.fence_reason is FenceReason.OWNERSHIP_LOST
    assert "polled again" in (h.lease.lost_reason or "") and "pollCount 2, ours 1" in (
        h.lease.lost_reason or ""
    )


def test_without_a_grace_a_higher_poll_count_fences_at_once() -> None:
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0, redelivery_grace_seconds=0.0,
                       kill_grace_seconds=1.0))
    h.at(5)
    assert h.lease.on_ownership(h.now, own(poll_count=3)) == [TerminateTree(FenceReason.OWNERSHIP_LOST)]


def test_a_redelivery_to_us_makes_its_poll_count_ours() -> None:
    # Given a check that saw pollCount 2 (ours is 1): a confirming check is planned
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0))
    h.at(5)
    h.lease.on_ownership(h.now, own(poll_count=2))
    # When the runner tracks the re-delivery (pollCount 2) before the confirming check answers
    h.clock.advance(0.5)
    h.lease.on_redelivered(h.now, h.now, poll_count=2)
    h.at(6)
    h.record(h.lease.on_ownership(h.now, own(poll_count=2)))
    # Then nothing is fenced, checks go back to every 5 s, and a re-poll after that is measured from 2
    h.at(11)
    h.record(h.lease.on_ownership(h.now, own(poll_count=2)))
    assert h.fences() == [] and h.lease.poll_count == 2
    assert h.lease.view().next_heartbeat_at == T0 + 5.5 + 80  # the re-delivery also counted as an ack


def test_an_older_redelivery_never_lowers_the_poll_count_we_hold() -> None:
    h = Harness(policy(r=100.0), poll_count=4)
    h.lease.on_redelivered(h.now, h.now, poll_count=3)
    assert h.lease.poll_count == 4


def test_the_worker_id_is_not_compared() -> None:
    # Given several runners on one host share the default worker id: another id at our pollCount
    # is still our delivery (our own update may have written it), and only the pollCount decides
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0))
    h.at(5)
    assert h.lease.on_ownership(h.now, own(poll_count=1, worker="other-host")) == []
    assert h.lease.fence_reason is None


def test_an_unknown_poll_count_is_never_compared() -> None:
    # Given a delivery without pollCount (0): a poll always makes it >= 1, so 0 means "not known"
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0), poll_count=0)
    h.at(5)
    assert h.lease.on_ownership(h.now, own(poll_count=7)) == []
    h.at(6)
    assert h.fences() == []


@pytest.mark.parametrize(
    ("read", "fragment"),
    [
        (None, "404"),
        (own(TaskStatus.CANCELED), "CANCELED"),
        (own(TaskStatus.SCHEDULED), "re-queued"),
        (own(poll_count=3, worker="h2"), "polled again by worker 'h2' (pollCount 3, ours 2)"),
        (own(poll_count=3, worker=None), "polled again (pollCount 3, ours 2)"),
    ],
)
def test_ownership_lost_reason_says_why(read: TaskOwnership | None, fragment: str) -> None:
    assert fragment in (ownership_lost_reason(read, 2) or "")


@pytest.mark.parametrize("read", [own(poll_count=2), own(poll_count=1), own(poll_count=0)])
def test_in_progress_at_or_below_our_poll_count_is_still_ours(read: TaskOwnership) -> None:
    assert ownership_lost_reason(read, 2) is None


# ----- hard and exec timeouts ----------------------------------------------------------------------


def test_the_hard_timeout_counts_from_the_poll_of_a_first_delivery_and_heartbeats_cannot_extend_it() -> None:
    # Given timeoutSeconds=20, R=10, grace 1, margin 0.5, and every beat acknowledged at once
    h = Harness(policy(r=10.0, hard_timeout_seconds=20.0, kill_grace_seconds=1.0, fence_margin_seconds=0.5))
    while h.now < T0 + 25:
        for t, action in h.run_until(min(h.lease.next_wakeup() or T0 + 25, T0 + 25)):
            if isinstance(action, SendHeartbeat):
                h.record(h.lease.on_heartbeat_ok(t, t))
    # Then the tree is fenced for HARD_TIMEOUT although the lease was fine, dead by poll+20 when the
    # server times it out: TERM at 18.5, KILL at 19.5
    assert h.fences() == [
        (T0 + 18.5, TerminateTree(FenceReason.HARD_TIMEOUT)),
        (T0 + 19.5, KillTree(FenceReason.HARD_TIMEOUT)),
    ]
    assert h.lease.view().hard_deadline == T0 + 20


def server_task(*, timeout: int, start_ms: int | None, update_ms: int | None, delay: int = 0) -> Task:
    data: dict[str, object] = {
        "taskId": "t1", "workflowInstanceId": "w1", "taskType": "x", "responseTimeoutSeconds": 10,
        "pollCount": 2, "startDelayInSeconds": delay,
        "workflowTask": {"taskDefinition": {"timeoutSeconds": timeout}},
    }  # fmt: skip
    if start_ms is not None:
        data["startTime"] = start_ms
    if update_ms is not None:
        data["updateTime"] = update_ms
    return Task.from_json(data)


def test_the_hard_timeout_of_a_redelivered_task_counts_from_its_server_start_time() -> None:
    # Given a task first started 30 s before this poll (a re-delivery keeps startTime), timeoutSeconds 100.
    # The server's clock is far off ours: only its own two timestamps are compared.
    start = 4_000_000_000_000  # year 2096: skew does not matter
    task = server_task(timeout=100, start_ms=start, update_ms=start + 30_000)
    p = LeasePolicy.from_task(task, ownership_check_interval_seconds=0.0, kill_grace_seconds=1.0)
    assert (p.hard_timeout_seconds, p.hard_elapsed_seconds) == (100, 30.0)
    h = Harness(p)
    # When time passes, every beat acknowledged
    while h.now < T0 + 75:
        for t, action in h.run_until(min(h.lease.next_wakeup() or T0 + 75, T0 + 75)):
            if isinstance(action, SendHeartbeat):
                h.record(h.lease.on_heartbeat_ok(t, t))
    # Then the tree is dead by poll + 70, when the server's own check fires: KILL at 70 - margin
    assert h.lease.view().hard_deadline == T0 + 70
    m = FENCE_MARGIN_SECONDS
    assert [(round(t - T0, 6), a) for t, a in h.fences()] == [
        (round(70 - 1 - m, 6), TerminateTree(FenceReason.HARD_TIMEOUT)),
        (round(70 - m, 6), KillTree(FenceReason.HARD_TIMEOUT)),
    ]


def test_the_start_delay_is_not_counted() -> None:
    task = server_task(timeout=100, start_ms=1_000_000, update_ms=1_000_000 + 30_000, delay=10)
    assert LeasePolicy.from_task(task).hard_elapsed_seconds == 20.0


def test_a_task_past_its_hard_timeout_on_the_server_is_fenced_at_once() -> None:
    task = server_task(timeout=60, start_ms=1_000_000, update_ms=1_000_000 + 61_000)
    h = Harness(LeasePolicy.from_task(task, ownership_check_interval_seconds=0.0))
    # (both at once: the server timed it out already, so its KILL point has passed too)
    fences = [TerminateTree(FenceReason.HARD_TIMEOUT), KillTree(FenceReason.HARD_TIMEOUT)]
    assert h.lease.on_tick(h.now) == fences


@pytest.mark.parametrize(
    ("start_ms", "update_ms"),
    [(None, 5_000), (5_000, None), (None, None), (0, 5_000), (9_000, 5_000)],  # missing, or nonsense
)
def test_without_usable_server_timestamps_the_hard_timeout_counts_from_the_poll(
    start_ms: int | None, update_ms: int | None
) -> None:
    task = server_task(timeout=100, start_ms=start_ms, update_ms=update_ms)
    p = LeasePolicy.from_task(task)
    assert p.hard_elapsed_seconds == 0.0
    assert Lease(p, polled_at=T0).view().hard_deadline == T0 + 100


def test_task_from_json_reads_the_server_timestamps_tolerantly() -> None:
    task = Task.from_json({"taskId": "t", "startTime": "12", "updateTime": None, "startDelayInSeconds": "x"})
    assert (task.start_time_ms, task.update_time_ms, task.start_delay_seconds) == (12, 0, 0)
    assert task.server_elapsed_seconds == 0.0


def test_the_exec_timeout_counts_from_the_child_start() -> None:
    # Given an exec timeout of 30 s and a child started 2 s after the poll
    h = Harness(policy(r=100.0, exec_timeout_seconds=30.0))
    h.at(2)
    h.lease.on_child_started(h.now)
    # When time passes
    h.at(40)
    # Then it is fenced at poll+32
    assert h.fences()[0] == (T0 + 32, TerminateTree(FenceReason.EXEC_TIMEOUT))


def test_the_exec_timeout_counts_from_the_poll_when_no_child_start_is_reported() -> None:
    h = Harness(policy(r=100.0, exec_timeout_seconds=30.0))
    h.at(40)
    assert h.fences()[0] == (T0 + 30, TerminateTree(FenceReason.EXEC_TIMEOUT))


def test_when_two_deadlines_coincide_the_lease_expiry_wins() -> None:
    h = Harness(policy(r=10.0, lease_extend_enabled=False, hard_timeout_seconds=10.0, kill_grace_seconds=1.0))
    h.at(10)
    assert h.fences() == [
        (T0 + 9, TerminateTree(FenceReason.LEASE_EXPIRED)),
        (T0 + 10, KillTree(FenceReason.LEASE_EXPIRED)),
    ]


# ----- shutdown ----------------------------------------------------------------------------------


def test_shutdown_terminates_now_and_heartbeats_continue_until_reported() -> None:
    # Given a running task (R=10, grace 2: beats every 6.4 s, TERM point 8 s after an ack) and a
    # shutdown at poll+3
    h = Harness(policy(r=10.0, kill_grace_seconds=2.0))
    h.at(3)
    assert h.record(h.lease.on_shutdown(h.now)) == [TerminateTree(FenceReason.SHUTDOWN)]
    # When the child takes a while to die, exits within its grace, and the report does not start
    h.at(4.5)
    h.lease.on_child_exited(h.now)
    h.at(7.0)
    (sent_at, _), = h.beats()
    h.record(h.lease.on_heartbeat_ok(h.now, sent_at))
    h.at(16)
    # Then beats kept the lease alive through it all, each as late as the lease allows (the TERM
    # point - 0.1 s, the last start, - 1 s of room), and no KILL followed the exit
    assert [round(t - T0, 3) for t, _ in h.beats()] == [6.9, 13.8]
    assert h.fences() == [(T0 + 3, TerminateTree(FenceReason.SHUTDOWN))]
    assert h.lease.state is LeaseState.REPORTING


def test_a_drain_keeps_beating_and_fences_at_the_drain_deadline() -> None:
    # Given --drain with a deadline at poll+20 and every beat acknowledged
    h = Harness(policy(r=10.0, kill_grace_seconds=2.0))
    assert h.lease.on_shutdown(h.now, drain_deadline=T0 + 20) == []
    while h.now < T0 + 23:
        for t, action in h.run_until(min(h.lease.next_wakeup() or T0 + 23, T0 + 23)):
            if isinstance(action, SendHeartbeat):
                h.record(h.lease.on_heartbeat_ok(t, t))
    # Then it beat every 6.4 s, and was fenced for SHUTDOWN at 20, killed at 22 (our own deadline:
    # TERM at it, KILL a grace later)
    assert [round(t - T0, 3) for t, _ in h.beats()] == [6.4, 12.8, 19.2]
    assert h.fences() == [
        (T0 + 20, TerminateTree(FenceReason.SHUTDOWN)),
        (T0 + 22, KillTree(FenceReason.SHUTDOWN)),
    ]


def test_a_forced_shutdown_kills_at_once() -> None:
    h = Harness(policy(r=10.0, kill_grace_seconds=2.0))
    h.lease.on_shutdown(h.now)
    h.clock.advance(1)
    assert h.lease.on_force_shutdown(h.now) == [KillTree(FenceReason.SHUTDOWN)]
    assert h.lease.state is LeaseState.KILLING
    assert h.lease.on_force_shutdown(h.now) == []  # a third signal changes nothing


# ----- end of life -------------------------------------------------------------------------------


def test_no_beat_starts_between_the_exit_and_the_final_update_and_beats_resume_if_it_fails() -> None:
    # Given a task (R=10, grace 2: a beat due at 6.4 s, TERM point 7.6 s) whose child exits at 6.0 s
    h = Harness(policy(r=10.0, kill_grace_seconds=2.0))
    h.at(6.0)
    h.lease.on_child_exited(h.now)
    # When its final update starts at 6.45 s (the beat due at 6.4 s held back: it would be in flight
    # beside the update)
    h.at(6.45)
    assert h.beats() == []
    h.record(h.lease.on_final_update_started(h.now))
    h.at(7.0)
    assert h.beats() == []
    # and fails at 7.0 s: the overdue beat goes out at once, so the lease outlives the retries
    h.record(h.lease.on_final_update_failed(h.now))
    assert [round(t - T0, 3) for t, _ in h.beats()] == [7.0]


def test_after_the_child_exits_nothing_is_terminated_or_killed() -> None:
    # Given a tree being terminated after a 404, with a 10 s grace
    h = Harness(policy(r=100.0, kill_grace_seconds=10.0))
    h.at(80)
    h.lease.on_heartbeat_not_found(h.now)
    # When the child exits within the grace
    h.at(81)
    h.lease.on_child_exited(h.now)
    h.at(200)
    # Then there is no KILL, and (ownership lost) no beat either
    assert h.fences() == []
    assert len(h.beats()) == 1
    assert h.lease.state is LeaseState.REPORTING


def test_after_reported_no_action_is_ever_returned() -> None:
    # Given a child that exited with a beat in flight
    h = Harness(policy(r=10.0, ownership_check_interval_seconds=5.0, hard_timeout_seconds=30.0))
    h.at(8)
    h.lease.on_child_exited(h.now)
    # When the report is acknowledged, then every kind of event arrives
    assert h.lease.on_reported(h.now) == []
    h.clock.advance(1)
    assert h.lease.on_heartbeat_ok(h.now, T0 + 8) == []
    assert h.lease.on_heartbeat_failed(h.now) == []
    assert h.lease.on_heartbeat_not_found(h.now) == []
    assert h.lease.on_ownership(h.now, None) == []
    assert h.lease.on_shutdown(h.now) == []
    assert h.lease.on_force_shutdown(h.now) == []
    # Then nothing is ever due again
    assert h.lease.next_wakeup() is None
    assert h.lease.on_tick(T0 + 1000) == []
    assert h.lease.state is LeaseState.DONE


def test_a_404_after_the_child_exited_means_report_nothing() -> None:
    h = Harness(policy(r=10.0))
    h.at(8)
    h.lease.on_child_exited(h.now)
    assert h.lease.on_heartbeat_not_found(h.now) == []
    assert h.lease.fence_reason is FenceReason.OWNERSHIP_LOST


def test_events_with_time_running_backwards_are_treated_as_now() -> None:
    # Given a lease ticked at poll+8 (beat sent)
    h = Harness(policy(r=10.0))
    h.at(8)
    # When a result computed earlier on another thread arrives with an older timestamp
    h.lease.on_heartbeat_failed(T0 + 7.5)
    # Then the retry counts from the newest time seen, poll+8
    assert h.lease.view().next_heartbeat_at == T0 + 9


# ----- the final update --------------------------------------------------------------------------


def test_no_heartbeat_or_check_starts_while_the_final_update_is_in_flight() -> None:
    # Given a child that exited at poll+5, and the final update starting at poll+6 (checks every 5 s)
    h = Harness(policy(r=10.0, ownership_check_interval_seconds=5.0))
    h.at(5)
    h.record(h.lease.on_ownership(h.now, own()))
    h.lease.on_child_exited(h.now)
    h.at(6)
    assert h.lease.on_final_update_started(h.now) == []
    # When the update hangs past the beat's due time (poll+8)
    h.at(9.5)
    # Then no beat was started, and the lease wakes for nothing but its deadline bookkeeping
    assert h.beats() == []
    assert h.lease.view().next_heartbeat_at is None
    # And when the update is acknowledged, nothing ever follows
    h.lease.on_reported(h.now)
    assert h.run_until(T0 + 100) == [] and h.lease.state is LeaseState.DONE


def test_a_failed_final_update_resumes_heartbeats_so_the_lease_outlives_a_slow_report() -> None:
    # Given R=10 (beats every 8 s) and a report whose attempts fail for 40 s: each takes 3.7 s and is
    # retried 0.3 s later; every heartbeat is acknowledged at once
    h = Harness(policy(r=10.0))
    h.lease.on_child_exited(h.now)

    def run_acking(until: float) -> None:
        while h.now < until:
            for t, action in h.run_until(min(h.lease.next_wakeup() or until, until)):
                if isinstance(action, SendHeartbeat):
                    h.record(h.lease.on_heartbeat_ok(t, t))

    windows = [(0.5 + 4 * n, 4.2 + 4 * n) for n in range(10)]
    for begin, end in windows:
        run_acking(T0 + begin)
        h.record(h.lease.on_final_update_started(h.now))
        h.at(end)
        for action in h.record(h.lease.on_final_update_failed(h.now)):  # an overdue beat: at once
            if isinstance(action, SendHeartbeat):
                h.record(h.lease.on_heartbeat_ok(h.now, h.now))
    # Then beats went out only between attempts, some of them overdue ones at an attempt's failure,
    # and after 40 s (4 R) the lease is alive and nothing was fenced
    times = [round(t - T0, 3) for t, _ in h.beats()]
    assert all(not (a <= t < b) for t in times for a, b in windows)
    assert 8.2 in times  # due at 8, inside an attempt: sent when that attempt failed
    assert len(times) >= 4
    assert h.lease.lease_deadline > h.now and h.fences() == []


def test_a_beat_withdrawn_for_the_final_update_is_not_a_failure_and_is_sent_if_the_update_fails() -> None:
    # Given a beat handed out at poll+8 that a final update withdrew from the queue
    h = Harness(policy(r=10.0))
    h.lease.on_child_exited(h.now)
    h.at(8)
    h.lease.on_final_update_started(h.now)
    assert h.lease.on_heartbeat_withdrawn(h.now) == []
    assert h.lease.view().consecutive_failures == 0 and not h.lease.view().heartbeat_in_flight
    # When the update fails at poll+8.5
    h.clock.advance(0.5)
    actions = h.lease.on_final_update_failed(h.now)
    # Then the overdue beat goes out at once
    assert actions == [SendHeartbeat(timeout_seconds=1.5, due_at=T0 + 8, expires_at=T0 + 10)]


def test_an_ownership_answer_during_the_final_update_is_ignored() -> None:
    # Given a check in flight when the final update (COMPLETED) starts
    h = Harness(policy(r=100.0, ownership_check_interval_seconds=5.0))
    h.at(5)
    h.lease.on_child_exited(h.now)
    h.lease.on_final_update_started(h.now)
    # When the check reads our own COMPLETED
    assert h.lease.on_ownership(h.now, own(TaskStatus.COMPLETED)) == []
    # Then that does not turn into "report nothing"
    assert h.lease.fence_reason is None and h.lease.lost_reason is None


EVENTS = st.sampled_from(["tick", "begin", "fail", "ack", "beatfail", "exit"])


@settings(max_examples=100, deadline=None)
@given(script=st.lists(st.tuples(EVENTS, st.floats(0.0, 4.0)), max_size=40), r=st.floats(1.5, 20.0))
def test_property_no_heartbeat_starts_between_begin_and_failed_or_reported(
    script: list[tuple[str, float]], r: float
) -> None:
    lease = Lease(policy(r=r, ownership_check_interval_seconds=2.0), polled_at=T0, poll_count=1)
    now, finalizing, beat_sent_at = T0, False, None
    for event, gap in [*script, ("reported", 0.0), ("tick", 50.0)]:
        now += gap
        if event == "begin":
            actions, finalizing = lease.on_final_update_started(now), True
        elif event == "fail":
            actions, finalizing = lease.on_final_update_failed(now), False
        elif event == "reported":
            actions, finalizing = lease.on_reported(now), True
        elif event == "ack" and beat_sent_at is not None:
            actions, beat_sent_at = lease.on_heartbeat_ok(now, beat_sent_at), None
        elif event == "beatfail" and beat_sent_at is not None:
            actions, beat_sent_at = lease.on_heartbeat_failed(now), None
        elif event == "exit":
            actions = lease.on_child_exited(now)
        else:
            actions = lease.on_tick(now)
        for action in actions:
            if isinstance(action, SendHeartbeat | CheckOwnership):
                assert not finalizing, f"{action} during the final update at {now - T0}"
            if isinstance(action, SendHeartbeat):
                beat_sent_at = now


# ----- the view ----------------------------------------------------------------------------------


def test_the_view_shows_every_timer_and_the_state() -> None:
    # Given a lease with a beat acked at poll+8 and one failure since
    h = Harness(policy(r=10.0, hard_timeout_seconds=60.0, exec_timeout_seconds=50.0))
    h.at(8)
    h.lease.on_heartbeat_ok(h.now, T0 + 8)
    h.at(16)
    h.lease.on_heartbeat_failed(h.now)
    # When viewed
    view = h.lease.view()
    # Then
    assert view.polled_at == T0
    assert view.last_ack_at == T0 + 8
    assert view.next_heartbeat_at == T0 + 17
    assert view.lease_deadline == T0 + 18
    assert view.hard_deadline == T0 + 60
    assert view.exec_deadline == T0 + 50
    assert view.consecutive_failures == 1
    assert view.heartbeat_in_flight is False
    assert view.state is LeaseState.RUNNING
    assert view.fence_reason is None


def test_states_run_from_running_to_done() -> None:
    h = Harness(policy(r=10.0, lease_extend_enabled=False, kill_grace_seconds=1.0))
    seen = [h.lease.state]
    h.at(9)  # the TERM point: deadline - grace
    seen.append(h.lease.state)
    h.at(10)
    seen.append(h.lease.state)
    h.lease.on_child_exited(h.now)
    seen.append(h.lease.state)
    h.lease.on_reported(h.now)
    seen.append(h.lease.state)
    assert seen == list(LeaseState)  # running, terminating, killing, reporting, done


# ----- properties --------------------------------------------------------------------------------

OUTCOMES = st.sampled_from(["ok", "fail", "404", "late"])


@settings(max_examples=100, deadline=None)
@given(
    r=st.floats(1.5, 30.0),
    grace=st.floats(0.0, 5.0),
    margin=st.floats(0.0, 0.5),
    script=st.lists(st.tuples(OUTCOMES, st.floats(0.0, 3.0)), max_size=25),
    exit_after=st.none() | st.floats(0.0, 80.0),
    report_after=st.none() | st.floats(0.0, 10.0),
)
def test_properties_of_any_heartbeat_history(
    r: float,
    grace: float,
    margin: float,
    script: list[tuple[str, float]],
    exit_after: float | None,
    report_after: float | None,
) -> None:
    """For any sequence of heartbeat outcomes and delays, with a perfect timer:

    (a) no TerminateTree/KillTree while the lease is confirmed (its TERM point, deadline - grace -
        margin, in the future) and no fence reason applies;
    (b) TerminateTree by the TERM point, KillTree by deadline - margin if the child lives: the tree
        is dead before the server may hand the task out;
    (c) no SendHeartbeat after on_reported;
    (d) no attempt's timeout exceeds the time left before the TERM point (nor the HTTP cap), none
        starts under the minimum.
    """
    p = policy(r=r, kill_grace_seconds=grace, fence_margin_seconds=margin)
    grace = p.effective_kill_grace_seconds  # capped at R/4
    assert grace <= r / 4 + 1e-9
    # the model: a lease lasts until its TERM point
    h_timeout = p.lease_timeout_seconds - grace - margin
    lease = Lease(p, polled_at=T0)
    outcomes = iter(script)
    end = T0 + 120.0
    now = T0
    acked = T0  # the model: send time of the newest ack processed while the lease was confirmed
    expired_at: float | None = None  # the deadline that passed, if one did
    lost_at: float | None = None  # when a 404 arrived
    exit_at = None if exit_after is None else T0 + exit_after
    report_at = None if exit_at is None or report_after is None else exit_at + report_after
    exited = reported = False
    pending: tuple[float, str, float] | None = None  # (answer at, outcome, sent at)
    terminated_at: float | None = None
    killed_at: float | None = None

    def check(t: float, actions: list[Action]) -> None:
        nonlocal pending, terminated_at, killed_at
        for action in actions:
            if isinstance(action, SendHeartbeat):
                assert not reported, "(c) heartbeat after on_reported"
                left = acked + h_timeout - t
                assert action.timeout_seconds <= min(left, p.http_timeout_seconds) + 1e-9, "(d)"
                assert action.timeout_seconds >= p.min_attempt_seconds - 1e-9, "(d) started too late"
                assert pending is None, "two heartbeats in flight"
                kind, delay = next(outcomes, ("hang", 0.0))
                if kind != "hang":
                    extra = action.timeout_seconds if kind == "late" else 0.0
                    pending = (t + delay + extra, kind, t)
            elif isinstance(action, TerminateTree | KillTree):
                confirmed = t < acked + h_timeout - 1e-9 and expired_at is None  # (float rounding)
                assert not confirmed or lost_at is not None, f"(a) {action} at {t - T0} while confirmed"
                assert not exited, "fenced a child that had exited"
                if isinstance(action, TerminateTree):
                    terminated_at = t if terminated_at is None else terminated_at
                else:
                    assert terminated_at is not None and killed_at is None
                    killed_at = t

    while True:
        times = [lease.next_wakeup(), pending[0] if pending else None]
        times += [exit_at if not exited else None, report_at if not reported else None]
        due = [t for t in times if t is not None]
        if not due or min(due) > end:
            break
        now = max(now, min(due))
        if expired_at is None and lost_at is None and now >= acked + h_timeout - 1e-9:  # (float rounding)
            expired_at = acked + h_timeout
        if pending is not None and pending[0] <= now:
            _, kind, sent_at = pending
            pending = None
            if kind == "404":
                lost_at = now if lost_at is None and not exited else lost_at
                check(now, lease.on_heartbeat_not_found(now))
            elif kind == "fail":
                check(now, lease.on_heartbeat_failed(now))
            else:
                if expired_at is None and now < acked + h_timeout - 1e-9:
                    acked = max(acked, sent_at)
                check(now, lease.on_heartbeat_ok(now, sent_at))
        elif exit_at is not None and not exited and exit_at <= now:
            check(now, lease.on_child_exited(now))
            exited = True
        elif report_at is not None and not reported and report_at <= now:
            check(now, lease.on_reported(now))
            reported = True
        else:
            check(now, lease.on_tick(now))

    # (b) the tree is fenced on time unless the child was gone or ownership was lost first
    if expired_at is not None and (exit_at is None or exit_at > expired_at):
        assert terminated_at is not None and terminated_at <= expired_at + 1e-9, "(b) late TERM"
        if exit_at is None or exit_at > expired_at + grace:
            assert killed_at is not None and killed_at <= expired_at + grace + 1e-9, "(b) late KILL"
    if lost_at is not None:
        assert terminated_at is not None and terminated_at <= lost_at + 1e-9


# ----- dead by the deadline: the capped grace, the margin and the cadence ---------------------------


@pytest.mark.parametrize(
    ("kwargs", "grace", "capped"),
    [
        ({"r": 40.0, "kill_grace_seconds": 10.0}, 10.0, False),  # R/4 = 10: room enough
        ({"r": 20.0, "kill_grace_seconds": 10.0}, 5.0, True),  # cut to R/4
        ({"r": 20.0, "heartbeat_timeout_seconds": 8.0, "kill_grace_seconds": 10.0}, 2.0, True),  # our lease
        ({"r": 0.0, "hard_timeout_seconds": 8.0, "kill_grace_seconds": 10.0}, 2.0, True),  # the ceiling
        ({"r": 0.0, "kill_grace_seconds": 10.0}, 10.0, False),  # no deadline of the server's: no cap
        # R = 2 s: R/4 = 0.5 s, but the beats need 1.25 s from an ack to the TERM point: 2 - 0.4 - 1.25
        ({"r": 2.0, "kill_grace_seconds": 10.0, "fence_margin_seconds": 0.4}, 0.35, True),
        ({"r": 2.0, "kill_grace_seconds": 10.0, "fence_margin_seconds": 0.4, "lease_extend_enabled": False},
         0.5, True),  # no heartbeats to make room for
    ],
)
def test_kill_grace_is_capped_at_a_quarter_of_the_lease_and_of_the_hard_ceiling(
    kwargs: dict[str, object], grace: float, capped: bool
) -> None:
    p = policy(**kwargs)  # type: ignore[arg-type]
    assert (p.effective_kill_grace_seconds, p.kill_grace_capped) == (pytest.approx(grace), capped)


@pytest.mark.parametrize(
    ("r", "grace", "margin", "interval"),
    [
        (30.0, 10.0, 0.3, 0.8 * (30 - 7.5 - 0.3)),  # grace capped at 7.5
        (60.0, 10.0, 0.3, 0.8 * (60 - 10 - 0.3)),
        (4.0, 2.0, 0.3, 0.8 * (4 - 1 - 0.3)),
        # R/4 = 0.5 s would leave 0.8 x (2 - 0.5 - 0.3) = 0.96 s, under the 1 s minimum: the grace is
        # cut to leave the beats their 1.25 s (0.45 s), and they go once a second
        (2.0, 10.0, 0.3, 1.0),
        (1.5, 10.0, 0.3, None),  # no grace leaves 1.25 s: no heartbeats, the grace stays R/4
    ],
)
def test_the_heartbeat_interval_is_0_8_of_the_time_from_an_ack_to_its_term_point(
    r: float, grace: float, margin: float, interval: float | None
) -> None:
    p = policy(r=r, kill_grace_seconds=grace, fence_margin_seconds=margin)
    got = p.heartbeat_interval_seconds
    assert got == (pytest.approx(interval) if interval is not None else None)


@pytest.mark.parametrize(("r", "grace"), [(4.0, 2.0), (10.0, 10.0), (30.0, 10.0), (300.0, 10.0)])
def test_a_healthy_lease_never_reaches_its_term_point(r: float, grace: float) -> None:
    # Given every beat acknowledged within 0.2 s, for 20 R
    h = Harness(policy(r=r, kill_grace_seconds=grace, fence_margin_seconds=FENCE_MARGIN_SECONDS))
    while h.now < T0 + 20 * r:
        for t, action in h.run_until(min(h.lease.next_wakeup() or T0 + 20 * r, T0 + 20 * r)):
            if isinstance(action, SendHeartbeat):
                h.clock.advance(0.2)
                h.record(h.lease.on_heartbeat_ok(h.now, t))
    # Then nothing was ever fenced
    assert h.fences() == [] and len(h.beats()) >= 19


@pytest.mark.parametrize(("r", "grace"), [(4.0, 2.0), (10.0, 10.0), (30.0, 10.0)])
def test_a_failed_beat_is_retried_before_the_term_point(r: float, grace: float) -> None:
    # Given a lease whose first beat fails at once and whose first retry is acknowledged
    h = Harness(policy(r=r, kill_grace_seconds=grace, fence_margin_seconds=FENCE_MARGIN_SECONDS))
    failed = False
    while h.now < T0 + 3 * r:
        for t, action in h.run_until(min(h.lease.next_wakeup() or T0 + 3 * r, T0 + 3 * r)):
            if isinstance(action, SendHeartbeat):
                if failed:
                    h.record(h.lease.on_heartbeat_ok(t, t))
                else:
                    failed = True
                    h.record(h.lease.on_heartbeat_failed(t))
    # Then the retry went out (and was acknowledged) before the TERM point: nothing was fenced
    beats = [t for t, _ in h.beats()]
    assert len(beats) >= 2 and beats[1] < T0 + r - h.lease.policy.fence_lead_seconds
    assert h.fences() == []


def test_our_own_deadlines_term_at_the_deadline_and_kill_a_grace_later() -> None:
    # Given an exec timeout of 30 s (ours: the server does not know it), grace 3 s, margin 0.5 s
    h = Harness(policy(r=100.0, exec_timeout_seconds=30.0, kill_grace_seconds=3.0, fence_margin_seconds=0.5))
    h.at(40)
    # Then TERM at poll+30, KILL at poll+33 (not moved forward by the margin)
    assert h.fences() == [
        (T0 + 30, TerminateTree(FenceReason.EXEC_TIMEOUT)),
        (T0 + 33, KillTree(FenceReason.EXEC_TIMEOUT)),
    ]


def server_delivery(poll_count: int, output: dict[str, object] | None = None) -> Task:
    data: dict[str, object] = {
        "taskId": "t1", "workflowInstanceId": "w1", "taskType": "x", "referenceTaskName": "x_ref",
        "responseTimeoutSeconds": 60, "pollCount": poll_count,
    }  # fmt: skip
    if output is not None:
        data["outputData"] = output
    return Task.from_json(data)


@pytest.mark.parametrize(
    ("poll_count", "output", "waits"),
    [
        (1, None, False),  # a first delivery
        (2, None, True),  # handed out again, not after a yield of ours: the previous holder may run it
        (2, {"conductorRunYieldedAtPollCount": 1}, False),  # right after our yield
        (4, {"conductorRunYieldedAtPollCount": 2}, True),  # a stale marker: re-queued again since
        (3, {"conductorRunYieldedAtPollCount": "2"}, True),  # not a marker of ours
    ],
)
def test_a_redelivery_that_may_still_run_elsewhere_starts_after_its_holder_must_have_fenced(
    poll_count: int, output: dict[str, object] | None, waits: bool
) -> None:
    p = LeasePolicy.from_task(server_delivery(poll_count, output), kill_grace_seconds=4.0,
                              ownership_check_interval_seconds=5.0)  # fmt: skip
    # the previous holder's ownership window: R (its lease ends R after its newest check that found
    # the task its own, which was started before the re-poll), whatever became of its checks
    expected = 60.0 if waits else 0.0
    assert p.start_delay_seconds == pytest.approx(expected)


def test_a_redelivery_also_waits_twice_the_longest_the_check_budget_holds_a_check() -> None:
    # The previous holder's runner may hold its checks for its turn in the budget (up to its most
    # leases / rate): its ownership window is wider by twice that, and so is the wait.
    p = LeasePolicy.from_task(server_delivery(2), kill_grace_seconds=4.0,
                              ownership_check_interval_seconds=5.0, check_queue_seconds=0.6)  # fmt: skip
    assert p.ownership_window_seconds == pytest.approx(60.0 + 2 * 0.6)
    assert p.start_delay_seconds == pytest.approx(60.0 + 2 * 0.6)
    first = LeasePolicy.from_task(server_delivery(1), kill_grace_seconds=4.0,
                                  ownership_check_interval_seconds=5.0, check_queue_seconds=0.6)  # fmt: skip
    assert first.start_delay_seconds == 0.0  # a first delivery still starts at once


def test_without_ownership_checks_a_redelivery_still_waits_a_grace_and_the_margin() -> None:
    p = LeasePolicy.from_task(server_delivery(2), kill_grace_seconds=4.0,
                              ownership_check_interval_seconds=0.0)  # fmt: skip
    assert p.start_delay_seconds == pytest.approx(4.0 + FENCE_MARGIN_SECONDS)


def test_a_held_redelivery_counts_its_exec_timeout_from_its_start() -> None:
    # Given a re-delivery held 8 s (its previous holder may still run it) with an exec timeout of 5 s
    p = policy(r=100.0, exec_timeout_seconds=5.0, start_delay_seconds=8.0, kill_grace_seconds=1.0)
    h = Harness(p)
    h.at(8.5)
    assert h.fences() == []  # not counted while held
    h.lease.on_child_started(h.now)
    h.at(20)
    assert h.fences()[0] == (T0 + 13.5, TerminateTree(FenceReason.EXEC_TIMEOUT))
