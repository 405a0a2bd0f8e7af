"""The lease engine's plain parts on their own: the timer heap, the send queue, the book of leases.

No engine, no thread (nothing here starts one): each part is handed ``now``.
"""

from __future__ import annotations

import pytest

from leasecore.checkbudget import CheckBudget
from leasecore.lease import CheckOwnership, LeasePolicy, SendHeartbeat
from leasecore.models import Task
from leasecore.runner.leasing.leasebook import LeaseBook
from leasecore.runner.leasing.senders import InlineSenders, Job, SendQueue, ThreadedSenders
from leasecore.runner.leasing.timer import TimerHeap

T0 = 1000.0

# ----- TimerHeap ------------------------------------------------------------------------------------


def test_the_heap_hands_out_due_keys_earliest_first_and_only_once() -> None:
    heap = TimerHeap()
    heap.schedule("b", T0 + 2)
    heap.schedule("a", T0 + 1)
    heap.schedule("c", T0 + 5)
    assert heap.earliest() == T0 + 1
    assert [heap.pop_due(T0 + 3), heap.pop_due(T0 + 3), heap.pop_due(T0 + 3)] == ["a", "b", None]
    assert len(heap) == 1 and heap.earliest() == T0 + 5


def test_a_later_schedule_supersedes_the_older_time_and_none_clears_it() -> None:
    heap = TimerHeap()
    assert heap.schedule("a", T0 + 1) is True
    assert heap.schedule("a", T0 + 1) is False  # unchanged
    heap.schedule("a", T0 + 4)  # moved later: the entry at T0 + 1 is dead
    assert heap.pop_due(T0 + 2) is None and heap.earliest() == T0 + 4
    heap.schedule("a", None)
    assert heap.earliest() is None and heap.pop_due(T0 + 10) is None
    heap.schedule("b", T0 + 1)
    heap.discard("b")
    assert heap.pop_due(T0 + 10) is None and len(heap) == 0


def test_moving_a_key_back_and_forth_fires_it_once() -> None:
    heap = TimerHeap()
    heap.schedule("a", T0 + 1)
    heap.schedule("a", T0 + 2)
    heap.schedule("a", T0 + 1)  # the first entry's time again
    assert heap.pop_due(T0 + 5) == "a"
    assert heap.pop_due(T0 + 5) is None


def test_superseded_entries_are_compacted_away() -> None:
    # Given 10 live keys rescheduled 100 times each (1000 dead entries)
    heap = TimerHeap()
    for round_ in range(100):
        for k in range(10):
            heap.schedule(f"k{k}", T0 + round_ + k / 100)
    assert heap.entries == 1000
    heap.compact()
    # Then the heap holds only the live ones, which still come out in order
    assert heap.entries == 10
    assert [heap.pop_due(T0 + 1000) for _ in range(10)] == [f"k{k}" for k in range(10)]


# ----- SendQueue ------------------------------------------------------------------------------------


def beat(task_id: str, due_at: float) -> Job:
    return Job(task_id, "w", SendHeartbeat(5.0, due_at, due_at + 20), 0.1, due_at)


def check(task_id: str, due_at: float) -> Job:
    return Job(task_id, "w", CheckOwnership(5.0, due_at, due_at + 20), 0.1, due_at)


def test_heartbeats_go_first_the_most_overdue_first_then_checks_in_order() -> None:
    queue = SendQueue(max_checks_calling=4, budget=CheckBudget(0.0))
    for job in (check("c1", T0), beat("b2", T0 + 2), check("c2", T0 + 1), beat("b1", T0 + 1)):
        assert queue.push(job)
    assert queue.runnable(T0) == 4
    assert [queue.pop().task_id for _ in range(4)] == ["b1", "b2", "c1", "c2"]


def test_checks_in_flight_are_capped_and_a_freed_slot_says_so() -> None:
    queue = SendQueue(max_checks_calling=1, budget=CheckBudget(0.0))
    assert queue.push(check("c1", T0)) is True
    assert queue.push(check("c2", T0)) is False  # beyond the cap: no sender to wake for it
    assert queue.runnable(T0) == 1
    queue.pop()
    queue.check_started(T0)
    assert queue.runnable(T0) == 0 and len(queue) == 1
    assert queue.push(beat("b", T0)) is True and queue.runnable(T0) == 1  # a beat never waits for checks
    assert queue.check_done() is True  # c2 may go now
    assert queue.runnable(T0) == 2


def test_the_budget_holds_checks_and_says_how_long() -> None:
    queue = SendQueue(max_checks_calling=8, budget=CheckBudget(2.0, burst=1, now=T0))
    queue.push(check("c1", T0))
    queue.push(check("c2", T0))
    assert queue.runnable(T0) == 1 and queue.budget_wait_seconds(T0) is None  # a token is there
    queue.pop()
    queue.check_started(T0)
    assert queue.runnable(T0) == 0
    assert queue.budget_wait_seconds(T0) == pytest.approx(0.5)  # 2 a second
    assert queue.runnable(T0 + 0.5) == 1


def test_withdrawing_a_tasks_beats_leaves_the_others_in_order() -> None:
    queue = SendQueue(max_checks_calling=1, budget=CheckBudget(0.0))
    for job in (beat("a", T0 + 1), beat("x", T0), beat("b", T0 + 2), beat("x", T0 + 3), check("x", T0)):
        queue.push(job)
    assert queue.withdraw_beats("x") is True
    assert queue.withdraw_beats("x") is False
    assert sorted(queue.queued_times()) == [T0, T0 + 1, T0 + 2]  # a, b and x's check
    assert [queue.pop().task_id for _ in range(3)] == ["a", "b", "x"]


def test_the_executors_refuse_impossible_sizes() -> None:
    with pytest.raises(ValueError, match="senders"):
        ThreadedSenders(senders=5, max_senders=4)
    with pytest.raises(ValueError, match="capacity"):
        InlineSenders(capacity=0)
    with pytest.raises(RuntimeError, match="bind"):
        InlineSenders().run_next()


# ----- LeaseBook ------------------------------------------------------------------------------------


def _task(poll_count: int) -> Task:
    return Task(task_id="t1", workflow_id="w1", task_type="demo", response_timeout_seconds=10,
                poll_count=poll_count)  # fmt: skip


POLICY = LeasePolicy(response_timeout_seconds=10.0, ownership_check_interval_seconds=0.0,
                     kill_grace_seconds=0.0, fence_margin_seconds=0.0)  # fmt: skip


def test_a_redelivery_acks_the_lease_and_a_newer_poll_in_final_update_retires_it() -> None:
    book = LeaseBook(random=lambda: 0.0)
    first, _ = book.admit(_task(1), POLICY, T0, T0)
    again, _ = book.admit(_task(1), POLICY, T0 + 1, T0 + 1)
    assert again is first and first.lease.view().last_ack_at == T0 + 1
    first.lease.on_final_update_started(T0 + 2)
    second, _ = book.admit(_task(2), POLICY, T0 + 3, T0 + 3)
    assert second is not first and book.retired() == ["t1"] and book.get("t1") is second
    assert book.in_final_update("t1") is None  # the update's calls never reach the new run's lease
    assert book.end("t1", T0 + 4) is False  # the update's ack ends the retired lease
    assert book.retired() == [] and book["t1"] is second
    assert book.end("t1", T0 + 5, poll_count=1) is False  # the old run's end leaves the new lease
    assert book.end("t1", T0 + 5, poll_count=2) is True and len(book) == 0
    with pytest.raises(KeyError):
        book["t1"]
