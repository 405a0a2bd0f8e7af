"""The poller's thread as the driver of its pure core (``PollCore``): it sleeps the backoff the core
decides, but never past a stop, and never for ever on a clock that does not move."""

from __future__ import annotations

import threading
import time
from typing import Any

from leasecore.clock import FakeClock
from leasecore.errors import ConductorUnavailable
from leasecore.models import Task
from leasecore.runner.ports import PollSettings
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.pollpolicy import BackoffPolicy, PollBackoff
from tests.support import wait_until


class CountingPort:
    """Answers every poll empty (or fails it with ``error``); counts the polls."""

    def __init__(self, error: Exception | None = None) -> None:
        self.polls = 0
        self.error = error

    def poll(self, task_type: str, *, count: int, timeout_ms: int, **_: Any) -> list[Task]:
        self.polls += 1
        if self.error is not None:
            raise self.error
        return []


def test_the_backoff_is_slept_out_even_on_a_clock_that_does_not_move() -> None:
    port = CountingPort()
    stop = threading.Event()
    poller = Poller(port, PollSettings("t", interval_seconds=0.02), lambda task, at: None,
                    budget=WorkBudget(None), stop=stop, clock=FakeClock())
    poller.start()
    try:
        # Each empty poll sets "no poll before now + delay" on a frozen clock: the thread must still
        # poll again once it has slept the delay.
        wait_until(lambda: port.polls >= 5, what="five polls, each after its backoff")
        assert poller.backoff_seconds > 0
    finally:
        stop.set()
        poller.wake()
        assert poller.join(10)


def test_a_stop_cuts_a_long_backoff_short_without_a_wake() -> None:
    port = CountingPort(ConductorUnavailable("connection refused"))
    stop = threading.Event()
    long = BackoffPolicy(error_base_seconds=60.0, error_cap_seconds=60.0, jitter=0.0)
    poller = Poller(port, PollSettings("t"), lambda task, at: None, budget=WorkBudget(None), stop=stop,
                    backoff=PollBackoff(long))
    poller.start()
    wait_until(lambda: poller.backoff_seconds == 60.0, what="the first failure's backoff")
    began = time.monotonic()
    stop.set()  # no wake(): the backoff's sleep is on the stop event itself
    assert poller.join(10), "the poller slept past the stop"
    assert time.monotonic() - began < 10 and port.polls == 1
    assert not poller.reachability.reachable and poller.consecutive_errors == 1
