"""The table of spawns in flight (``supervisor.inflight.StartsInFlight``): room, giving up, late
starts and a lost fork server, without a fork server or a process."""

from __future__ import annotations

import threading
from typing import Any, cast

import pytest

from leasecore.process.linux.leftovers import TreeRecord
from leasecore.process.supervisor.child import Child, PendingStart
from leasecore.process.supervisor.inflight import Answer, StartsInFlight, answer_meaning


def pending(request_id: int, sent_at: float = 0.0) -> PendingStart:
    record = TreeRecord(f"t{request_id}", 0, 0, f"token{request_id}", "/tmp/none")
    return PendingStart(cast(Child, object()), request_id, (-1, -1), "cmd", sent_at, True, None, record)


def spawned(request_id: int, pid: int) -> dict[str, Any]:
    return {"op": "spawned", "id": request_id, "key": f"t{request_id}", "pid": pid, "start": 77}


def test_room_counts_the_unanswered_and_the_given_up_until_their_answer() -> None:
    table = StartsInFlight(threading.Condition(), max_starting=2)
    first, second = pending(1), pending(2)
    table.add(first)
    assert table.has_room()
    table.add(second)
    assert not table.has_room() and len(table) == 2
    assert table.give_up(lambda p: p.request_id == 1) == [first]
    assert len(table) == 1 and not table.has_room()  # still queued at the fork server: holds room
    assert table.answered(1, "spawn_failed", {"op": "spawn_failed", "id": 1}) == (None, True)
    assert table.has_room()
    assert table.answered(2, "spawned", spawned(2, 500)) == (second, False)
    assert len(table) == 0


def test_a_request_that_never_went_out_is_dropped_once() -> None:
    table = StartsInFlight(threading.Condition(), max_starting=1)
    start = pending(1)
    table.add(start)
    assert table.drop(start)  # ours to undo
    assert not table.drop(start)  # ended already
    table.add(pending(2))
    table.give_up(lambda p: True)
    assert not table.has_room()
    assert not table.drop(pending(2))  # given up while its send was under way: ended, and no room held
    assert table.has_room()


def test_a_late_start_is_known_by_pid_until_gone_and_a_lost_fork_server_kills_every_unseen_tree() -> None:
    table = StartsInFlight(threading.Condition(), max_starting=8)
    for request_id in (1, 2, 3):
        table.add(pending(request_id))
    table.give_up(lambda p: p.request_id in (1, 2))
    table.answered(1, "spawned", spawned(1, 501))  # given up, then started: a late start
    starting, records = table.take_all()
    assert [p.request_id for p in starting] == [3]
    by_key = {record.key: record for record in records}
    assert set(by_key) == {"t1", "t2", "t3"}
    assert (by_key["t1"].pid, by_key["t1"].start_time) == (501, 77)  # known by pid now
    assert by_key["t2"].pid == 0 and by_key["t3"].pid == 0  # by token only
    assert len(table) == 0 and table.take_all() == ([], [])


def test_a_late_tree_gone_is_no_longer_killed_with_a_lost_fork_server() -> None:
    table = StartsInFlight(threading.Condition(), max_starting=8)
    table.add(pending(1))
    table.give_up(lambda p: True)
    table.answered(1, "spawned", spawned(1, 501))
    table.gone("t1")
    assert table.take_all() == ([], [])


def test_an_answer_to_no_spawn_is_left_to_the_caller() -> None:
    table = StartsInFlight(threading.Condition(), max_starting=8)
    assert table.answered(9, "stats", {"op": "stats", "id": 9}) == (None, False)


@pytest.mark.parametrize(
    ("op", "in_flight", "given_up", "call_answer", "meaning"),
    [
        ("spawned", True, False, False, Answer.STARTED),
        ("spawn_failed", True, False, False, Answer.FAILED),
        # Given up (its task failed already): a command that started anyway must not run.
        ("spawned", False, True, False, Answer.KILL_LATE),
        ("spawn_failed", False, True, False, Answer.NOTHING),
        # A call waiting for its answer (stats) took it.
        ("stats", False, False, True, Answer.NOTHING),
        ("stats", False, False, False, Answer.NOTHING),  # its caller gave up waiting
        # An unknown spawn that started (lost track of): killed, never left running unowned.
        ("spawned", False, False, False, Answer.KILL_LATE),
        ("spawn_failed", False, False, False, Answer.NOTHING),
    ],
)
def test_what_an_answer_of_the_fork_server_means(op: str, in_flight: bool, given_up: bool, call_answer: bool,
                                                 meaning: Answer) -> None:  # fmt: skip
    assert answer_meaning(op, in_flight=in_flight, given_up=given_up, call_answer=call_answer) is meaning
