"""A tree's record keeps the task it runs (``meta``): through the journal, compaction and the sweep of a
SIGKILLed runner, which hands the dead runner's records to ``on_orphans``; older records still sweep."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import leftovers, procfs
from tests.support import wait_until

from .process_support import REPO, sample

META = {"server": "0123456789abcdef", "task_id": "task-1", "workflow_id": "wf-1", "task_type": "job",
        "poll_count": 3, "worker_id": "w1"}

# A stand-in runner: a real Supervisor with tree_meta spawns two sleepers, prints their pids and the
# fork server's, and waits to be SIGKILLed.
RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from leasecore.models import Task
    from leasecore.process import CommandSpec, Supervisor

    def meta(task, worker_id):
        return {"task_id": task.task_id, "poll_count": task.poll_count, "worker_id": worker_id}

    sup = Supervisor(Path(sys.argv[1]), tree_meta=meta)
    children = [sup.spawn(Task(task_id=f"task-{i}", workflow_id="wf", task_type="x", poll_count=i + 1),
                          CommandSpec(argv=tuple(sys.argv[2:])), worker_id="w9") for i in range(2)]
    print(json.dumps({"forkserver": sup.forkserver_pid, "pids": [c.pid for c in children]}), flush=True)
    sys.stdin.read()
    """
)


def _gone(pid: int) -> bool:
    info = procfs.read_stat(pid)
    return info is None or info.is_zombie


def test_meta_round_trips_through_the_journal_and_compaction(tmp_path: Path) -> None:
    record = leftovers.StateRecord(tmp_path, os.getpid())
    path = tmp_path / f"processes-{os.getpid()}.json"
    try:
        record.add(leftovers.TreeRecord("t0", 10_000, 1, "0" * 32, "", dict(META)))
        record.add(leftovers.TreeRecord("t1", 10_001, 1, "1" * 32, "", dict(META, task_id="task-2")))
        assert path.with_suffix(".journal").stat().st_size > 0  # the second add went to the journal
        read = [leftovers.TreeRecord.from_json(t) for t in leftovers.read_record(path)["trees"]]
        assert {t.key: t.meta for t in read} == {"t0": META, "t1": dict(META, task_id="task-2")}
        for i in range(2, 2 + leftovers._COMPACT_SLACK):  # enough changes to compact the journal
            record.add(leftovers.TreeRecord(f"t{i}", 10_000 + i, 1, "2" * 32, "", {"task_id": f"x{i}"}))
            record.remove(f"t{i}")
        compacted = json.loads(path.read_text())["trees"]
        assert {t["key"]: t["meta"] for t in compacted} == {"t0": META, "t1": dict(META, task_id="task-2")}
        read = [leftovers.TreeRecord.from_json(t) for t in leftovers.read_record(path)["trees"]]
        assert {t.key: t.meta for t in read} == {"t0": META, "t1": dict(META, task_id="task-2")}
    finally:
        record.delete()


def test_a_record_whose_meta_is_not_an_object_reads_as_none() -> None:
    tree = {"key": "t", "pid": 5, "start_time": 7, "token": "a" * 32, "tmpdir": "", "meta": ["x"]}
    assert leftovers.TreeRecord.from_json(tree) == leftovers.TreeRecord("t", 5, 7, "a" * 32, "", None)


@pytest.fixture
def killed_runner(tmp_path: Path) -> Any:
    """A runner (own process) holding two sleepers with meta, SIGKILLed along with its fork server."""
    state = tmp_path / "state"
    proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(state), *sample("sleeper.sh")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout is not None and proc.stdin is not None
    info = json.loads(proc.stdout.readline())
    try:
        yield proc, info, state
    finally:
        for pid in info["pids"]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


def test_the_sweep_hands_a_killed_runners_records_with_their_meta_to_on_orphans(killed_runner: Any) -> None:
    proc, info, state = killed_runner
    proc.send_signal(signal.SIGSTOP)  # both die before either can clean up
    os.kill(info["forkserver"], signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    got: list[tuple[int, list[leftovers.TreeRecord]]] = []
    with Supervisor(state) as sup:
        sup.sweep_leftovers(lambda pid, trees: got.append((pid, trees)))
    assert wait_until(lambda: all(_gone(p) for p in info["pids"]), 10)
    assert [pid for pid, _ in got] == [proc.pid]
    trees = sorted(got[0][1], key=lambda t: t.key)
    assert [t.pid for t in trees] == info["pids"]
    assert [t.meta for t in trees] == [{"task_id": "task-0", "poll_count": 1, "worker_id": "w9"},
                                       {"task_id": "task-1", "poll_count": 2, "worker_id": "w9"}]
    assert not list(state.glob("processes-*"))


def test_a_failing_on_orphans_keeps_the_record_for_the_next_sweep(killed_runner: Any) -> None:
    proc, info, state = killed_runner
    proc.send_signal(signal.SIGKILL)  # the fork server sees the runner die and kills the trees
    proc.wait()
    assert wait_until(lambda: all(_gone(p) for p in info["pids"]), 10)

    def broken(pid: int, trees: list[leftovers.TreeRecord]) -> None:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        leftovers.sweep(state, broken)
    assert list(state.glob("processes-*.json"))  # kept: the tasks are handed over again next time
    got: list[int] = []
    leftovers.sweep(state, lambda pid, trees: got.append(len(trees)))
    assert got == [2] and not list(state.glob("processes-*"))


def test_a_record_without_meta_from_an_older_runner_still_sweeps(tmp_path: Path) -> None:
    """The record format before ``meta``: its trees are killed as before and handed over with None."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # a runner pid that no longer runs
    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        start = procfs.read_stat(sleeper.pid)
        assert start is not None
        record = {"runner": {"pid": dead.pid, "start_time": 1}, "forkserver": None,
                  "trees": [{"key": "t1", "pid": sleeper.pid, "start_time": start.start_time,
                             "token": "f" * 32, "tmpdir": ""}]}
        path = tmp_path / f"processes-{dead.pid}.json"
        path.write_text(json.dumps(record))
        got: list[tuple[int, list[leftovers.TreeRecord]]] = []
        killed = leftovers.sweep(tmp_path, lambda pid, trees: got.append((pid, trees)))
        assert sleeper.pid in killed
        sleeper.wait(10)
        assert got == [(dead.pid, [leftovers.TreeRecord("t1", sleeper.pid, start.start_time, "f" * 32, "")])]
        assert not path.exists()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def test_tree_meta_is_asked_before_the_fork_with_the_task_and_worker_id(tmp_path: Path) -> None:
    asked: list[tuple[str, str]] = []

    def meta(task: Task, worker_id: str) -> dict[str, Any]:
        asked.append((task.task_id, worker_id))
        return {"task_id": task.task_id}

    with Supervisor(tmp_path / "state", tree_meta=meta) as sup:
        child = sup.spawn(Task(task_id="t-7", workflow_id="w", task_type="x"),
                          CommandSpec(argv=sample("sleeper.sh")), worker_id="w3")
        path = tmp_path / "state" / f"processes-{os.getpid()}.json"
        trees = leftovers.read_record(path)["trees"]
        assert [(t["pid"], t["meta"]) for t in trees] == [(child.pid, {"task_id": "t-7"})]
    assert asked == [("t-7", "w3")]


def _record_naming(state: Path, stranger: subprocess.Popen[bytes], tmpdir: Path, boot: str | None) -> Path:
    """A dead runner's record whose fork server and tree leader have the pid *and* start time of
    ``stranger`` (a process in its own session): what a record from before a reboot can look like
    to a service that gets much the same pids and start times at every boot."""
    info = procfs.read_stat(stranger.pid)
    assert info is not None
    me = procfs.read_stat(os.getpid())
    assert me is not None
    same = {"pid": stranger.pid, "start_time": info.start_time}
    data: dict[str, Any] = {
        "runner": {"pid": os.getpid(), "start_time": me.start_time + 1},  # not us: a dead runner
        "forkserver": same,
        "trees": [{"key": "k1", **same, "token": "f" * 32, "tmpdir": str(tmpdir), "meta": dict(META)}],
    }
    if boot is not None:
        data["boot"] = boot
    state.mkdir(mode=0o700, exist_ok=True)
    path = state / "processes-999999.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("boot", ["earlier", "this", None], ids=["earlier-boot", "this-boot", "no-boot-id"])
def test_a_record_from_an_earlier_boot_signals_nothing_but_still_reports_its_tasks(
    tmp_path: Path, boot: str | None
) -> None:
    if not procfs.boot_id():
        pytest.skip("no boot id here")
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        assert wait_until(lambda: (i := procfs.read_stat(stranger.pid)) is not None and i.state != "R", 10)
        tmpdir = tmp_path / f"{leftovers.TMP_PREFIX}x"
        tmpdir.mkdir()
        boots = {"earlier": "00000000-0000-4000-8000-000000000000", "this": procfs.boot_id()}
        recorded = boots.get(boot or "")
        path = _record_naming(tmp_path / "state", stranger, tmpdir, recorded)
        got: list[tuple[int, list[leftovers.TreeRecord]]] = []
        leftovers.sweep(tmp_path / "state", lambda pid, trees: got.append((pid, trees)))
        # Either way the record is consumed, its task reported and its directory removed ...
        assert not path.exists() and not tmpdir.exists()
        assert [(pid, [t.meta for t in trees]) for pid, trees in got] == [(os.getpid(), [META])]
        # ... but only a record of this boot (or one without a boot id) may signal what it names.
        if boot == "earlier":
            assert stranger.poll() is None, "a process of this boot was killed for a record of the last one"
        else:
            assert stranger.wait(10) == -signal.SIGKILL
    finally:
        if stranger.poll() is None:
            stranger.kill()
        stranger.wait()
