"""The reporter's update-v2 attempt (leasecore.runner.upstream.reporter, leasecore.runner.chain) with a
scripted port and a FakeClock: the claimed task and the send time reach ``on_chained`` exactly once, before
the outcome; update-v2 is never resent; 405, or a 404 that v1 then takes, turns it off for good."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from leasecore.clock import FakeClock
from leasecore.errors import ConductorNotFound, ConductorRejected, ConductorUnavailable
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome

Step = Callable[[], "Task | None"]


class ScriptedPort:
    """update / update_v2 answer from a script (a value, or an exception to raise), in order."""

    def __init__(self, clock: FakeClock, v2: list[object], v1: list[object] | None = None) -> None:
        self.clock = clock
        self.v2_script = list(v2)
        self.v1_script = list(v1 or [])
        self.calls: list[tuple[str, str, float]] = []  # (endpoint, task id, clock at the call)

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.calls.append(("v1", result.task_id, self.clock.monotonic()))
        answer = self.v1_script.pop(0) if self.v1_script else None
        if isinstance(answer, Exception):
            raise answer

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        self.calls.append(("v2", result.task_id, self.clock.monotonic()))
        self.clock.advance(5.0)  # a slow answer: the claimed task's lease still counts from the send
        answer = self.v2_script.pop(0) if self.v2_script else None
        if isinstance(answer, Exception):
            raise answer
        assert answer is None or isinstance(answer, Task)
        return answer


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, object, object]] = []
        self.done = threading.Event()

    def on_chained(self, task: Task | None, sent_at: float) -> None:
        self.events.append(("chained", task.task_id if task else None, sent_at))

    def on_done(self, outcome: ReportOutcome) -> None:
        self.events.append(("done", outcome.delivered, outcome.via))
        self.done.set()


def deliver(port: object, clock: FakeClock, *, chain: bool = True, reporter: Reporter | None = None,
            recorder: Recorder | None = None) -> tuple[Reporter, Recorder]:
    rec = recorder or Recorder()
    rep = reporter or Reporter(port, rec.on_done, clock=clock, backoff_cap_seconds=0.05)  # type: ignore[arg-type]
    rec.done.clear()
    rep.submit(TaskResult("t1", "wf1", TaskStatus.COMPLETED, worker_id="w1"), retry_seconds=30.0,
               on_chained=rec.on_chained if chain else None)
    assert rec.done.wait(10), "no outcome"
    return rep, rec


NEXT = Task("t2", "wf2", "job", poll_count=1)


def test_the_claimed_task_and_the_send_time_come_once_before_the_outcome() -> None:
    clock = FakeClock(start=100.0)
    port = ScriptedPort(clock, v2=[NEXT])
    rep, rec = deliver(port, clock)
    assert rec.events == [("chained", "t2", 100.0), ("done", True, "v2")]  # sent at 100, answered at 105
    assert [c[0] for c in port.calls] == ["v2"]
    assert rep.chaining
    rep.close()


def test_no_task_to_claim_still_ends_the_chain_once() -> None:
    clock = FakeClock()
    port = ScriptedPort(clock, v2=[None])
    rep, rec = deliver(port, clock)
    assert rec.events == [("chained", None, 1000.0), ("done", True, "v2")]
    rep.close()


def test_a_failed_update_v2_is_never_resent_its_retries_are_v1() -> None:
    clock = FakeClock()
    port = ScriptedPort(clock, v2=[ConductorUnavailable("connection reset")], v1=[ConductorUnavailable("x")])
    rep, rec = deliver(port, clock)
    assert [c[0] for c in port.calls] == ["v2", "v1", "v1"]  # a second update-v2 would claim again
    assert rec.events[0][:2] == ("chained", None)
    assert rec.events[-1] == ("done", True, "v1")
    assert rep.chaining  # an outage says nothing about the endpoint
    rep.close()


@pytest.mark.parametrize("code", [404, 405])
def test_no_endpoint_means_v1_at_once_and_for_good(code: int) -> None:
    clock = FakeClock()
    refused = (ConductorNotFound if code == 404 else ConductorRejected)("no such endpoint", status_code=code)
    port = ScriptedPort(clock, v2=[refused])
    rep, rec = deliver(port, clock)
    assert [c[0] for c in port.calls] == ["v2", "v1"]
    assert rec.events == [("chained", None, 1000.0), ("done", True, "v1")]
    assert not rep.chaining
    # The next result does not try update-v2 again; its chain ends at once with nothing.
    rec.events.clear()
    rep, rec = deliver(port, clock, reporter=rep, recorder=rec)
    assert [c[0] for c in port.calls] == ["v2", "v1", "v1"]
    assert rec.events[0][:2] == ("chained", None) and rec.events[-1] == ("done", True, "v1")
    rep.close()


def test_a_404_that_v1_confirms_is_a_gone_task_and_update_v2_stays_on() -> None:
    clock = FakeClock()
    gone = ConductorNotFound("No such workflow found by id: wf1", status_code=404)
    port = ScriptedPort(clock, v2=[gone], v1=[ConductorNotFound("No such workflow", status_code=404)])
    rep, rec = deliver(port, clock)
    assert [c[0] for c in port.calls] == ["v2", "v1"]
    assert rec.events[-1] == ("done", False, "")  # gone: final, as with v1
    assert rep.chaining
    rep.close()


def test_a_port_without_update_v2_never_chains() -> None:
    class V1Only:
        def __init__(self) -> None:
            self.calls = 0

        def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
            self.calls += 1

    clock = FakeClock()
    port = V1Only()
    rep, rec = deliver(port, clock)
    assert not rep.chaining and port.calls == 1
    assert rec.events == [("chained", None, 1000.0), ("done", True, "v1")]
    rep.close()


def test_without_on_chained_the_update_is_v1_even_when_the_port_has_update_v2() -> None:
    clock = FakeClock()
    port = ScriptedPort(clock, v2=[NEXT])
    rep, rec = deliver(port, clock, chain=False)
    assert [c[0] for c in port.calls] == ["v1"] and rec.events == [("done", True, "v1")]
    rep.close()
