"""The lease engine core as sequences of events on an injected time: no threads, no sleeping.

Each test steps ``EngineCore`` with the events its drivers feed it (the threaded ``LeaseEngine`` and the
simulator's runner) and checks the effects it asks for: which request goes when and with which
timeout, one heartbeat in flight per lease, the beat withdrawn or waited for by a final update, beats
of unknown fate, the checks' cap, fences, kill-by times, retiring and ending leases.
"""

from __future__ import annotations

import pytest

from leasecore.lease import FenceReason, KillTree, LeasePolicy, TerminateTree
from leasecore.lease.finalcheck import LATE_BEAT_MARGIN_SECONDS
from leasecore.models import Task, TaskOwnership, TaskStatus
from leasecore.runner.leasing.core import (
    Answered,
    AwaitBeat,
    BeatWaitOver,
    BeginFinalUpdate,
    ChildExited,
    ChildStarted,
    Effect,
    EngineCore,
    Fence,
    FinalUpdateFailed,
    KillBy,
    Outcome,
    Reported,
    SendBeat,
    SendCheck,
    SenderFree,
    Shutdown,
    Tick,
    Track,
    WakeSenders,
)
from leasecore.runner.leasing.schedule import beat_acked, beat_failed, check_failed, ownership_read

R = 30.0
# R 30 s, grace 5 s: the TERM point is 24.6 s after an ack (R - grace - 0.4 s margin), the KILL
# point 29.6 s; a beat every 0.8 of the TERM point (19.68 s), its timeout bounded by the TERM point.
TERM, KILL = 24.6, 29.6
BEAT = 0.8 * TERM


def policy(check_every: float = 0.0) -> LeasePolicy:
    return LeasePolicy(response_timeout_seconds=R, kill_grace_seconds=5.0, http_timeout_seconds=5.0,
                       ownership_check_interval_seconds=check_every)  # fmt: skip


def task(n: int = 1, poll_count: int = 1) -> Task:
    return Task(f"t{n}", f"w{n}", "demo", poll_count=poll_count)


def core(capacity: int = 4) -> EngineCore:
    return EngineCore(random_source=lambda: 0.5, capacity=capacity, kill_by=True)


def of(effects: list[Effect], kind: type) -> list:  # type: ignore[type-arg]
    return [e for e in effects if isinstance(e, kind)]


def due_beat(c: EngineCore, now: float) -> SendBeat:
    """Tick at ``now``, then a free sender takes the one heartbeat due."""
    assert of(c.step(Tick(), now), WakeSenders)
    (send,) = c.step(SenderFree(), now)
    assert isinstance(send, SendBeat)
    return send


def test_a_tracked_task_beats_when_due_with_a_timeout_bounded_by_its_term_point() -> None:
    c = core()
    assert c.step(Track(task(), policy(), polled_at=0.0), 0.0) == [KillBy("t1", (TERM, KILL))]
    assert c.next_wakeup(0.0) == pytest.approx(BEAT)
    assert c.step(SenderFree(), 1.0) == []  # nothing due yet: a free sender finds nothing
    send = due_beat(c, BEAT)
    assert send.task_id == "t1" and send.workflow_id == "w1" and send.sent_at == BEAT
    assert send.timeout_seconds == pytest.approx(min(5.0, TERM - BEAT))
    assert c.beat_calling("t1") and c.heartbeats_sent == 1


def test_one_heartbeat_in_flight_per_lease_then_an_ack_moves_the_kill_by_times() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    send = due_beat(c, BEAT)
    # Still no answer at the TERM point's approach: no second beat is handed out meanwhile.
    for now in (BEAT + 1, BEAT + 3):
        c.step(Tick(), now)
        assert c.step(SenderFree(), now) == []
    effects = c.step(Answered(send.call_id, beat_acked(send.sent_at)), BEAT + 3.5)
    # The kill-by times move from the beat's send time:
    assert of(effects, KillBy) == [KillBy("t1", pytest.approx((BEAT + TERM, BEAT + KILL)))]
    assert of(effects, Outcome)[0].result == "ok" and not c.beat_calling("t1")
    assert c.next_wakeup(BEAT + 3.5) == pytest.approx(2 * BEAT)


def test_without_acks_the_lease_fences_at_its_term_point_then_kills_and_the_kill_by_never_moves() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    c.step(ChildStarted("t1"), 0.1)
    send = due_beat(c, BEAT)
    failed = c.step(Answered(send.call_id, beat_failed(unknown_fate=False)), BEAT + 1)
    assert not of(failed, KillBy) and of(failed, Outcome)[0].result == "failed"
    fences: list[Fence] = []
    now = BEAT + 1
    while (at := c.next_wakeup(now)) is not None and at <= KILL:
        now = at
        fences += of(c.step(Tick(), now), Fence)
        for effect in c.step(SenderFree(), now):  # every retry fails too
            assert isinstance(effect, SendBeat)
            assert not of(c.step(Answered(effect.call_id, beat_failed(unknown_fate=False)), now), KillBy)
    assert [type(f.action) for f in fences] == [TerminateTree, KillTree]
    term = fences[0]
    assert isinstance(term.action, TerminateTree) and term.action.reason is FenceReason.LEASE_EXPIRED
    assert term.action.at == pytest.approx(TERM)
    assert c.fence_reason("t1") is FenceReason.LEASE_EXPIRED


def test_a_beat_that_waited_too_long_for_a_sender_is_never_sent_and_counts_as_failed() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    c.step(Tick(), BEAT)
    effects = c.step(SenderFree(), TERM - 0.05)  # under min_attempt_seconds (0.1 s) left
    assert not of(effects, SendBeat)
    (outcome,) = of(effects, Outcome)
    assert outcome.kind == "heartbeat" and outcome.result == "failed" and outcome.late is None
    assert c.heartbeats_sent == 0 and not c.beat_calling("t1")


def test_a_final_update_withdraws_a_queued_beat_and_no_beat_goes_until_it_fails() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    c.step(Tick(), BEAT)  # the beat is queued, no sender took it yet
    c.step(ChildExited("t1"), BEAT)
    assert c.queued() == 1
    assert c.step(BeginFinalUpdate("t1"), BEAT) == []  # no beat calls: nothing to wait for
    assert c.queued() == 0 and c.step(SenderFree(), BEAT) == []
    c.step(Tick(), BEAT + 2)
    assert c.step(SenderFree(), BEAT + 2) == []  # still excluded
    effects = c.step(FinalUpdateFailed("t1"), BEAT + 3)  # beats again between the attempts
    assert of(effects, WakeSenders)
    (send,) = c.step(SenderFree(), BEAT + 3)
    assert isinstance(send, SendBeat)


def test_a_final_update_waits_for_the_beat_calling_and_knows_when_it_ends() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    send = due_beat(c, BEAT)
    (wait,) = c.step(BeginFinalUpdate("t1"), BEAT + 1)
    assert wait == AwaitBeat("t1", pytest.approx(BEAT + send.timeout_seconds + 1.0))
    assert c.beat_calling("t1")
    c.step(Answered(send.call_id, beat_acked(send.sent_at)), BEAT + 2)
    assert not c.beat_calling("t1")
    assert c.step(BeatWaitOver("t1"), BEAT + 2) == []
    assert c.late_beats("t1") is None  # answered: it cannot land late


def test_a_wait_never_closed_is_forgotten_with_the_lease() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    due_beat(c, BEAT)
    assert of(c.step(BeginFinalUpdate("t1"), BEAT + 1), AwaitBeat)
    c.step(Reported("t1"), BEAT + 2)  # (no BeatWaitOver, no answer)
    c.step(Track(task(poll_count=2), policy(), polled_at=BEAT + 3), BEAT + 3)  # the task's next run
    assert not c.beat_calling("t1")  # the new lease has no beat calling: the old wait is gone


def test_a_beat_still_calling_when_the_wait_ends_is_of_unknown_fate() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    send = due_beat(c, BEAT)
    (wait,) = of(c.step(BeginFinalUpdate("t1"), BEAT + 1), AwaitBeat)
    c.step(BeatWaitOver("t1"), wait.until)
    late = c.late_beats("t1")
    assert late is not None and late.poll_count == 1
    assert late.until == pytest.approx(BEAT + send.timeout_seconds + LATE_BEAT_MARGIN_SECONDS)


def test_a_beat_that_timed_out_may_still_land_after_the_final_update() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    send = due_beat(c, BEAT)
    c.step(Answered(send.call_id, beat_failed(unknown_fate=True)), BEAT + 5)
    late = c.late_beats("t1")
    assert late is not None and late.until == pytest.approx(BEAT + 5 + LATE_BEAT_MARGIN_SECONDS)
    c.step(BeginFinalUpdate("t1"), BEAT + 6)
    assert c.late_beats("t1") is not None


def test_reported_ends_the_lease_its_timer_and_its_kill_by_and_a_late_answer_does_nothing() -> None:
    c = core()
    c.step(Track(task(), policy(), polled_at=0.0), 0.0)
    send = due_beat(c, BEAT)
    assert c.step(Reported("t1"), BEAT + 1) == [KillBy("t1", None)]
    assert c.next_wakeup(BEAT + 1) is None and c.tracked() == 0
    assert c.step(Answered(send.call_id, beat_acked(send.sent_at)), BEAT + 2) == []


def test_a_newer_delivery_during_a_final_update_gets_its_own_lease_and_the_old_one_retires() -> None:
    c = core()
    c.step(Track(task(poll_count=1), policy(), polled_at=0.0), 0.0)
    c.step(ChildExited("t1"), 5.0)
    c.step(BeginFinalUpdate("t1"), 6.0)  # a yield being reported ...
    effects = c.step(Track(task(poll_count=2), policy(), polled_at=7.0), 7.0)  # ... re-polled already
    assert c.retired() == ["t1"]
    assert of(effects, KillBy) == [KillBy("t1", pytest.approx((7.0 + TERM, 7.0 + KILL)))]
    assert c.step(BeginFinalUpdate("t1"), 8.0) == []  # reaches the retired lease: inert
    assert c.step(Reported("t1", poll_count=1), 9.0) == []  # the old run forgotten: the new lease stays
    assert c.tracked() == 1 and c.retired() == []
    assert c.entry("t1") is not None and c.entry("t1").since_poll == 2  # type: ignore[union-attr]


def test_a_re_delivery_of_the_running_task_acks_its_lease() -> None:
    c = core()
    c.step(Track(task(poll_count=1), policy(), polled_at=0.0), 0.0)
    effects = c.step(Track(task(poll_count=2), policy(), polled_at=10.0), 10.0)
    assert of(effects, KillBy) == [KillBy("t1", pytest.approx((10.0 + TERM, 10.0 + KILL)))]
    assert c.tracked() == 1 and c.retired() == []


def test_checks_in_flight_are_capped_at_half_the_capacity_and_a_freed_check_wakes_a_sender() -> None:
    c = core(capacity=2)  # one check in flight at most
    for n in (1, 2):
        c.step(Track(task(n), policy(check_every=5.0), polled_at=0.0), 0.0)
    at = c.next_wakeup(0.0)
    assert at is not None
    c.step(Tick(), at)
    first = c.step(SenderFree(), at)
    assert [type(e) for e in first] == [SendCheck] and c.step(SenderFree(), at) == []
    (check,) = first
    assert isinstance(check, SendCheck)
    ours = ownership_read(TaskOwnership(TaskStatus.IN_PROGRESS, 1))
    effects = c.step(Answered(check.call_id, ours), at + 1)
    assert WakeSenders(1, grow=False) in effects and of(effects, Outcome)[0].result == "ok"
    (second,) = c.step(SenderFree(), at + 1)
    assert isinstance(second, SendCheck) and second.task_id != check.task_id


def test_a_check_that_says_the_task_is_someone_elses_fences_it_for_ownership_lost() -> None:
    c = core()
    c.step(Track(task(), policy(check_every=5.0), polled_at=0.0), 0.0)
    c.step(ChildStarted("t1"), 0.1)
    at = c.next_wakeup(0.0)
    assert at is not None
    c.step(Tick(), at)
    (check,) = c.step(SenderFree(), at)
    assert isinstance(check, SendCheck)
    effects = c.step(Answered(check.call_id, ownership_read(TaskOwnership(TaskStatus.COMPLETED, 1))), at + 1)
    assert [f.action.reason for f in of(effects, Fence)] == [FenceReason.OWNERSHIP_LOST]
    assert of(effects, Outcome)[0].result == "lost"
    assert c.step(Answered(999, check_failed()), at + 2) == []  # an unknown call: ignored


def test_shutdown_fences_every_lease_or_one_and_refuses_an_unknown_one() -> None:
    c = core()
    for n in (1, 2):
        c.step(Track(task(n), policy(), polled_at=0.0), 0.0)
        c.step(ChildStarted(f"t{n}"), 0.0)
    assert [f.task_id for f in of(c.step(Shutdown(), 1.0), Fence)] == ["t1", "t2"]
    forced = of(c.step(Shutdown("t1", force=True), 2.0), Fence)
    assert [type(f.action) for f in forced] == [KillTree]
    with pytest.raises(KeyError):
        c.step(Shutdown("nope"), 3.0)


def test_the_same_events_give_the_same_effects() -> None:
    def run() -> list[Effect]:
        c = EngineCore(random_source=iter([0.1, 0.7, 0.3] * 10).__next__, capacity=4, kill_by=True)
        out: list[Effect] = []
        for n in (1, 2, 3):
            out += c.step(Track(task(n), LeasePolicy(response_timeout_seconds=R, first_attempt_spread=0.5),
                                polled_at=0.0), 0.0)  # fmt: skip
        now = 0.0
        for _ in range(10):
            now = c.next_wakeup(now) or now + 1
            out += c.step(Tick(), now)
            while more := c.step(SenderFree(), now):
                out += more
                for e in more:
                    if isinstance(e, SendBeat):
                        out += c.step(Answered(e.call_id, beat_acked(e.sent_at)), now + 0.2)
        return out

    first = run()
    assert first == run() and len(of(first, SendBeat)) >= 3
