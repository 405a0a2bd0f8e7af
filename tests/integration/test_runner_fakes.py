"""The runner's main loop with an in-memory Conductor and lease engine, and real child processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.lease import FenceReason, LeasePolicy
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import PollSettings, RunOptions, RunOutcome, TaskTypePlan
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.snapshot import TaskState
from leasecore.state.outbox import Outbox
from tests.integration.runner_fakes import (
    FakeConductor,
    FakeEngine,
    FakeSupervisor,
    Published,
    make_task,
    python_spec,
    to_result,
)
from tests.support import wait_until

QUICK = "print('hello'); print('world')"
SLEEP = "import time; print('started', flush=True); time.sleep({})"
FAIL = "import sys; sys.exit(3)"
# A reported task's calls on the engine: the final update is guarded (begin_final_update before it,
# reported once acknowledged: FinalUpdates, on the runner's default path too), then the runner's own
# reported when it forgets the task.
REPORTED_LIFE = ["track", "child_started", "child_exited", "begin_final_update", "reported", "reported"]


class Harness:
    def __init__(
        self, spec: str, options: RunOptions, *, concurrency: int = 1, outbox: Outbox | None = None
    ) -> None:
        self.conductor = FakeConductor()
        self.supervisor = FakeSupervisor()
        self.engines: list[FakeEngine] = []
        self.outbox = outbox
        plan = TaskTypePlan(
            poll=PollSettings("t", concurrency=concurrency, timeout_ms=200, worker_id="w1"),
            spec=python_spec(spec),
            worker_id="w1",
            make_policy=lambda task: LeasePolicy(response_timeout_seconds=30),
            kill_grace_seconds=1.0,
        )

        def make_engine(on_fence):  # type: ignore[no-untyped-def]
            engine = FakeEngine(on_fence)
            self.engines.append(engine)
            return engine

        def make_reporter(updates, done):  # type: ignore[no-untyped-def]
            return Reporter(updates, done, outbox=self.outbox, backoff_cap_seconds=0.2)

        self.runner = Runner(
            [plan],
            conductor=self.conductor,
            make_engine=make_engine,
            supervisor=self.supervisor,
            to_result=to_result,
            options=options,
            reporter=make_reporter,
        )
        self.outcome: RunOutcome | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def engine(self) -> FakeEngine:
        return self.engines[0]

    def _run(self) -> None:
        self.outcome = self.runner.run()

    def start(self) -> Harness:
        self.thread.start()
        return self

    def finish(self, timeout: float = 60.0) -> RunOutcome:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the runner did not stop"
        assert self.outcome is not None
        return self.outcome


@pytest.fixture
def harnesses() -> Iterator[list[Harness]]:
    made: list[Harness] = []
    yield made
    for h in made:
        if h.thread.is_alive():
            h.runner.request_stop(force=True)
            h.thread.join(30)
        h.supervisor.close()


def test_once_runs_one_task_streams_its_output_and_reports_before_heartbeats_stop(
    harnesses: list[Harness],
) -> None:
    h = Harness(QUICK, RunOptions(once=True))
    harnesses.append(h)
    h.conductor.add(make_task("a"), make_task("b"))
    outcome = h.start().finish()
    assert outcome.started == 1 and outcome.statuses == (TaskStatus.COMPLETED,)
    assert h.conductor.statuses() == {"a": TaskStatus.COMPLETED}
    assert h.conductor.logs["a"] == ["hello", "world"]
    assert h.engine.names("a") == REPORTED_LIFE
    assert h.engine.calls[-1] == ("stop", "")  # heartbeats stop last
    assert [t.task_id for t in h.conductor.queued["t"]] == ["b"]  # --once took only one


def test_once_with_nothing_to_do_ends_after_the_wait(harnesses: list[Harness]) -> None:
    h = Harness(QUICK, RunOptions(once=True, once_wait_seconds=0.3))
    harnesses.append(h)
    started = time.monotonic()
    outcome = h.start().finish()
    assert outcome.started == 0
    assert time.monotonic() - started < 20


def test_a_failing_command_is_reported_failed(harnesses: list[Harness]) -> None:
    h = Harness(FAIL, RunOptions(once=True))
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    outcome = h.start().finish()
    assert outcome.statuses == (TaskStatus.FAILED,)
    assert h.conductor.updates[0].reason_for_incompletion == "exit code 3"


def test_a_task_delivered_again_while_running_is_not_started_twice(harnesses: list[Harness]) -> None:
    h = Harness(SLEEP.format(1.5), RunOptions(max_tasks=2), concurrency=2)
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="task a started")
    h.conductor.add(make_task("a"))  # the server hands it out again
    wait_until(lambda: not h.conductor.queued["t"], what="the duplicate polled")
    h.conductor.add(make_task("b"))
    outcome = h.finish()
    assert sorted(h.supervisor.children) == ["a", "b"]
    assert outcome.statuses == (TaskStatus.COMPLETED, TaskStatus.COMPLETED)
    assert h.engine.names("a").count("child_started") == 1  # one child; the re-poll only refreshed the lease


def test_concurrent_tasks_overlap(harnesses: list[Harness]) -> None:
    h = Harness(SLEEP.format(2), RunOptions(max_tasks=3), concurrency=3)
    harnesses.append(h)
    h.conductor.add(make_task("a"), make_task("b"), make_task("c"))
    started = time.monotonic()
    outcome = h.start().finish()
    assert outcome.statuses == (TaskStatus.COMPLETED,) * 3
    assert time.monotonic() - started < 5.5  # three 2 s tasks one after the other would take 6 s


def test_stop_terminates_children_and_reports_them_failed_for_a_prompt_retry(
    harnesses: list[Harness],
) -> None:
    h = Harness(SLEEP.format(60), RunOptions(), concurrency=2)
    harnesses.append(h)
    h.conductor.add(make_task("a"), make_task("b"))
    h.start()
    wait_until(lambda: len(h.supervisor.children) == 2, what="both tasks started")
    h.runner.request_stop()
    outcome = h.finish()
    assert outcome.statuses == (TaskStatus.FAILED, TaskStatus.FAILED)
    assert {u.reason_for_incompletion for u in h.conductor.updates} == {"worker shutting down"}
    assert all(c.proc.poll() is not None for c in h.supervisor.children.values())
    for task_id in "ab":
        assert h.engine.names(task_id) == REPORTED_LIFE


def test_while_updates_fail_the_runner_claims_no_more_than_its_concurrency_can_report(
    harnesses: list[Harness],
) -> None:
    # A server that hands out tasks but refuses updates: each finished child frees its slot, and the
    # runner used to claim the whole queue (every lease held, every result piling up).
    h = Harness(QUICK, RunOptions(), concurrency=2)
    harnesses.append(h)
    h.conductor.fail_updates = True
    h.conductor.add(*[make_task(f"t{i}") for i in range(40)])
    h.start()
    # (each refused update of unknown fate waits out the late-beat margin before it is read back)
    wait_until(lambda: h.conductor.failed_updates >= 40, timeout_seconds=90, what="many refused updates")
    claimed = 40 - len(h.conductor.queued["t"])
    assert 8 <= claimed <= 2 + 8, claimed  # running (2) plus reporting (at most max(2, 8))
    h.conductor.fail_updates = False  # the server takes updates again: the queue drains
    wait_until(lambda: len(h.conductor.statuses()) == 40, what="every task reported")
    assert set(h.conductor.statuses().values()) == {TaskStatus.COMPLETED}
    h.runner.request_stop()
    h.finish()


def test_drain_lets_a_running_task_finish(harnesses: list[Harness]) -> None:
    h = Harness(SLEEP.format(1.5), RunOptions(drain=True, drain_timeout_seconds=60))
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="task a started")
    h.runner.request_stop()
    outcome = h.finish()
    assert outcome.statuses == (TaskStatus.COMPLETED,)


def test_drain_timeout_then_terminates(harnesses: list[Harness]) -> None:
    h = Harness(SLEEP.format(60), RunOptions(drain=True, drain_timeout_seconds=0.5))
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="task a started")
    h.runner.request_stop()
    outcome = h.finish()
    assert outcome.statuses == (TaskStatus.FAILED,)
    assert h.conductor.updates[0].reason_for_incompletion == "worker shutting down"


def test_lost_ownership_kills_the_tree_and_reports_nothing(harnesses: list[Harness]) -> None:
    h = Harness(SLEEP.format(60), RunOptions(once=True))
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="task a started")
    h.engine.fence("a", FenceReason.OWNERSHIP_LOST, kill=True)
    outcome = h.finish()
    assert outcome.statuses == (None,)
    assert h.conductor.updates == []
    assert h.supervisor.children["a"].proc.returncode == -9
    assert h.engine.names("a")[-1] == "reported"  # no more heartbeats for it either


def test_an_undelivered_result_goes_to_the_outbox_and_is_delivered_later(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    outbox = Outbox(tmp_path / "outbox", server="http://x/api")
    h = Harness(QUICK, RunOptions(once=True, report_retry_seconds=1.0), outbox=outbox)
    harnesses.append(h)
    h.conductor.fail_updates = True
    h.conductor.add(make_task("a"))
    outcome = h.start().finish()
    assert outcome.statuses == (None,)
    files = list((tmp_path / "outbox").glob("*.json"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    h.conductor.fail_updates = False
    report = outbox.deliver(lambda r: h.conductor.update(r))
    assert report.delivered == 1
    assert h.conductor.statuses() == {"a": TaskStatus.COMPLETED}
    assert not list((tmp_path / "outbox").glob("*.json"))


def test_reporter_gives_up_on_4xx_without_saving(tmp_path: Path) -> None:
    from leasecore.errors import ConductorNotFound

    class Gone:
        calls = 0

        def update(self, result: object, *, timeout_seconds: float | None = None) -> None:
            Gone.calls += 1
            raise ConductorNotFound("404 task not found")

    done: list[ReportOutcome] = []
    outbox = Outbox(tmp_path / "o", server="http://x/api")
    reporter = Reporter(Gone(), done.append, outbox=outbox)
    reporter.submit(to_result(make_task("a"), type("E", (), {"exit_code": 0})(), None, "w"), retry_seconds=30)
    reporter.close()
    assert Gone.calls == 1
    assert done[0].delivered is False and done[0].saved_to is None
    assert outbox.entries() == []


def test_a_result_the_server_refuses_is_followed_by_a_bare_failed_so_it_is_retried_now(
    harnesses: list[Harness],
) -> None:
    # A result the server cannot take (Conductor answers 500 'not retryable' for one nested too deep,
    # 400/413 for others) used to be dropped: the task then sat IN_PROGRESS until its response timeout.
    from leasecore.errors import ConductorRejected

    h = Harness(QUICK, RunOptions(once=True))
    harnesses.append(h)
    error = "POST /tasks -> HTTP 500: JSON parse error: nested too deeply"
    h.conductor.refuse = (
        lambda r: ConductorRejected(error, status_code=500) if r.status is TaskStatus.COMPLETED else None
    )
    h.conductor.add(make_task("a"))
    outcome = h.start().finish()
    assert [r.status for r in h.conductor.refused] == [TaskStatus.COMPLETED]
    (sent,) = h.conductor.updates
    assert (sent.status, dict(sent.output_data), sent.logs) == (TaskStatus.FAILED, {}, ())
    expected = f"the server refused the task's result ({error}); reported without its output"
    assert sent.reason_for_incompletion == expected
    assert outcome.statuses == (TaskStatus.FAILED,)  # what the server has: --once exits 5, not 0


@pytest.mark.parametrize(
    ("status", "code", "bare"),
    [
        (TaskStatus.FAILED_WITH_TERMINAL_ERROR, 413, TaskStatus.FAILED_WITH_TERMINAL_ERROR),  # stays no-retry
        (TaskStatus.COMPLETED, 400, TaskStatus.FAILED),
        (TaskStatus.IN_PROGRESS, 400, None),  # a yield or a hand-back: a FAILED would spend a retry
        (TaskStatus.COMPLETED, 409, None),  # not "this body": maybe not ours any more
        (TaskStatus.COMPLETED, 404, None),  # gone
    ],
)
def test_which_refused_results_are_followed_by_a_bare_one(
    status: TaskStatus, code: int, bare: TaskStatus | None
) -> None:
    from leasecore.errors import ConductorNotFound, ConductorRejected

    sent: list[TaskResult] = []

    class Picky:
        def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
            if result.output_data:
                kind = ConductorNotFound if code == 404 else ConductorRejected
                raise kind(f"HTTP {code}", status_code=code)
            sent.append(result)

    done: list[ReportOutcome] = []
    reporter = Reporter(Picky(), done.append)
    reporter.submit(TaskResult("a", "w", status, output_data={"exitCode": 0}), retry_seconds=30)
    reporter.close()
    assert [r.status for r in sent] == ([] if bare is None else [bare])
    assert done[0].delivered is (bare is not None) and done[0].sent_status is bare


def test_saved_results_expire_and_foreign_servers_are_ignored(tmp_path: Path) -> None:
    from leasecore.clock import FakeClock

    clock = FakeClock()
    task: Task = make_task("a")
    result = to_result(task, type("E", (), {"exit_code": 0})(), None, "w")
    Outbox(tmp_path, server="http://other/api", clock=clock).save(result)
    mine = Outbox(tmp_path, server="http://x/api", clock=clock, max_age_seconds=60)
    mine.save(result)
    clock.advance(61)
    sent: list[object] = []
    assert mine.deliver(sent.append).dropped == 1
    assert sent == []
    assert len(Outbox(tmp_path, server="http://other/api", clock=clock).entries()) == 1


def test_an_exec_timeout_fence_is_reported_as_a_timeout(harnesses: list[Harness]) -> None:
    # The process layer words it ("exec timeout after Ns"): the runner must say timed_out=True.
    h = Harness(SLEEP.format(60), RunOptions(once=True))
    harnesses.append(h)
    h.conductor.add(make_task("a"))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="task a started")
    h.engine.fence("a", FenceReason.EXEC_TIMEOUT)
    outcome = h.finish()
    assert outcome.statuses == (TaskStatus.FAILED,)
    assert h.conductor.updates[0].reason_for_incompletion == "timed out"  # the fake's timed_out wording


def test_a_poll_stuck_past_its_timeout_does_not_hold_up_the_stop(harnesses: list[Harness]) -> None:
    h = Harness(QUICK, RunOptions())  # polls time out after 0.2 s
    harnesses.append(h)
    h.conductor.stuck.set()
    h.start()
    wait_until(lambda: h.conductor.polls >= 1, what="a poll in flight")
    stop_at = time.monotonic()
    h.runner.request_stop()
    outcome = h.finish(timeout=30)
    # Bounded by the poll timeout + 0.5 s slack, not by the poll's HTTP timeout; margin for load.
    assert time.monotonic() - stop_at < 0.2 + 0.5 + 3.0
    assert outcome.started == 0
    h.conductor.stuck.clear()


def test_a_task_from_a_late_poll_is_handed_straight_back(harnesses: list[Harness]) -> None:
    h = Harness(QUICK, RunOptions())
    harnesses.append(h)
    h.conductor.stuck.set()
    h.start()
    wait_until(lambda: h.conductor.polls >= 1, what="a poll in flight")
    h.runner.request_stop()
    h.conductor.add(make_task("late"))
    h.conductor.stuck.clear()  # the stuck poll returns the task (maybe after the loop ended)
    outcome = h.finish(timeout=30)
    assert h.supervisor.children == {}  # never started
    assert [(u.task_id, u.reason_for_incompletion) for u in h.conductor.updates] in (
        [],  # the poll ended after the runner stopped waiting for it: the server retries the task
        [("late", "worker shutting down")],
    )
    assert outcome.statuses in ((), (TaskStatus.FAILED,))


def test_refused_credentials_are_logged_once_and_polls_back_off(caplog: pytest.LogCaptureFixture) -> None:
    from leasecore.errors import ConductorAuthError
    from leasecore.runner.upstream.poller import Poller, WorkBudget

    conductor = FakeConductor()
    conductor.poll_error = ConductorAuthError("HTTP 401 INVALID_TOKEN")
    stop = threading.Event()
    poller = Poller(conductor, PollSettings("t", timeout_ms=100), lambda task, at: None,
                    budget=WorkBudget(None), stop=stop)
    caplog.set_level("INFO", logger="conductor_run.poll")
    started = time.monotonic()
    poller.start()
    try:
        wait_until(lambda: conductor.polls >= 3, what="three refused polls")
    finally:
        stop.set()
        poller.wake()
        assert poller.join(10)
    # Backoff: at least 0.25 s + 0.5 s (the worst jitter draws) before the third poll.
    assert time.monotonic() - started >= 0.7
    lines = [r.getMessage() for r in caplog.records if r.name == "conductor_run.poll"]
    assert len(lines) == 1, lines
    assert "refused our credentials" in lines[0] and "CONDUCTOR_AUTH_KEY" in lines[0]
    assert "unreachable" not in lines[0]
    assert poller.reachability.kind == "auth"


def test_a_result_refused_for_credentials_is_retried_then_kept(tmp_path: Path) -> None:
    from leasecore.errors import ConductorAuthError

    class Refusing:
        calls = 0

        def update(self, result: object, *, timeout_seconds: float | None = None) -> None:
            Refusing.calls += 1
            raise ConductorAuthError("HTTP 401")

    done: list[ReportOutcome] = []
    outbox = Outbox(tmp_path / "o", server="http://x/api")
    reporter = Reporter(Refusing(), done.append, outbox=outbox, backoff_cap_seconds=0.2)
    result = to_result(make_task("a"), type("E", (), {"exit_code": 0})(), None, "w")
    reporter.submit(result, retry_seconds=1.5)
    reporter.close()
    assert Refusing.calls >= 2  # retried, unlike a 404
    assert done[0].delivered is False and done[0].saved_to is not None
    assert [e.result.task_id for e in outbox.entries()] == ["a"]


def test_the_outbox_keeps_results_on_refused_credentials_and_on_stop(tmp_path: Path) -> None:
    from leasecore.errors import ConductorAuthError

    outbox = Outbox(tmp_path, server="http://x/api")
    for task_id in "abc":
        outbox.save(to_result(make_task(task_id), type("E", (), {"exit_code": 0})(), None, "w"))

    def refuse(result: object) -> None:
        raise ConductorAuthError("HTTP 401")

    assert outbox.deliver(refuse).kept == 3
    sent: list[object] = []
    report = outbox.deliver(sent.append, stop=lambda: len(sent) == 1)  # a signal after the first
    assert (report.delivered, report.kept, len(outbox.entries())) == (1, 2, 2)


def test_the_signal_relay_records_until_a_target_is_set_and_forwards_the_count() -> None:
    from leasecore.runner.loop.signals import SignalRelay

    relay = SignalRelay()
    relay(15, 1)  # during setup: recorded only
    got: list[tuple[int, int]] = []
    relay.target = lambda signum, count: got.append((signum, count))
    relay(2, 2)
    relay.target = None
    relay(1, 3)  # after the run: recorded only
    assert (relay.first, relay.count, got) == (15, 3, [(2, 2)])


def test_the_signal_relay_cuts_a_start_up_step_short_once() -> None:
    from leasecore.runner.loop.signals import SignalRelay, StartupInterrupted

    relay = SignalRelay()
    with pytest.raises(StartupInterrupted) as info, relay.interrupting():
        try:
            relay(2, 1)  # what the handler does, mid-step
        finally:
            relay(15, 2)  # a second signal while the first unwinds: recorded, not raised again
    assert (info.value.signum, relay.first, relay.count) == (2, 2, 2)
    relay = SignalRelay()
    relay(15, 1)  # before the step: it does not even start
    with pytest.raises(StartupInterrupted), relay.interrupting():
        pytest.fail("the step ran after a signal")


class _PollerBreaks(FakeConductor):
    """Polling type "t" fails with a bug (not a ConductorError): its poller thread ends."""

    def poll(self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
             domain: str | None = None) -> list[Task]:  # fmt: skip
        if task_type == "t":
            raise RuntimeError("a bug in the poll")
        return super().poll(task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id, domain=domain)


def test_with_a_paused_type_beside_it_the_end_of_the_last_polling_type_still_ends_the_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A paused type's poller waits for the stop (a runner of paused types idles); it must not keep a
    # runner up whose only polling type has ended.
    def plan(task_type: str, *, paused: bool = False) -> TaskTypePlan:
        return TaskTypePlan(poll=PollSettings(task_type, timeout_ms=100, worker_id="w1", paused=paused),
                            spec=python_spec(QUICK), worker_id="w1",
                            make_policy=lambda task: LeasePolicy(response_timeout_seconds=30))  # fmt: skip

    supervisor = FakeSupervisor()
    runner = Runner([plan("t"), plan("a", paused=True)], conductor=_PollerBreaks(),
                    make_engine=FakeEngine, supervisor=supervisor, to_result=to_result,
                    options=RunOptions())  # fmt: skip
    outcome: list[RunOutcome] = []
    thread = threading.Thread(target=lambda: outcome.append(runner.run()), daemon=True)
    caplog.set_level("INFO")
    thread.start()
    try:
        thread.join(30)
        assert not thread.is_alive(), "the runner idled on with no type left polling"
    finally:
        if thread.is_alive():
            runner.request_stop(force=True)
            thread.join(30)
        supervisor.close()
    assert outcome == [RunOutcome(started=0, poller_failed=True)]  # exit 1, not a clean 0
    assert "the poller of t failed" in caplog.text and "no more work to do" in caplog.text


def test_a_result_kept_in_the_outbox_shows_as_undelivered_until_its_file_is_gone(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox", server="http://x/api")
    conductor, supervisor, shots = FakeConductor(), FakeSupervisor(), Published()
    conductor.fail_updates = True
    conductor.add(make_task("a"))
    plan = TaskTypePlan(poll=PollSettings("t", timeout_ms=100, worker_id="w1"), spec=python_spec(QUICK),
                        worker_id="w1",
                        make_policy=lambda task: LeasePolicy(response_timeout_seconds=30))  # fmt: skip
    runner = Runner([plan], conductor=conductor, make_engine=FakeEngine, supervisor=supervisor,
                    to_result=to_result, options=RunOptions(report_retry_seconds=0.5), status=shots,
                    reporter=lambda updates, done: Reporter(updates, done, outbox=outbox,
                                                            backoff_cap_seconds=0.2))  # fmt: skip
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: shots.states() == [("a", TaskState.UNDELIVERED)], what="shown undelivered")
        (saved,) = (tmp_path / "outbox").glob("*.json")
        saved.unlink()  # as a delivery (or a drop) by the outbox's redelivery does
        wait_until(lambda: shots.states() == [], what="the task no longer shown")
    finally:
        runner.request_stop()
        thread.join(30)
        supervisor.close()


IGNORES_TERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open({!r}, 'a').close(); "
    "time.sleep(60)"
)


def test_a_task_delivered_twice_while_its_copy_is_killed_keeps_one_slot(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    """Task a's copy ignores the TERM of its ownership fence; a is polled back twice meanwhile
    (pollCount 2, then 3). The two deliveries are one next run: one slot, so with 3 slots task b still
    finds one. (Before, the replaced delivery kept its slot for ever.)"""
    ready = tmp_path / "ignoring"
    h = Harness(IGNORES_TERM.format(str(ready)), RunOptions(), concurrency=3)
    harnesses.append(h)
    h.conductor.add(make_task("a", poll_count=1))
    h.start()
    wait_until(ready.exists, what="task a's copy to ignore TERM")
    first = h.supervisor.children["a"]
    h.engine.fence("a", FenceReason.OWNERSHIP_LOST)  # TERM: ignored, the copy lives on
    for poll_count in (2, 3):
        h.conductor.add(make_task("a", poll_count=poll_count))
        wait_until(lambda: not h.conductor.queued["t"], what=f"delivery {poll_count} polled")
    h.conductor.add(make_task("b", poll_count=1))
    wait_until(lambda: "b" in h.supervisor.children, what="task b started in the third slot")
    assert first.proc.poll() is None  # a's first copy still dies: its next run has not started
    assert h.supervisor.children["a"] is first
    h.engine.fence("a", FenceReason.OWNERSHIP_LOST, kill=True)
    wait_until(lambda: h.supervisor.children["a"] is not first, what="a's next run to start")
    assert first.proc.poll() is not None  # only after the copy was gone
    assert tracked_again_before_its_start(h.engine.names("a")), h.engine.names("a")


GATED = "import os, time\nwhile not os.path.exists({!r}): time.sleep(0.01)"


def test_a_redelivery_tracked_at_poll_as_its_earlier_run_ends_gets_a_lease_of_its_own(
    harnesses: list[Harness], tmp_path: Path
) -> None:
    """The poller tracks a's second delivery (acking the lease of a's first run, still here), then the
    first run ends and is forgotten (its lease with it) before the delivery reaches the main loop:
    the delivery must be tracked again, not run on the ended lease (no heartbeats, no fences)."""
    gate = tmp_path / "gate"
    h = Harness(GATED.format(str(gate)), RunOptions(max_tasks=2), concurrency=2)
    harnesses.append(h)
    in_track, go_on = threading.Event(), threading.Event()

    def hold_second_delivery(task: Task) -> None:
        if task.task_id == "a" and task.poll_count == 2:
            in_track.set()
            go_on.wait(30)

    h.engine.on_track = hold_second_delivery
    h.conductor.add(make_task("a", poll_count=1))
    h.start()
    wait_until(lambda: "a" in h.supervisor.children, what="a's first run started")
    first = h.supervisor.children["a"]
    h.conductor.add(make_task("a", poll_count=2))
    assert in_track.wait(20), "the poller never tracked the second delivery"
    gate.touch()  # the first run ends and is reported, while its second delivery is held in track
    wait_until(lambda: h.conductor.statuses().get("a") is TaskStatus.COMPLETED, what="a's first report")
    wait_until(lambda: h.engine.names("a").count("reported") == 2, what="the first run forgotten")
    go_on.set()
    wait_until(lambda: h.supervisor.children["a"] is not first, what="the second delivery's run")
    assert tracked_again_before_its_start(h.engine.names("a")), h.engine.names("a")
    h.finish()


def tracked_again_before_its_start(names: list[str]) -> bool:
    """Whether the last run's child was started on a lease tracked after the earlier run's ended."""
    last_start = len(names) - 1 - names[::-1].index("child_started")
    ended = [i for i, name in enumerate(names[:last_start]) if name == "reported"]
    return bool(ended) and "track" in names[ended[-1] : last_start]
