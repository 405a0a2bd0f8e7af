"""Server contact from every call (polls, heartbeats, ownership checks, logs, updates), with a FakeClock."""

from __future__ import annotations

from datetime import timedelta

import pytest

from leasecore.clock import FakeClock
from leasecore.errors import ConductorAuthError, ConductorError, ConductorNotFound, ConductorUnavailable
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.loop.status import server_health
from leasecore.runner.upstream.server_contact import RecordedCalls, RecordedLeaseCalls, ServerContact


class Port:
    """Answers every call, or raises ``error`` while it is set."""

    def __init__(self) -> None:
        self.error: ConductorError | None = None
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.error is not None:
            raise self.error

    def poll(self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
             domain: str | None = None) -> list[Task]:
        self._call("poll")
        return []

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self._call("update")

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None:
        self._call("append_log")

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        self._call("extend_lease")

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        self._call("get_task_ownership")
        return TaskOwnership(TaskStatus.IN_PROGRESS)


RESULT = TaskResult("t1", "w1", TaskStatus.COMPLETED)


def test_a_heartbeat_is_server_contact_when_nothing_is_polled() -> None:
    clock = FakeClock()
    contact = ServerContact(clock)
    port = Port()
    calls, lease_calls = RecordedCalls(port, contact), RecordedLeaseCalls(port, contact)
    calls.poll("t", count=1, timeout_ms=100)
    polled_at = clock.now()
    clock.advance(13)  # every slot busy: no poll for 13 s, but the leases are extended
    lease_calls.extend_lease("t1", "w1", timeout_seconds=1)
    health = server_health([], contact, clock)
    assert health.last_ok_at == polled_at + timedelta(seconds=13) == clock.now()
    assert health.consecutive_failures == 0 and health.last_error is None


def test_failed_calls_of_any_kind_count_until_the_next_answer() -> None:
    clock = FakeClock()
    contact = ServerContact(clock)
    port = Port()
    calls, lease_calls = RecordedCalls(port, contact), RecordedLeaseCalls(port, contact)
    lease_calls.get_task_ownership("t1", timeout_seconds=1)
    answered_at = clock.now()
    port.error = ConductorUnavailable("connection refused")
    attempts = [
        lambda: lease_calls.extend_lease("t1", "w1", timeout_seconds=1),
        lambda: lease_calls.get_task_ownership("t1", timeout_seconds=1),
        lambda: calls.append_log("t1", "line"),
        lambda: calls.update(RESULT),
    ]
    for attempt in attempts:
        clock.advance(1)
        with pytest.raises(ConductorUnavailable):  # recorded, and still raised to the caller
            attempt()
    port.error = ConductorAuthError("401 INVALID_TOKEN")
    with pytest.raises(ConductorAuthError):
        calls.poll("t", count=1, timeout_ms=100)
    health = server_health([], contact, clock)
    assert health.consecutive_failures == 5
    assert health.last_error == "401 INVALID_TOKEN"
    assert health.last_ok_at == answered_at  # the newest answer, 5 s ago
    port.error = None
    calls.update(RESULT)
    health = server_health([], contact, clock)
    assert (health.consecutive_failures, health.last_error, health.last_ok_at) == (0, None, clock.now())


def test_a_404_is_an_answer_not_a_failure() -> None:
    clock = FakeClock()
    contact = ServerContact(clock)
    port = Port()
    port.error = ConductorNotFound("404 task not found")
    with pytest.raises(ConductorNotFound):  # the lease engine still learns the task is gone
        RecordedLeaseCalls(port, contact).extend_lease("t1", "w1", timeout_seconds=1)
    assert contact.consecutive_failures == 0 and contact.last_ok_at == clock.monotonic()


def test_no_call_yet_means_not_contacted() -> None:
    clock = FakeClock()
    health = server_health([], ServerContact(clock), clock)
    assert health.last_ok_at is None and health.consecutive_failures == 0
