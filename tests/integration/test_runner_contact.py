"""The runner's default paths: every final update is guarded, every server call is server contact.

Real child processes, an in-memory Conductor; the second test runs the real ``LeaseEngine``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from leasecore.errors import ConductorUnavailable
from leasecore.lease import FenceAction, LeasePolicy
from leasecore.models import TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.loop.runner import Runner
from leasecore.runner.ports import PollSettings, RunOptions, RunOutcome, TaskTypePlan
from leasecore.runner.upstream.server_contact import RecordedLeaseCalls, ServerContact
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


def plan(spec: str, response_timeout: float = 30) -> TaskTypePlan:
    return TaskTypePlan(
        poll=PollSettings("t", concurrency=1, timeout_ms=200, worker_id="w1"),
        spec=python_spec(spec),
        worker_id="w1",
        make_policy=lambda task: LeasePolicy(response_timeout_seconds=response_timeout),
        kill_grace_seconds=1.0,
    )


def run_in_thread(runner: Runner) -> tuple[threading.Thread, list[RunOutcome]]:
    outcomes: list[RunOutcome] = []
    thread = threading.Thread(target=lambda: outcomes.append(runner.run(install_signal_handlers=False)),
                              daemon=True)
    thread.start()
    return thread, outcomes


def test_the_default_reporter_guards_every_final_update() -> None:
    engines: list[FakeEngine] = []
    seen_at_update: list[list[str]] = []

    class Conductor(FakeConductor):
        def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
            seen_at_update.append(engines[0].names(result.task_id))
            super().update(result, timeout_seconds=timeout_seconds)

    def make_engine(on_fence: Callable[[str, FenceAction], None]) -> FakeEngine:
        engines.append(FakeEngine(on_fence))
        return engines[0]

    conductor, supervisor = Conductor(), FakeSupervisor()
    conductor.add(make_task("a"))
    runner = Runner([plan("print('hi')")], conductor=conductor, make_engine=make_engine,
                    supervisor=supervisor, to_result=to_result, options=RunOptions(once=True))  # no reporter=
    try:
        thread, outcomes = run_in_thread(runner)
        thread.join(60)
        assert not thread.is_alive() and outcomes[0].statuses == (TaskStatus.COMPLETED,)
    finally:
        supervisor.close()
    # The update went out after begin_final_update (no heartbeat can start or be in flight) ...
    assert seen_at_update == [["track", "child_started", "child_exited", "begin_final_update"]]
    # ... and its acknowledgement ended the heartbeats at once (FinalUpdates), before the runner forgot it.
    assert engines[0].names("a")[4:] == ["reported", "reported"]


class LeaseServer:
    """The engine's two calls; ``failing`` makes them fail like an unreachable server."""

    def __init__(self) -> None:
        self.failing = threading.Event()
        self.beats = 0

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        if self.failing.is_set():
            raise ConductorUnavailable("connection refused (test)")
        self.beats += 1

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        if self.failing.is_set():
            raise ConductorUnavailable("connection refused (test)")
        return TaskOwnership(TaskStatus.IN_PROGRESS)


def test_heartbeats_are_server_contact_while_every_slot_is_busy_and_their_failures_are_failures() -> None:
    conductor, supervisor = FakeConductor(), FakeSupervisor()
    lease_server, published = LeaseServer(), Published()
    contact = ServerContact()

    def make_engine(on_fence: Callable[[str, FenceAction], None]) -> LeaseEngine:
        return LeaseEngine(RecordedLeaseCalls(lease_server, contact), on_fence)

    conductor.add(make_task("a", response_timeout_seconds=2))
    # R = 2 s: a heartbeat every 1.6 s; the child outlives the test, the only slot stays busy.
    runner = Runner([plan("import time; time.sleep(120)", response_timeout=2)], conductor=conductor,
                    make_engine=make_engine, supervisor=supervisor, to_result=to_result, status=published,
                    contact=contact)
    thread, _ = run_in_thread(runner)
    try:
        wait_until(lambda: "a" in supervisor.children, what="the child to start")
        busy_since, polls = datetime.now(UTC), conductor.polls
        # Without polls, the status still shows the server answering (the heartbeats' answers).
        wait_until(lambda: lease_server.beats >= 2, what="two heartbeats")
        wait_until(lambda: (published.latest().last_ok_at or busy_since) > busy_since + timedelta(seconds=1),
                   what="a publish with a heartbeat's answer as the last contact")
        assert conductor.polls == polls, "the slot is busy: nothing was polled meanwhile"
        assert published.latest().consecutive_failures == 0
        lease_server.failing.set()
        wait_until(lambda: published.latest().consecutive_failures >= 1, what="a failed beat in the status")
        assert published.latest().last_error == "connection refused (test)"
        assert conductor.polls == polls
    finally:
        runner.request_stop(force=True)
        thread.join(60)
        supervisor.close()
    assert not thread.is_alive()


