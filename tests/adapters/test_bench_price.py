"""bench/price_cli.py: the bench-only build without guarantees runs tasks to COMPLETED, and takes out
what it names (checked in a process of its own: the patches are for the whole process)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.harness import ROOT, BenchServer
from bench.throughput import one_run

TASKS = 20

# whole runs of a worker process: slow (the lead refreshes tests/durations.json after the merge)
pytestmark = pytest.mark.slow


@pytest.fixture
def bench_server(tmp_path: Path) -> Iterator[BenchServer]:
    srv = BenchServer(tmp_path / "server.log")
    yield srv
    srv.close()


def test_the_bare_build_completes_every_task_through_update_v2(
    bench_server: BenchServer, tmp_path: Path
) -> None:
    result = one_run(bench_server, tmp_path, "conductor-run-bare", 1, TASKS, 2)
    assert result["statuses"] == {"COMPLETED": TASKS}
    assert result["updates_via"] == {"v2": TASKS}


def test_without_files_no_task_directory_is_made_and_without_record_no_journal(tmp_path: Path) -> None:
    code = (
        "import os, sys\n"
        "from bench import price_cli\n"
        "price_cli._without_files(); price_cli._without_record()\n"
        "from leasecore.process.taskfiles import TaskFiles\n"
        "from leasecore.process.linux.leftovers import StateRecord, TreeRecord\n"
        "f = TaskFiles.create_in(None, None, memory_limited=False)\n"
        "print(repr(f.directory), f.input_path, f.read_output())\n"
        "r = StateRecord(__import__('pathlib').Path(sys.argv[1]), os.getpid())\n"
        "r.add(TreeRecord('k', 1, 1, 'tok', '', None, None))\n"
        "print(sorted(os.listdir(sys.argv[1])))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "state")], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.splitlines()  # fmt: skip
    assert out == ["'' /dev/null (None, None)", "[]"]
