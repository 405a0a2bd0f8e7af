"""The dead-man's switch, pure: the fork server's per-tree decisions and the lease's kill-by times,
with an injected clock (no threads, no sleeps)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from leasecore.clock import FakeClock
from leasecore.lease import Lease, LeasePolicy
from leasecore.models import Task
from leasecore.process.forkserver.deadman import KILL, SWITCH_LAG_SECONDS, TERM, Switch

T0 = 1000.0


# ----- Switch ------------------------------------------------------------------------------------


def test_nothing_is_due_before_the_term_point_plus_the_runners_head_start() -> None:
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.term_due_at() == pytest.approx(T0 + 2.6 + SWITCH_LAG_SECONDS)
    assert switch.step(T0 + 2.6, term_sent=False) is None  # the runner's own fence goes first
    assert switch.next_at(term_sent=False) == pytest.approx(T0 + 2.7)


def test_a_silent_runner_gets_term_then_kill_each_once() -> None:
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.step(T0 + 2.7, term_sent=False) == TERM
    assert switch.step(T0 + 2.8, term_sent=False) is None  # once
    assert switch.next_at(term_sent=True) == T0 + 3.6
    assert switch.step(T0 + 3.59, term_sent=True) is None
    assert switch.step(T0 + 3.65, term_sent=True) == KILL
    assert switch.late == pytest.approx(0.05)  # its own lateness, for the log and the bench
    assert switch.step(T0 + 9.0, term_sent=True) is None  # once
    assert switch.next_at(term_sent=True) is None


def test_a_tree_the_runner_termed_gets_no_term_from_the_switch_but_still_its_kill() -> None:
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.step(T0 + 3.0, term_sent=True) is None
    assert not switch.acted
    assert switch.step(T0 + 3.6, term_sent=True) == KILL


def test_first_look_past_the_kill_point_kills_at_once_without_a_term() -> None:
    # a fork server that was stopped (or a thawed host): the grace is over
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.step(T0 + 60.0, term_sent=False) == KILL
    assert switch.late == pytest.approx(60.0 - 3.6)
    assert switch.step(T0 + 60.0, term_sent=False) is None


def test_renewal_moves_forward_only() -> None:
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.renew(T0 + 5.8, T0 + 6.8)
    assert (switch.term_at, switch.kill_at) == (T0 + 5.8, T0 + 6.8)
    assert not switch.renew(T0 + 4.0, T0 + 5.0)  # an older renewal, arriving late: ignored
    assert (switch.term_at, switch.kill_at) == (T0 + 5.8, T0 + 6.8)
    assert switch.step(T0 + 5.0, term_sent=False) is None


def test_a_renewal_after_the_switch_acted_changes_nothing() -> None:
    switch = Switch(T0 + 2.6, T0 + 3.6)
    assert switch.step(T0 + 2.7, term_sent=False) == TERM
    assert not switch.renew(T0 + 9.0, T0 + 10.0)  # an ack processed too late cannot revive the tree
    assert switch.step(T0 + 3.6, term_sent=True) == KILL


def test_the_head_start_never_reaches_the_kill_point() -> None:
    switch = Switch(T0 + 1.0, T0 + 1.2)  # a 0.2 s grace: the lag is a quarter of it
    assert switch.term_due_at() == pytest.approx(T0 + 1.05)
    assert Switch(T0 + 1.0, T0 + 1.0).term_due_at() == T0 + 1.0  # no grace: KILL straight away
    assert Switch(T0 + 1.0, T0 + 0.5).kill_at == T0 + 1.0  # a KILL point before the TERM: clamped


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 10)), max_size=20), st.floats(0, 200))
def test_the_kill_is_never_later_than_the_latest_kill_point_renewed(
    renewals: list[tuple[float, float]], look_at: float
) -> None:
    switch = Switch(T0 + 2.0, T0 + 3.0)
    latest_kill = T0 + 3.0
    for term, grace in renewals:
        if switch.renew(T0 + term, T0 + term + grace):
            latest_kill = max(latest_kill, T0 + term + grace)
        assert switch.kill_at <= max(latest_kill, T0 + 3.0)
    verdicts = [switch.step(T0 + look_at, term_sent=False), switch.step(switch.kill_at, term_sent=True)]
    assert KILL in verdicts  # by its KILL point the tree has had its KILL, whatever came before


# ----- the lease's kill-by times ------------------------------------------------------------------


def _lease(r: float = 4.0, **overrides: object) -> tuple[Lease, FakeClock]:
    clock = FakeClock(T0)
    values: dict[str, object] = {"kill_grace_seconds": 1.0, "fence_margin_seconds": 0.4,
                                 "ownership_check_interval_seconds": 0.0}
    values.update(overrides)
    return Lease(LeasePolicy(response_timeout_seconds=r, **values), T0), clock  # type: ignore[arg-type]


def test_kill_by_is_the_leases_own_fence_points() -> None:
    lease, _ = _lease()  # R 4, G 1, M 0.4: TERM at deadline - 1.4, KILL at deadline - 0.4
    assert lease.kill_by() == (T0 + 2.6, T0 + 3.6)


def test_kill_by_moves_only_with_an_ack_and_never_past_the_lease() -> None:
    lease, clock = _lease()
    clock.advance(2.0)
    lease.on_tick(clock.monotonic())
    assert lease.kill_by() == (T0 + 2.6, T0 + 3.6)  # time alone moves nothing
    lease.on_heartbeat_failed(clock.monotonic())
    assert lease.kill_by() == (T0 + 2.6, T0 + 3.6)  # nor a failed beat
    lease.on_heartbeat_ok(clock.monotonic(), sent_at=T0 + 1.9)
    assert lease.kill_by() == (T0 + 1.9 + 2.6, T0 + 1.9 + 3.6)  # from the ack's send time
    lease.on_heartbeat_ok(clock.monotonic(), sent_at=T0 + 9.0)  # a send time in the future: capped
    assert lease.kill_by() == (T0 + 2.0 + 2.6, T0 + 2.0 + 3.6)


def test_an_ack_processed_after_the_term_point_does_not_move_kill_by() -> None:
    lease, clock = _lease()
    clock.advance(2.7)  # past the TERM point (a stalled runner resuming)
    lease.on_heartbeat_ok(clock.monotonic(), sent_at=T0 + 2.0)
    assert lease.kill_by() == (T0 + 2.6, T0 + 3.6)


def test_kill_by_takes_the_hard_ceiling_when_it_comes_first() -> None:
    lease, clock = _lease(r=4.0, hard_timeout_seconds=5.0)  # G capped to 1 (a quarter of R)
    clock.advance(1.0)
    lease.on_heartbeat_ok(clock.monotonic(), sent_at=T0 + 1.0)
    clock.advance(2.0)
    lease.on_heartbeat_ok(clock.monotonic(), sent_at=T0 + 3.0)
    assert lease.kill_by() == (T0 + 5.0 - 1.4, T0 + 5.0 - 0.4)  # the ceiling: heartbeats cannot move it


def test_no_server_deadline_means_no_switch() -> None:
    lease, _ = _lease(r=0.0)
    assert lease.kill_by() is None


def test_a_redelivery_counts_like_an_ack() -> None:
    lease, clock = _lease()
    clock.advance(1.5)
    lease.on_redelivered(clock.monotonic(), polled_at=T0 + 1.5)
    assert lease.kill_by() == (T0 + 1.5 + 2.6, T0 + 1.5 + 3.6)


# ----- the runner's words for a stalled lease -----------------------------------------------------


def _entry(**fields: object) -> object:
    from datetime import UTC, datetime

    from leasecore.runner.loop.status import InFlight
    from leasecore.runner.ports import PollSettings, TaskTypePlan

    plan = TaskTypePlan(poll=PollSettings("t", worker_id="w1"), spec=None, worker_id="w1",
                        make_policy=lambda task: LeasePolicy(response_timeout_seconds=4))
    entry = InFlight(task=Task(task_id="t1", workflow_id="w1", task_type="t", timeout_seconds=60), plan=plan,
                     index=0, started_at=datetime(2026, 1, 1, tzinfo=UTC))  # fmt: skip
    for name, value in fields.items():
        setattr(entry, name, value)
    return entry


def test_a_tree_the_switch_ended_is_reported_as_a_stall_not_a_lost_heartbeat() -> None:
    from leasecore.lease import FenceReason
    from leasecore.runner.loop.task_end import fence_text

    entry = _entry(ended_by_switch=True)
    text = fence_text(FenceReason.LEASE_EXPIRED, entry.task, entry)  # type: ignore[attr-defined, arg-type]
    assert text is not None and text.startswith("lease expired while the runner was stalled")
    assert "dead-man's switch" in text
    text = fence_text(FenceReason.HARD_TIMEOUT, entry.task, entry)  # type: ignore[attr-defined, arg-type]
    assert text is not None and text.startswith("hard timeout: the task's timeoutSeconds (60s) passed while")


def test_a_late_fence_without_the_switch_is_a_stall_too_and_otherwise_the_words_stay() -> None:
    from leasecore.lease import FenceReason
    from leasecore.runner.loop.task_end import fence_text

    stalled = _entry(stalled_seconds=7.25)
    text = fence_text(FenceReason.LEASE_EXPIRED, stalled.task, stalled)  # type: ignore[attr-defined, arg-type]
    assert text == ("lease expired while the runner was stalled (its process did not run until 7.2s past the "
                    "lease's TERM point); the tree was killed then")  # fmt: skip
    plain = _entry()
    text = fence_text(FenceReason.LEASE_EXPIRED, plain.task, plain)  # type: ignore[attr-defined, arg-type]
    assert text == "lease expired: no heartbeat was acknowledged within the heartbeat timeout"
    assert fence_text(FenceReason.SHUTDOWN, stalled.task, stalled) == "worker shutting down"  # type: ignore
