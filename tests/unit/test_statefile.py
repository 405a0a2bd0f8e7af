"""State files: directory rules, the atomic publisher's pacing and failures, and staleness.

Pacing runs on a FakeClock; liveness uses real processes (this one, a finished one, a zombie).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from leasecore.clock import FakeClock
from leasecore.errors import ConfigError
from leasecore.snapshot import RunnerInfo, ServerHealth, TaskSnapshot, TaskState
from leasecore.state.directory import StateDir
from leasecore.state.statefile import (
    ProcessState,
    StatePublisher,
    default_state_dir,
    ensure_state_dir,
    find_tasks,
    probe_process,
    process_start_ticks,
    prune_stale,
    read_snapshots,
    runner_info_for_this_process,
    status_document,
)
from tests.support import wait_until

WALL0 = datetime(2026, 1, 1, tzinfo=UTC)
SERVER = ServerHealth(last_ok_at=WALL0)


def a_task(task_id: str = "task-1", output: tuple[str, ...] = ()) -> TaskSnapshot:
    return TaskSnapshot(
        task_id, "wf-1", "encode", TaskState.RUNNING, WALL0, child_pid=1, recent_output=output
    )


def this_runner(clock: FakeClock | None = None) -> RunnerInfo:
    return runner_info_for_this_process(worker_id="w", server_url="http://h/api", clock=clock)


def dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
    )
    return int(proc.stdout)


# --- the state directory -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"CONDUCTOR_RUN_STATE_DIR": "/x/state", "XDG_RUNTIME_DIR": "/run/u", "HOME": "/h"}, "/x/state"),
        ({"XDG_RUNTIME_DIR": "/run/user/1000", "HOME": "/h"}, "/run/user/1000/conductor-run"),
        ({"XDG_RUNTIME_DIR": "", "HOME": "/home/ann"}, "/home/ann/.local/state/conductor-run"),
        ({"CONDUCTOR_RUN_STATE_DIR": "", "HOME": "/home/ann"}, "/home/ann/.local/state/conductor-run"),
    ],
)
def test_default_state_dir(environ: dict[str, str], expected: str) -> None:
    assert default_state_dir(environ) == Path(expected)


def test_ensure_state_dir_creates_a_private_directory(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    old_umask = os.umask(0)  # a permissive umask must not leak into the mode
    try:
        ensure_state_dir(target)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o700


def test_a_state_dir_is_checked_when_made_and_used_as_it_is_after(tmp_path: Path) -> None:
    """``StateDir.open`` makes and checks; whoever is handed the result does not check again (the
    run's one check), while a bare path is still checked by each reader."""
    state = StateDir.open(tmp_path / "state")
    assert stat.S_IMODE(state.path.stat().st_mode) == 0o700 and state.outbox == state.path / "outbox"
    clock = FakeClock(wall=WALL0)
    StatePublisher(state, this_runner(clock), clock=clock).publish([a_task()], server=SERVER)
    state.path.chmod(0o770)  # what a check refuses: only a reader of the bare path sees it now
    try:
        [record] = read_snapshots(state, WALL0)
        assert record.snapshot is not None and record.snapshot.tasks[0].task_id == "task-1"
        with pytest.raises(ConfigError, match="writable by group or others"):
            read_snapshots(state.path, WALL0)
    finally:
        state.path.chmod(0o700)
    with pytest.raises(ConfigError, match="writable by group or others"):
        tmp_path.chmod(0o777)
        StateDir.open(tmp_path)


def test_a_world_writable_state_dir_is_refused(tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by group or others") as info:
        ensure_state_dir(tmp_path)
    assert info.value.key == "state_dir"


@pytest.mark.parametrize("mode", [0o1777, 0o777, 0o1770])
def test_a_shared_state_dir_is_never_told_to_change_its_mode(tmp_path: Path, mode: int) -> None:
    """/tmp itself as the state dir: the fix is a private directory, never `chmod 700 /tmp`."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(ConfigError, match="writable by group or others") as info:
        ensure_state_dir(shared)
    assert "chmod" not in str(info.value)
    assert "shared directory" in str(info.value) and "--state-dir" in str(info.value)


def test_a_group_writable_private_state_dir_may_be_fixed_with_chmod(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    own.chmod(0o770)
    with pytest.raises(ConfigError, match=r"run `chmod 700 .*own` if it is this runner's own"):
        ensure_state_dir(own)


def test_a_state_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        other = tmp_path / "other"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
    else:
        other = Path("/")  # owned by root, not by this user
    with pytest.raises(ConfigError, match="belongs to uid"):
        ensure_state_dir(other)


# --- publishing ----------------------------------------------------------------------------------


def test_publish_writes_a_private_file_atomically(tmp_path: Path) -> None:
    publisher = StatePublisher(tmp_path / "state", this_runner())
    assert publisher.publish([a_task(output=("hello",))], server=SERVER)
    assert publisher.path.name == f"runner-{os.getpid()}.json"
    assert stat.S_IMODE(publisher.path.stat().st_mode) == 0o600
    assert [p.name for p in publisher.path.parent.iterdir()] == [publisher.path.name]  # no temp left
    data = json.loads(publisher.path.read_text())
    assert data["schema_version"] == 1
    assert data["runner"]["pid"] == os.getpid()
    assert data["tasks"][0]["last_output_line"] == "hello"


def test_publish_skips_unchanged_writes_within_a_second_and_refreshes_after(tmp_path: Path) -> None:
    clock = FakeClock(wall=WALL0)
    publisher = StatePublisher(tmp_path, this_runner(clock), clock=clock)
    assert publisher.publish([a_task()], server=SERVER)
    clock.advance(0.5)
    assert not publisher.publish([a_task()], server=SERVER)
    clock.advance(0.5)
    assert publisher.publish([a_task()], server=SERVER)  # the once-a-second refresh
    updated = json.loads(publisher.path.read_text())["updated_at"]
    assert updated == "2026-01-01T00:00:01.000Z"


def test_publish_writes_a_change_at_once_and_coalesces_output_only_changes(tmp_path: Path) -> None:
    clock = FakeClock(wall=WALL0)
    publisher = StatePublisher(tmp_path, this_runner(clock), clock=clock)
    assert publisher.publish([a_task()], server=SERVER)
    assert publisher.publish([a_task(), a_task("task-2")], server=SERVER)  # new task: at once
    assert publisher.publish([a_task()], server=ServerHealth(consecutive_failures=1))  # at once
    assert not publisher.publish([a_task(output=("x",))], server=ServerHealth(consecutive_failures=1))
    clock.advance(0.25)
    assert publisher.publish([a_task(output=("x",))], server=ServerHealth(consecutive_failures=1))
    assert json.loads(publisher.path.read_text())["tasks"][0]["recent_output"] == ["x"]


def test_publish_never_writes_through_a_link_at_its_temporary_name(tmp_path: Path) -> None:
    clock = FakeClock(wall=WALL0)
    publisher = StatePublisher(tmp_path / "state", this_runner(clock), clock=clock)
    target = tmp_path / "elsewhere"
    target.write_text("kept")
    (tmp_path / "state" / f".runner-{os.getpid()}.w.tmp").symlink_to(target)
    assert not publisher.publish([a_task()], server=SERVER)  # refused, the link removed
    assert target.read_text() == "kept"
    clock.advance(1.0)
    assert publisher.publish([a_task()], server=SERVER)
    assert [p.name for p in publisher.path.parent.iterdir()] == [publisher.path.name]


def test_publish_never_raises_and_logs_a_failure_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(wall=WALL0)
    state = tmp_path / "state"
    publisher = StatePublisher(state, this_runner(clock), clock=clock)
    shutil.rmtree(state)  # every write now fails, as on a vanished or full filesystem
    with caplog.at_level(logging.INFO, logger="leasecore.state.statefile"):
        assert not publisher.publish([a_task()], server=SERVER)
        clock.advance(1.0)
        assert not publisher.publish([a_task()], server=SERVER)
        assert not publisher.publish([a_task("task-2")], server=SERVER)
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "cannot write the status snapshot" in warnings[0].getMessage()
        state.mkdir(mode=0o700)
        clock.advance(1.0)
        assert publisher.publish([a_task("task-2")], server=SERVER)
    assert any("written again" in r.getMessage() for r in caplog.records)


def test_remove_deletes_the_snapshot(tmp_path: Path) -> None:
    publisher = StatePublisher(tmp_path, this_runner())
    publisher.publish([], server=SERVER)
    publisher.remove()
    publisher.remove()  # twice is fine
    assert not publisher.path.exists()


# --- reading and staleness -----------------------------------------------------------------------


def write_snapshot(state: Path, runner: RunnerInfo, clock: FakeClock | None = None) -> Path:
    publisher = StatePublisher(state, runner, clock=clock or FakeClock(wall=WALL0))
    publisher.publish([a_task()], server=SERVER)
    return publisher.path


def test_a_live_runner_is_not_stale(tmp_path: Path) -> None:
    write_snapshot(tmp_path, this_runner())
    [record] = read_snapshots(tmp_path, WALL0 + timedelta(seconds=9))
    assert not record.is_stale
    assert not record.process_gone
    assert record.snapshot is not None
    assert record.snapshot.tasks[0].task_id == "task-1"


def test_a_live_runner_silent_for_10s_is_stale_but_not_gone(tmp_path: Path) -> None:
    write_snapshot(tmp_path, this_runner())
    [record] = read_snapshots(tmp_path, WALL0 + timedelta(seconds=10.5))
    assert record.stale_reason == "no update for 10.5s"
    assert not record.process_gone


def test_a_runner_whose_process_is_gone_is_stale(tmp_path: Path) -> None:
    pid = dead_pid()
    write_snapshot(tmp_path, RunnerInfo(pid=pid, worker_id="w", server_url="http://h", started_at=WALL0))
    [record] = read_snapshots(tmp_path, WALL0)
    assert record.stale_reason == "runner process is gone"
    assert record.process_gone


def test_a_reused_pid_is_stale(tmp_path: Path) -> None:
    runner = this_runner()
    assert runner.process_start_ticks is not None
    reused = RunnerInfo(
        pid=runner.pid,
        worker_id="w",
        server_url="http://h",
        started_at=WALL0,
        process_start_ticks=runner.process_start_ticks + 1,
    )
    write_snapshot(tmp_path, reused)
    [record] = read_snapshots(tmp_path, WALL0)
    assert record.stale_reason == f"pid {runner.pid} now belongs to another process"
    assert record.process_gone


def test_a_killed_but_unreaped_runner_counts_as_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        ticks = process_start_ticks(proc.pid)
        assert probe_process(proc.pid, ticks) is ProcessState.ALIVE
        proc.kill()
        wait_until(lambda: probe_process(proc.pid, ticks) is ProcessState.GONE)  # a zombie
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert probe_process(proc.pid, ticks) is ProcessState.GONE  # reaped


def test_an_unreadable_snapshot_is_reported_not_raised(tmp_path: Path) -> None:
    (tmp_path / f"runner-{os.getpid()}.json").write_text("{ not json")
    (tmp_path / "unrelated.json").write_text("{}")
    [record] = read_snapshots(tmp_path, WALL0)
    assert record.snapshot is None
    assert record.error is not None and record.error.startswith("unreadable snapshot")
    assert record.is_stale


def test_a_missing_state_dir_means_no_runners(tmp_path: Path) -> None:
    assert read_snapshots(tmp_path / "nope", WALL0) == []


def test_prune_removes_only_runners_whose_process_is_gone(tmp_path: Path) -> None:
    pid = dead_pid()
    dead = write_snapshot(
        tmp_path, RunnerInfo(pid=pid, worker_id="w", server_url="http://h", started_at=WALL0)
    )
    leftover = tmp_path / f".runner-{pid}.abc123.tmp"
    leftover.write_text("{")
    alive = write_snapshot(tmp_path, this_runner())
    records = read_snapshots(tmp_path, WALL0 + timedelta(seconds=60))  # the live one is silent too
    removed = prune_stale(tmp_path, records)
    assert sorted(removed) == sorted([dead, leftover])
    assert alive.exists()


def test_find_tasks_prefers_an_exact_id_over_prefixes(tmp_path: Path) -> None:
    clock = FakeClock(wall=WALL0)
    publisher = StatePublisher(tmp_path, this_runner(clock), clock=clock)
    publisher.publish([a_task("abc"), a_task("abcdef"), a_task("xyz")], server=SERVER)
    records = read_snapshots(tmp_path, WALL0)
    assert [t.task_id for _, t in find_tasks(records, "abc")] == ["abc"]
    assert [t.task_id for _, t in find_tasks(records, "ab")] == ["abc", "abcdef"]
    assert find_tasks(records, "nope") == []


def test_status_document_lists_runners_and_one_task(tmp_path: Path) -> None:
    write_snapshot(tmp_path, this_runner())
    records = read_snapshots(tmp_path, WALL0)
    doc = status_document(records, WALL0, state_dir=tmp_path)
    assert doc["schema_version"] == 1
    assert doc["now"] == "2026-01-01T00:00:00.000Z"
    [runner] = doc["runners"]
    assert runner["stale"] is False
    assert runner["tasks"][0]["health"] == "no_lease"
    one = status_document(records, WALL0, state_dir=tmp_path, task_id="task")
    assert [t["task_id"] for t in one["tasks"]] == ["task-1"]
    assert one["tasks"][0]["runner_pid"] == os.getpid()
