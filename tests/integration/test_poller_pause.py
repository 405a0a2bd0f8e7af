"""A poller paused live (``Poller.set_paused``): no poll after the one in flight, whose claims are handed
back, none dropped; a resume polls again; a reconfigure changes the slots from the next poll."""

from __future__ import annotations

import threading
from typing import Any

from leasecore.models import Task
from leasecore.runner.ports import PollSettings
from leasecore.runner.upstream.poller import Poller, WorkBudget
from tests.integration.runner_fakes import make_task
from tests.support import wait_until


class HeldPoll:
    """A poll port whose polls block until released, then answer what is queued; counts the polls."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.polls = 0
        self.in_flight = False
        self.released = False
        self.queued: list[Task] = []
        self.counts: list[int] = []

    def poll(self, task_type: str, *, count: int, timeout_ms: int, **_: Any) -> list[Task]:
        with self.cond:
            self.polls += 1
            self.counts.append(count)
            self.in_flight = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.released, timeout=10)
            self.released = False
            self.in_flight = False
            answer, self.queued = self.queued[:count], self.queued[count:]
            return answer

    def release(self, *tasks: Task) -> None:
        with self.cond:
            self.queued.extend(tasks)
            self.released = True
            self.cond.notify_all()


def test_a_pause_hands_back_what_the_poll_in_flight_claims_and_sends_no_more_polls() -> None:
    port = HeldPoll()
    stop = threading.Event()
    run: list[str] = []
    back: list[str] = []
    poller = Poller(port, PollSettings("t", concurrency=2, timeout_ms=100, interval_seconds=0.01),
                    lambda task, at: run.append(task.task_id), budget=WorkBudget(None), stop=stop,
                    on_surplus=lambda task, at: back.append(task.task_id))
    poller.start()
    try:
        wait_until(lambda: port.in_flight, what="a poll in flight")
        assert poller.set_paused(True) and not poller.set_paused(True)  # the second changes nothing
        port.release(make_task("claimed"))
        wait_until(lambda: back == ["claimed"], what="the claim handed back")
        assert run == []
        polls = port.polls
        assert not stop.wait(0.3)  # paused: no poll at all meanwhile
        assert port.polls == polls and not port.in_flight

        poller.taken_up()  # the runner dealt with the hand-back
        assert poller.set_paused(False)
        wait_until(lambda: port.in_flight, what="a poll after the resume")
        assert port.counts[-1] == 2  # both slots free: the handed-back claim holds none
        port.release(make_task("run"))
        wait_until(lambda: run == ["run"], what="the task after the resume to run")

        poller.reconfigure(PollSettings("t", concurrency=5, timeout_ms=100, interval_seconds=0.01))
        wait_until(lambda: port.in_flight, what="the next poll")
        port.release()
        wait_until(lambda: port.in_flight and port.counts[-1] == 4, what="a poll for the 4 slots now free")
    finally:
        stop.set()
        poller.wake()
        port.release()
        assert poller.join(10)
