"""``child.Latch``: a child's set-once flags, waited on like an Event, with no lock until a waiter."""

from __future__ import annotations

import threading
import time

from leasecore.process.supervisor.child import Latch


def test_a_latch_set_before_the_wait_returns_at_once_and_never_makes_an_event() -> None:
    latch = Latch()
    assert not latch.is_set()
    latch.set()
    assert latch.is_set()
    assert latch.wait(0) is True
    assert latch._event is None


def test_a_zero_wait_on_an_unset_latch_is_a_look_that_makes_no_event() -> None:
    # The runner looks at every exited task's tree this way (wait_gone(0)): an Event each was ~10 us.
    latch = Latch()
    assert latch.wait(0) is False and latch.wait(-1.0) is False
    assert latch._event is None
    latch.set()
    assert latch.wait(0) is True


def test_a_wait_on_an_unset_latch_times_out() -> None:
    latch = Latch()
    started = time.monotonic()
    assert latch.wait(0.05) is False
    assert time.monotonic() - started >= 0.05


def _wait_into(latch: Latch, results: list[bool]) -> None:
    results.append(latch.wait(10.0))


def test_waiters_are_woken_by_a_set_from_another_thread_without_loss() -> None:
    # Many rounds of several waiters racing one setter: a waiter that missed the set would sit out
    # its whole 10 s timeout and return False.
    for _ in range(200):
        latch = Latch()
        results: list[bool] = []
        waiters = [threading.Thread(target=_wait_into, args=(latch, results)) for _ in range(3)]
        for waiter in waiters:
            waiter.start()
        latch.set()
        for waiter in waiters:
            waiter.join(15.0)
        assert results == [True, True, True]
