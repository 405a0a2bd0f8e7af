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
import pytest

from leasecore.process import CommandSpec
from leasecore.process.linux import leftovers
from tests.support import wait_until

from .process_support import make_task, running_supervisor

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
    slack = leftovers._COMPACT_SLACK
    for i in range(3 * slack):
        record.add(leftovers.TreeRecord(f"t{i}", 10_000 + i, 1, "0" * 32, ""))
        if i >= 20:
            record.remove(f"t{i - 20}")
    path = tmp_path / f"processes-{os.getpid()}.json"
    journal = path.with_suffix(".journal")
    # Bounded: compaction keeps the journal within about twice the live trees (plus slack).
    assert len(journal.read_text().splitlines()) <= 2 * 20 + slack + 1
    trees = {str(t["key"]): t for t in json.loads(path.read_text())["trees"]}
    leftovers._replay_journal(path, trees)
    assert sorted(trees) == sorted(f"t{i}" for i in range(3 * slack - 20, 3 * slack))
    assert (path.stat().st_mode & 0o777) == 0o600
    record.delete()
    assert not path.exists() and not journal.exists()


def test_a_tree_line_is_the_text_json_dumps_makes(tmp_path: Path) -> None:
    # Encoded with a C encoder made once (leftovers._dumps_line: models.plain_json_encoder), not by
    # json.dumps at each add.
    record = leftovers.StateRecord(tmp_path, os.getpid())
    record.add(leftovers.TreeRecord("t0", 10_000, 1, "0" * 32, ""))  # the first change: the record
    meta = {"server": "k", "task_id": "caf\u00e9 \"q\"\n\u2603", "poll_count": 3, "ratio": 0.5, "none": None,
            "list": [1, "x", True]}  # fmt: skip
    group = {"dirs": {"memory": "/sys/fs/cgroup/conductor-run.1.ab"}, "pooled": True}
    tree = leftovers.TreeRecord("t1", 10_001, 2, "1" * 32, "/dev/shm/conductor-run-task-x", meta, group, 0)
    record.add(tree)
    journal = (tmp_path / f"processes-{os.getpid()}.json").with_suffix(".journal")
    assert journal.read_text().splitlines() == ["+" + json.dumps(vars(tree))]
    with pytest.raises(TypeError):
        record.add(leftovers.TreeRecord("t2", 1, 1, "2" * 32, "", {"what": object()}))
    record.delete()


def test_held_removals_go_out_with_the_next_add_or_the_flush(tmp_path: Path) -> None:
    record = leftovers.StateRecord(tmp_path, os.getpid())
    path = tmp_path / f"processes-{os.getpid()}.json"
    journal = path.with_suffix(".journal")

    def keys() -> list[str]:
        return sorted(str(t["key"]) for t in leftovers.read_record(path)["trees"])

    def tree(n: int) -> leftovers.TreeRecord:
        return leftovers.TreeRecord(f"t{n}", 10_000 + n, 1, f"{n:032x}", "")

    for n in range(3):
        record.add(tree(n))  # the first change writes the record, the others the journal
    record.hold()
    record.remove("t0")
    record.remove("t1")
    assert keys() == ["t0", "t1", "t2"]  # held: not written yet
    record.add(tree(3))  # an add is written at once, with what was held
    assert journal.read_text().splitlines()[-3:] == ['-"t0"', '-"t1"', "+" + json.dumps(vars(tree(3)))]
    assert keys() == ["t2", "t3"]
    record.remove("t2")
    assert keys() == ["t2", "t3"]
    record.flush()
    assert keys() == ["t3"]
    record.remove("t3")  # not held any more: written at once
    assert keys() == []
    # A rewrite while holding (here: a new fork server) takes the held removals in.
    record.add(tree(4))
    record.hold()
    record.remove("t4")
    record.set_forkserver(os.getpid())
    assert keys() == []
    record.flush()
    assert keys() == []
    record.delete()


def test_a_started_tree_is_recorded_and_a_gone_one_is_not_once_its_wait_returns(tmp_path: Path) -> None:
    """Through a real Supervisor (removals held over a read of the fork server's messages): spawn
    returns with the tree in the record; wait_gone returns with it out of the record; 40 short trees
    at once, so that ends and starts share reads."""
    for sup in running_supervisor(tmp_path):
        sleeper = sup.spawn(make_task(), CommandSpec(argv=("sleep", "60")), worker_id="w")
        (path,) = (tmp_path / "state").glob("processes-*.json")

        def recorded(path: Path = path) -> set[str]:
            return {str(t["key"]) for t in leftovers.read_record(path)["trees"]}

        assert sleeper.key in recorded()
        short = [sup.start(make_task(), CommandSpec(argv=("true",)), worker_id="w") for _ in range(40)]
        for child in short:
            assert child.wait_gone(60)
            assert child.key not in recorded()
        assert recorded() == {sleeper.key}
        sleeper.kill_tree()
        assert sleeper.wait_gone(60) and recorded() == set()


def test_a_tree_record_has_the_fields_running_trees_copies_by_hand() -> None:
    """RunningTrees.started copies a pending record field by field (dataclasses.replace cost ~3 us a
    task): a field added to TreeRecord must be added there too, which this test is here to say."""
    import dataclasses

    fields = [field.name for field in dataclasses.fields(leftovers.TreeRecord)]
    assert fields == ["key", "pid", "start_time", "token", "tmpdir", "meta", "cgroup", "survivors"]


class _FakeChild:
    def __init__(self, key: str) -> None:
        self.key, self.pid, self.cgroup, self.gone = key, 0, None, False

    def _on_gone(self) -> None:
        self.gone = True


class _FakeKillBy:
    def gone(self, key: str) -> None:
        pass


def test_an_unwritable_record_wakes_every_held_tree_and_names_each_task(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A removal held over a read and an add that cannot be written: the gone trees' waiters are
    woken all the same, and the log names the task whose tree is unrecorded and those unremoved."""
    import threading
    from types import SimpleNamespace

    from leasecore.process.supervisor.running import RunningTrees

    record = leftovers.StateRecord(tmp_path, os.getpid())
    trees = RunningTrees(threading.Condition(), record, _FakeKillBy())  # type: ignore[arg-type]
    old, new = _FakeChild("t1"), _FakeChild("t2")
    trees.add(old)  # type: ignore[arg-type]
    trees.started(SimpleNamespace(child=old, record=leftovers.TreeRecord("t1", 0, 0, "1" * 32, "")),  # type: ignore[arg-type]
                  {"pid": 10_001, "start": 5})  # fmt: skip

    def full(text: str, lines: int) -> None:
        raise OSError(28, "No space left on device")

    record._append = full  # type: ignore[method-assign]
    trees.hold()
    trees.gone(old)  # type: ignore[arg-type]
    assert not old.gone  # held: its removal is not written yet
    trees.add(new)  # type: ignore[arg-type]
    with caplog.at_level("ERROR"):
        trees.started(SimpleNamespace(child=new, record=leftovers.TreeRecord("t2", 0, 0, "2" * 32, "")),  # type: ignore[arg-type]
                      {"pid": 10_002, "start": 5})  # fmt: skip
        trees.release()
    assert old.gone
    text = caplog.text
    assert "task t2: could not record its tree" in text
    assert "tasks t1: could not remove their trees from the state record" in text
    record.delete()
