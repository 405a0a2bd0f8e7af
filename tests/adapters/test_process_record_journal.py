"""The state record with many trees: an append-only journal, still swept after a SIGKILL
(rewriting it whole at each change was too slow with 1000 tasks)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil

from leasecore.process.linux import leftovers
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]

# A stand-in runner: records 40 session leaders (sleeps), forgets 10 of them (killed first), says
# "ready" and waits to be SIGKILLed. 40 > the rewrite threshold: most changes go to the journal.
RUNNER = textwrap.dedent(
    """
    import os, subprocess, sys
    from pathlib import Path
    from leasecore.process.linux import procfs as _procfs, leftovers

    state = Path(sys.argv[1])
    record = leftovers.StateRecord(state, os.getpid())
    procs = [subprocess.Popen(["sleep", "120"], start_new_session=True) for _ in range(40)]
    for i, p in enumerate(procs):
        start = _procfs.read_stat(p.pid).start_time
        record.add(leftovers.TreeRecord(f"t{i}", p.pid, start, f"{i:032x}", ""))
    for i, p in enumerate(procs[:10]):
        p.kill(); p.wait()
        record.remove(f"t{i}")
    print(" ".join(str(p.pid) for p in procs[10:]), flush=True)
    sys.stdin.read()
    """
)


def test_journal_keeps_a_killed_runners_trees_findable(tmp_path: Path) -> None:
    state = tmp_path / "state"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert runner.stdout is not None
    live = [int(pid) for pid in runner.stdout.readline().split()]
    try:
        assert len(live) == 30
        journal = state / f"processes-{runner.pid}.journal"
        assert journal.exists() and journal.stat().st_size > 0  # the record alone is not the truth
        assert (journal.stat().st_mode & 0o777) == 0o600
        runner.send_signal(signal.SIGKILL)
        runner.wait(30)
        killed = leftovers.sweep(state)
        assert set(live) <= killed
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                   for p in live), 10, "the recorded trees to die in the sweep")
        assert not list(state.glob("processes-*"))
    finally:
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        for pipe in (runner.stdin, runner.stdout):
            if pipe is not None:
                pipe.close()


def test_journal_compacts_into_the_record(tmp_path: Path) -> None:
    record = leftovers.StateRecord(tmp_path, os.getpid())
    for i in range(300):
        record.add(leftovers.TreeRecord(f"t{i}", 10_000 + i, 1, "0" * 32, ""))
        if i >= 20:
            record.remove(f"t{i - 20}")
    path = tmp_path / f"processes-{os.getpid()}.json"
    journal = path.with_suffix(".journal")
    # Bounded: compaction keeps the journal within about twice the live trees (plus slack).
    assert len(journal.read_text().splitlines()) <= 2 * 20 + 64 + 1
    trees = {str(t["key"]): t for t in json.loads(path.read_text())["trees"]}
    leftovers._replay_journal(path, trees)
    assert sorted(trees) == sorted(f"t{i}" for i in range(280, 300))
    record.delete()
    assert not path.exists() and not journal.exists()
