"""The snapshot schema: JSON round trips, redaction, bounds, and lease health at a fixed ``now``."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from leasecore.clock import FakeClock
from leasecore.snapshot import (
    MAX_LINE_CHARS,
    MAX_OUTPUT_LINES,
    LeaseHealth,
    OutputTail,
    RunnerInfo,
    RunnerSnapshot,
    ServerHealth,
    TaskSnapshot,
    TaskState,
    iso_time,
    lease_health,
    redact_url,
    wall_time,
)

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def a_task(**changes: object) -> TaskSnapshot:
    fields: dict[str, object] = {
        "task_id": "7f3c1a2e-0000-4000-8000-000000000001",
        "workflow_id": "wf-1",
        "task_type": "encode",
        "state": TaskState.RUNNING,
        "started_at": at(-60),
        "child_pid": 4321,
        "last_ack_at": at(-2),
        "next_heartbeat_at": at(6),
        "lease_deadline_at": at(8),
        "lease_timeout_seconds": 10.0,
        "hard_deadline_at": at(3600),
        "recent_output": ("one", "two"),
    }
    fields.update(changes)
    return TaskSnapshot(**fields)  # type: ignore[arg-type]


def a_snapshot(*tasks: TaskSnapshot) -> RunnerSnapshot:
    runner = RunnerInfo(
        pid=99,
        worker_id="host-a",
        server_url="http://localhost:8080/api",
        started_at=at(-3600),
        process_start_ticks=12345,
        task_types=("encode",),
    )
    server = ServerHealth(last_ok_at=at(-0.5), consecutive_failures=0, backoff_seconds=0.0)
    return RunnerSnapshot(runner, server, tasks, updated_at=at(-0.2))


def test_a_snapshot_survives_a_json_round_trip() -> None:
    snapshot = a_snapshot(a_task(), a_task(task_id="t2", state=TaskState.UNDELIVERED, child_pid=None))
    text = json.dumps(snapshot.to_json_dict())
    assert RunnerSnapshot.from_json_dict(json.loads(text)) == snapshot


def test_times_are_iso_utc_with_milliseconds_and_epoch_millis_are_accepted() -> None:
    assert iso_time(datetime(2026, 3, 1, 13, 0, 0, 123456, tzinfo=UTC)) == "2026-03-01T13:00:00.123Z"
    data = a_snapshot().to_json_dict()
    data["updated_at"] = int(NOW.timestamp() * 1000)
    assert RunnerSnapshot.from_json_dict(data).updated_at == NOW


def test_a_snapshot_of_another_schema_version_is_refused() -> None:
    data = a_snapshot().to_json_dict()
    data["schema_version"] = 2
    with pytest.raises(ValueError, match="schema version 2"):
        RunnerSnapshot.from_json_dict(data)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://localhost:8080/api", "http://localhost:8080/api"),
        ("https://bob:s3cret@conductor.example.com/api", "https://conductor.example.com/api"),
        ("http://token@host:80/api?key=s3cret#frag", "http://host:80/api"),
    ],
)
def test_redact_url_drops_userinfo_query_and_fragment(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_credentials_never_reach_the_serialised_snapshot() -> None:
    runner = RunnerInfo(pid=1, worker_id="w", server_url="http://bob:s3cret@h/api", started_at=NOW)
    server = ServerHealth(consecutive_failures=1, last_error="connection refused: http://bob:s3cret@h/api")
    text = json.dumps(RunnerSnapshot(runner, server, (), NOW).to_json_dict())
    assert "s3cret" not in text
    assert "bob" not in text
    assert "http://h/api" in text


def test_recent_output_is_bounded_in_lines_and_characters() -> None:
    lines = tuple(f"{i:03d}" + "x" * 1000 for i in range(50))
    data = a_task(recent_output=lines).to_json_dict()
    assert len(data["recent_output"]) == MAX_OUTPUT_LINES
    assert data["recent_output"][0].startswith("030")
    assert all(len(line) == MAX_LINE_CHARS for line in data["recent_output"])
    assert data["last_output_line"] == data["recent_output"][-1]


def test_output_tail_keeps_the_last_lines_without_newlines() -> None:
    tail = OutputTail(max_lines=3, max_chars=5)
    for line in ["a\n", "b\r\n", "cccccccc\n", "d"]:
        tail.append(line)
    assert tail.lines() == ("b", "ccccc", "d")


def test_wall_time_converts_a_monotonic_deadline() -> None:
    # Given a clock whose monotonic 1000.0 is 2026-01-01T00:00:00Z
    clock = FakeClock(start=1000.0, wall=datetime(2026, 1, 1, tzinfo=UTC))
    clock.advance(5.0)
    # Then a deadline at monotonic 1012.5 is 12.5 s after the start of the year
    assert wall_time(1012.5, clock) == datetime(2026, 1, 1, 0, 0, 12, 500000, tzinfo=UTC)
    assert wall_time(None, clock) is None


@pytest.mark.parametrize(
    ("changes", "runner_stale", "expected"),
    [
        ({}, False, LeaseHealth.HEALTHY),
        ({}, True, LeaseHealth.STALE),
        ({"consecutive_failures": 1}, False, LeaseHealth.AT_RISK),
        ({"next_heartbeat_at": at(-1.5)}, False, LeaseHealth.AT_RISK),  # overdue beyond 1 s
        ({"next_heartbeat_at": at(-0.5)}, False, LeaseHealth.HEALTHY),  # late, within the grace
        ({"lease_deadline_at": at(3), "next_heartbeat_at": at(1)}, False, LeaseHealth.HEALTHY),
        ({"lease_deadline_at": at(3), "next_heartbeat_at": None}, False, LeaseHealth.AT_RISK),
        ({"lease_deadline_at": at(7), "next_heartbeat_at": None}, False, LeaseHealth.HEALTHY),
        ({"lease_deadline_at": at(-0.1)}, False, LeaseHealth.FENCING),
        ({"state": TaskState.TERMINATING}, False, LeaseHealth.FENCING),
        ({"fence_reason": "OWNERSHIP_LOST"}, False, LeaseHealth.FENCING),
        ({"state": TaskState.UNDELIVERED}, False, LeaseHealth.NO_LEASE),
        # A fenced task whose result waits in the outbox: no child, no lease; not "fencing" for a day.
        ({"state": TaskState.UNDELIVERED, "fence_reason": "LEASE_EXPIRED"}, False, LeaseHealth.NO_LEASE),
        ({"lease_deadline_at": None}, False, LeaseHealth.NO_LEASE),
    ],
)
def test_lease_health(changes: dict[str, object], runner_stale: bool, expected: LeaseHealth) -> None:
    assert lease_health(a_task(**changes), NOW, runner_stale=runner_stale) is expected
