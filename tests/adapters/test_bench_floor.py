"""bench/floor.py: the floor, and floor-v2 (the same loop chaining through update-v2), on the bench server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import BenchServer
from bench.throughput import one_run

TASKS = 30


@pytest.fixture
def bench_server(tmp_path: Path) -> Iterator[BenchServer]:
    srv = BenchServer(tmp_path / "server.log")
    yield srv
    srv.close()


@pytest.mark.parametrize(("kind", "via"), [("floor", "v1"), ("floor-v2", "v2")])
def test_every_task_completes_through_the_kinds_endpoint(
    bench_server: BenchServer, tmp_path: Path, kind: str, via: str
) -> None:
    result = one_run(bench_server, tmp_path, kind, 1, TASKS, 2)
    assert result["statuses"] == {"COMPLETED": TASKS}
    assert result["updates_via"] == {via: TASKS}
    polls = bench_server.requests()[f"tp_{kind.replace('-', '_')}_1"]["poll"]
    if kind == "floor":
        assert polls >= TASKS // 2  # a poll for every free slot: at most two tasks per poll
    else:
        # Each report claimed the next task: only the slots' first tasks (and an empty queue at the end,
        # answered 204, then the long polls until the bench stops it) needed a poll.
        assert polls < TASKS // 2
