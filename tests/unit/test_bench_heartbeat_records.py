"""The heartbeat section's records of FAILED tasks (bench/heartbeat.py): each one's reason as the server
holds it and the worker's log lines naming it, counted by reason, bounded."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from bench import heartbeat
from bench.harness import BenchServer


class _Client:
    def __init__(self, reasons: dict[str, str | None]) -> None:
        self.reasons = reasons
        self.asked: list[str] = []

    def get_task(self, task_id: str) -> dict[str, Any]:
        self.asked.append(task_id)
        if task_id == "t-gone":
            raise RuntimeError("HTTP 404")
        return {"taskId": task_id, "reasonForIncompletion": self.reasons.get(task_id)}


class _Server:
    def __init__(self, reasons: dict[str, str | None]) -> None:
        self.client = _Client(reasons)


def test_failed_tasks_are_kept_with_their_reason_and_log_lines_and_counted(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text(
        "2026 INFO task t-a (hb, workflow w1) started: pid 10\n"
        "2026 INFO task t-ok (hb, workflow w2) started: pid 11\n"
        "2026 WARNING task t-a: lease expired at its TERM point; fencing\n"
        "2026 INFO task t-a: child exited; reporting FAILED\n"
        "2026 INFO task t-b: child exited; reporting FAILED\n"
    )
    why = "lease expired before the result"
    srv = _Server({"t-a": why, "t-b": why, "t-c": None})
    statuses = {"t-ok": "COMPLETED", "t-a": "FAILED", "t-b": "FAILED", "t-c": "FAILED_WITH_TERMINAL_ERROR",
                "t-gone": "FAILED", "t-lost": "TIMED_OUT"}  # fmt: skip
    got = heartbeat.failed_records(cast(BenchServer, srv), statuses, log)
    assert sorted(srv.client.asked) == ["t-a", "t-b", "t-c", "t-gone"]  # only the FAILED ones are read
    assert got["failed_by_reason"] == {
        why: 2,
        "(no reason given)": 1,
        "(could not read the task: RuntimeError: HTTP 404)": 1,
    }
    kept = {r["task_id"]: r for r in got["failed_tasks"]}
    assert set(kept) == {"t-a", "t-b", "t-c", "t-gone"}
    assert kept["t-a"]["log"] == [
        "2026 INFO task t-a (hb, workflow w1) started: pid 10",
        "2026 WARNING task t-a: lease expired at its TERM point; fencing",
        "2026 INFO task t-a: child exited; reporting FAILED",
    ]
    assert kept["t-c"] == {"task_id": "t-c", "status": "FAILED_WITH_TERMINAL_ERROR",
                           "reason": "(no reason given)", "log": []}  # fmt: skip


def test_the_records_are_bounded(tmp_path: Path) -> None:
    n = heartbeat.MAX_FAILED_KEPT + 7
    ids = [f"t-{i:03d}" for i in range(n)]
    log = tmp_path / "worker.log"
    many = heartbeat.MAX_LINES_PER_TASK + 5
    log.write_text("".join(f"line {j} about {t}\n" for t in ids[:2] for j in range(many)))
    srv = cast(BenchServer, _Server(dict.fromkeys(ids, "x")))
    got = heartbeat.failed_records(srv, dict.fromkeys(ids, "FAILED"), log)
    assert got["failed_by_reason"] == {"x": n}  # every one counted
    assert len(got["failed_tasks"]) == heartbeat.MAX_FAILED_KEPT
    assert len(got["failed_tasks"][0]["log"]) == heartbeat.MAX_LINES_PER_TASK


def test_a_run_with_no_failed_task_keeps_nothing(tmp_path: Path) -> None:
    got = heartbeat.failed_records(cast(BenchServer, _Server({})), {"t": "COMPLETED"}, tmp_path / "none.log")
    assert got["failed_by_reason"] == {} and got["failed_tasks"] == []
