"""``conductor-run status``: pure rendering at a fixed ``now``, the command, and a real publisher process."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pty
import random
import re
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from io import StringIO
from pathlib import Path

import pytest
import typer
from rich.console import Console, RenderableType
from typer.testing import CliRunner

from cli import exitcodes, status
from cli.render import format_duration, format_relative, render_status, render_task, render_view
from leasecore.snapshot import RunnerInfo, RunnerSnapshot, ServerHealth, TaskSnapshot, TaskState
from leasecore.state.statefile import (
    ProcessState,
    SnapshotRecord,
    StatePublisher,
    probe_process,
    runner_info_for_this_process,
)
from tests.support import wait_until

NOW = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
TASK_ID = "7f3c1a2e-1111-4222-8333-444455556666"
GOLDEN = Path(__file__).parent / "golden"  # expected renders, reviewed by eye


def at(seconds: float) -> datetime:
    return NOW + timedelta(seconds=seconds)


def a_task(**changes: object) -> TaskSnapshot:
    fields: dict[str, object] = {
        "task_id": TASK_ID,
        "workflow_id": "9b2d0c11-aaaa-4bbb-8ccc-dddddddddddd",
        "task_type": "encode_video",
        "state": TaskState.RUNNING,
        "started_at": at(-125),
        "child_pid": 31337,
        "last_ack_at": at(-3.2),
        "next_heartbeat_at": at(4.8),
        "lease_deadline_at": at(6.8),
        "lease_timeout_seconds": 10.0,
        "hard_deadline_at": at(3300),
        "recent_output": ("frame 1/500", "frame 120/500 (24%)"),
    }
    fields.update(changes)
    return TaskSnapshot(**fields)  # type: ignore[arg-type]


def a_record(
    *tasks: TaskSnapshot, pid: int = 4242, stale_reason: str | None = None, server: ServerHealth | None = None
) -> SnapshotRecord:
    runner = RunnerInfo(pid, "host-a", "http://localhost:8080/api", started_at=at(-3720))
    snapshot = RunnerSnapshot(runner, server or ServerHealth(last_ok_at=at(-0.4)), tasks, updated_at=at(-0.3))
    path = Path(f"/state/runner-{pid}.json")
    return SnapshotRecord(path, pid, snapshot, stale_reason, stale_reason is not None)


def to_text(renderable: RenderableType, width: int = 140, *, colour: bool = False) -> str:
    console = Console(
        file=StringIO(), width=width, force_terminal=colour, color_system="standard" if colour else None
    )
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return "\n".join(line.rstrip() for line in out.splitlines())


# --- pure rendering ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.04, "0.0s"), (3.25, "3.2s"), (-59.9, "59.9s"), (125, "2m05s"), (3720, "1h02m"), (99999, "1d03h")],
)
def test_format_duration(seconds: float, expected: str) -> None:
    assert format_duration(seconds) == expected


@pytest.mark.parametrize(
    ("moment", "expected"), [(at(-3.2), "3.2s ago"), (at(1.1), "in 1.1s"), (at(0.01), "now"), (None, "-")]
)
def test_format_relative(moment: datetime | None, expected: str) -> None:
    assert format_relative(moment, NOW) == expected


def test_no_runners_is_one_clear_line() -> None:
    text = to_text(render_status([], NOW, state_dir=Path("/run/user/1000/conductor-run")))
    assert text == "No conductor-run runners on this host (state directory /run/user/1000/conductor-run)."


def test_the_host_view_shows_runners_and_their_tasks() -> None:
    live = a_record(
        a_task(),
        a_task(
            task_id="a1b2c3d4-9999",
            workflow_id="wf-2",
            started_at=at(-40),
            child_pid=31340,
            last_ack_at=at(-9),
            next_heartbeat_at=at(-1.5),
            lease_deadline_at=at(1),
            consecutive_failures=2,
            hard_deadline_at=None,
            recent_output=(),
        ),
    )
    dead = a_record(a_task(), pid=17, stale_reason="runner process is gone")
    assert to_text(render_status([live, dead], NOW)) + "\n" == (GOLDEN / "status_host.txt").read_text()


def a_wide_record() -> SnapshotRecord:
    """Two tasks whose table is 180 columns wide: a long type, a 7-digit pid, a long output line."""
    return a_record(
        a_task(),
        a_task(
            task_id="a1b2c3d4-9999",
            task_type="heal_thumbnails_for_ever",
            child_pid=2701234,
            state=TaskState.UNDELIVERED,
            recent_output=("x" * 40,),
            memory_bytes=50 * 1024 * 1024,
        ),
    )


NARROWEST = "TYPE TASK PID STATE LEASE ELAPSED"
EVERY_COLUMN = (
    "TYPE TASK WORKFLOW PID STATE LEASE ELAPSED LAST_BEAT NEXT_BEAT LEASE_ENDS HARD_LIMIT MEMORY LAST_OUTPUT"
)
ALL_BUT_MEMORY = EVERY_COLUMN.replace(" MEMORY", "")  # the first column left out


@pytest.mark.parametrize(
    ("width", "columns"),
    [
        (60, NARROWEST),
        (80, "TYPE TASK WORKFLOW PID STATE LEASE ELAPSED LEASE_ENDS"),
        (100, "TYPE TASK WORKFLOW PID STATE LEASE ELAPSED LAST_BEAT LEASE_ENDS"),
        (130, ALL_BUT_MEMORY),  # TYPE and LAST OUTPUT shortened
        (190, EVERY_COLUMN),
    ],
)
def test_a_narrow_terminal_leaves_columns_out_but_never_cuts_ids_pids_states_or_times(
    width: int, columns: str
) -> None:
    lines = to_text(render_status([a_wide_record()], NOW), width=width).splitlines()
    table = lines[[line.split()[0] for line in lines].index("TYPE") :]
    assert all(len(line) <= width for line in table), table
    assert [name.replace(" ", "_") for name in re.split(r" {2,}", table[0].strip())] == columns.split()
    whole = {
        "TASK": ("7f3c1a2e", "a1b2c3d4"),
        "WORKFLOW": ("9b2d0c11", "9b2d0c11"),
        "PID": ("31337", "2701234"),
        "STATE": ("running", "undelivered"),
        "LEASE": ("healthy", "-"),
        "ELAPSED": ("2m05s", "2m05s"),
        "LAST_BEAT": ("3.2s ago", "3.2s ago"),
        "NEXT_BEAT": ("in 4.8s", "in 4.8s"),
        "LEASE_ENDS": ("in 6.8s", "in 6.8s"),
        "HARD_LIMIT": ("in 55m00s", "in 55m00s"),
        "MEMORY": ("-", "50.0M"),
    }
    for name in set(columns.split()) & set(whole):
        for row, value in zip(table[1:], whole[name], strict=True):
            assert f" {value} " in f" {row} ", (name, value, row)
    assert table[1].startswith("encode_") and table[2].startswith("heal_th")  # shortened, kept
    if width >= 180:  # the table's own width
        assert table[2].startswith("heal_thumbnails_for_ever ") and table[2].endswith("x" * 40)


def test_server_trouble_is_shown_on_the_runner_line() -> None:
    server = ServerHealth(last_ok_at=at(-30), consecutive_failures=4, backoff_seconds=8)
    text = to_text(render_status([a_record(server=server)], NOW))
    assert "server unreachable: 4 failed calls, retry in 8.0s, last ok 30.0s ago" in text
    assert "no tasks in flight" in text


def test_lease_health_is_coloured() -> None:
    records = [
        a_record(
            a_task(),
            a_task(task_id="t2", consecutive_failures=1),
            a_task(task_id="t3", state=TaskState.TERMINATING),
        ),
        a_record(a_task(task_id="t4"), pid=17, stale_reason="runner process is gone"),
    ]
    text = to_text(render_status(records, NOW), width=200, colour=True)
    assert "\x1b[32mhealthy" in text
    assert "\x1b[33mat risk" in text
    assert "\x1b[1;31mfencing" in text
    assert "\x1b[31mstale" in text


def test_untrusted_text_is_neither_markup_nor_terminal_control() -> None:
    task = a_task(task_type="[bold]x[/bold]", recent_output=("[red]boom[/red] \x1b[2J\x07done",))
    text = to_text(render_task(a_record(task), task, NOW), width=100, colour=True)
    assert "[bold]x[/bold]" in text
    assert "[red]boom[/red]" in text
    assert "\x1b[2J" not in text and "\x07" not in text
    assert "\ufffd[2J\ufffddone" in text


def test_the_task_view_shows_full_ids_times_and_recent_output() -> None:
    task = a_task(consecutive_failures=1)
    text = to_text(render_task(a_record(task), task, NOW), width=100)
    assert text.splitlines()[:3] == [
        f"task            {TASK_ID}",
        "workflow        9b2d0c11-aaaa-4bbb-8ccc-dddddddddddd",
        "type            encode_video",
    ]
    assert "last heartbeat  3.2s ago (11:59:56 UTC)" in text
    assert "lease ends      in 6.8s (12:00:06 UTC)" in text
    assert "lease           at risk" in text
    assert text.endswith("recent output (2 lines):\n  frame 1/500\n  frame 120/500 (24%)")


def test_the_task_view_of_a_stale_runner_says_so() -> None:
    record = a_record(a_task(), stale_reason="no update for 12.0s")
    text = to_text(render_view([record], NOW, task_id="7f3c"), width=100)
    assert "runner state    STALE (no update for 12.0s)" in text
    assert "lease           stale" in text


def test_task_lookup_reports_unknown_and_ambiguous_ids() -> None:
    record = a_record(a_task(), a_task(task_id="7f3c9999"))
    assert to_text(render_view([record], NOW, task_id="zzz")) == "No task zzz on this host."
    assert "is ambiguous" in to_text(render_view([record], NOW, task_id="7f3c"))


def test_the_task_id_in_the_table_is_a_prefix_that_status_task_id_finds() -> None:
    # Given ids that share their first 8 characters, one of them a prefix of another, and an id
    # held by two runners (a stale one and a live one)
    ids = ["qa_task_0001", "qa_task_0002", "qa_task_0002-retry", TASK_ID]
    records = [
        a_record(*(a_task(task_id=task_id, child_pid=100 + i) for i, task_id in enumerate(ids))),
        a_record(a_task(), pid=17, stale_reason="runner process is gone"),
    ]
    rows = [line.split() for line in to_text(render_status(records, NOW), width=200).splitlines()]
    shown = [row[1] for row in rows if row and row[0] == "encode_video"]
    # Then each is shown as the shortest prefix of at least 8 characters that finds only that task
    assert shown == ["qa_task_0001", "qa_task_0002", "qa_task_0002-", TASK_ID[:8], TASK_ID[:8]]
    for task_id, label in zip(ids[:3], shown, strict=False):  # the id held twice is found twice anyway
        view = to_text(render_view(records, NOW, task_id=label), width=200)
        assert view.startswith(f"task            {task_id}\n"), (label, view)


# --- the command ---------------------------------------------------------------------------------


@pytest.fixture
def app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """A root so that ``status`` stays a subcommand, as in the real app."""

    status.register(app)
    return app


def invoke(app: typer.Typer, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "160"})
    return result.exit_code, result.stdout, result.stderr


def publish_here(state: Path, *tasks: TaskSnapshot) -> StatePublisher:
    runner = runner_info_for_this_process(worker_id="host-a", server_url="http://u:pw@localhost:8080/api")
    publisher = StatePublisher(state, runner)
    publisher.publish(tasks, server=ServerHealth(last_ok_at=datetime.now(UTC)))
    return publisher


def live_task(**changes: object) -> TaskSnapshot:
    now = datetime.now(UTC)
    fields: dict[str, object] = {
        "started_at": now,
        "next_heartbeat_at": now + timedelta(seconds=48),
        "lease_deadline_at": now + timedelta(seconds=60),
    }
    fields.update(changes)
    return a_task(**fields)


def test_status_without_runners(app: typer.Typer, tmp_path: Path) -> None:
    code, out, _ = invoke(app, "--state-dir", str(tmp_path / "none"))
    assert code == exitcodes.OK
    assert out == f"No conductor-run runners on this host (state directory {tmp_path / 'none'}).\n"


def test_status_reads_the_default_state_dir_from_the_environment(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publish_here(tmp_path, live_task())
    monkeypatch.setenv("CONDUCTOR_RUN_STATE_DIR", str(tmp_path))
    code, out, _ = invoke(app)
    assert code == exitcodes.OK
    assert f"runner {os.getpid()}  worker host-a  server http://localhost:8080/api" in out
    assert "pw" not in out


def test_status_reads_the_state_dir_of_the_config_file_run_would_use(
    app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A runner started here with ./conductor.toml's state_dir publishes there: status looked only at
    # the default directory and said there was no runner on this host.
    monkeypatch.delenv("CONDUCTOR_RUN_STATE_DIR", raising=False)
    monkeypatch.delenv("CONDUCTOR_RUN_CONFIG", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    project = tmp_path / "project"
    (project / "mystate").mkdir(parents=True, mode=0o700)
    (project / "conductor.toml").write_text('[worker]\nstate_dir = "mystate"\n')
    publish_here(project / "mystate", live_task())
    monkeypatch.chdir(project)
    code, out, _ = invoke(app)
    assert (code, f"runner {os.getpid()}  worker host-a" in out) == (exitcodes.OK, True), out
    monkeypatch.chdir(tmp_path)  # elsewhere: the file given with --config, its state_dir relative to it
    code, out, _ = invoke(app, "--config", str(project / "conductor.toml"))
    assert (code, f"runner {os.getpid()}  worker host-a" in out) == (exitcodes.OK, True), out
    code, out, _ = invoke(app)  # no config file here: the default directory, which has none
    default = tmp_path / "runtime" / "conductor-run"
    assert out == f"No conductor-run runners on this host (state directory {default}).\n"
    monkeypatch.chdir(project)
    code, out, _ = invoke(app, "--state-dir", str(tmp_path / "other"))  # the flag wins
    assert out == f"No conductor-run runners on this host (state directory {tmp_path / 'other'}).\n"
    (project / "conductor.toml").write_text("[worker]\nstate_dir = 3\n")
    code, _, err = invoke(app)
    assert code == exitcodes.CONFIG and "configuration error: invalid state_dir = 3" in err, err


def test_status_json(app: typer.Typer, tmp_path: Path) -> None:
    publish_here(tmp_path, live_task())
    code, out, _ = invoke(app, "--json", "--state-dir", str(tmp_path))
    assert code == exitcodes.OK
    doc = json.loads(out)
    [runner] = doc["runners"]
    assert runner["stale"] is False
    assert runner["runner"]["server_url"] == "http://localhost:8080/api"
    assert runner["tasks"][0]["task_id"] == TASK_ID
    assert runner["tasks"][0]["health"] == "healthy"


def test_status_task_id(app: typer.Typer, tmp_path: Path) -> None:
    publish_here(tmp_path, live_task())
    code, out, _ = invoke(app, TASK_ID[:8], "--state-dir", str(tmp_path))
    assert code == exitcodes.OK
    assert f"task            {TASK_ID}" in out
    assert "frame 120/500 (24%)" in out
    code, out, _ = invoke(app, TASK_ID, "--json", "--state-dir", str(tmp_path))
    assert code == exitcodes.OK
    assert json.loads(out)["tasks"][0]["recent_output"] == ["frame 1/500", "frame 120/500 (24%)"]


def test_status_of_an_unknown_task(app: typer.Typer, tmp_path: Path) -> None:
    publish_here(tmp_path, live_task())
    code, out, _ = invoke(app, "nope", "--state-dir", str(tmp_path))
    assert code == exitcodes.NOT_FOUND
    assert out == "No task nope on this host.\n"
    code, out, _ = invoke(app, "nope", "--json", "--state-dir", str(tmp_path))
    assert code == exitcodes.NOT_FOUND
    assert json.loads(out)["tasks"] == []


def test_an_insecure_state_dir_is_a_config_error_not_a_traceback(app: typer.Typer, tmp_path: Path) -> None:
    tmp_path.chmod(0o777)
    code, out, err = invoke(app, "--state-dir", str(tmp_path))
    assert code == exitcodes.CONFIG
    assert out == ""
    assert err.startswith(
        f"conductor-run: configuration error: state directory {tmp_path} is writable by group or others"
    )
    assert "Traceback" not in err


def test_watch_and_json_do_not_combine(app: typer.Typer, tmp_path: Path) -> None:
    code, _, err = invoke(app, "--watch", "--json", "--state-dir", str(tmp_path))
    assert code == exitcodes.USAGE
    assert "cannot be combined" in err


def test_watch_without_a_terminal_prints_once(app: typer.Typer, tmp_path: Path) -> None:
    publish_here(tmp_path, live_task())
    code, out, _ = invoke(app, "--watch", "--state-dir", str(tmp_path))
    assert code == exitcodes.OK
    assert out.count(f"runner {os.getpid()}") == 1


def test_prune_deletes_snapshots_of_dead_runners(app: typer.Typer, tmp_path: Path) -> None:
    publish_here(tmp_path, live_task())
    pid = int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True
        ).stdout
    )
    runner = RunnerInfo(pid, "gone", "http://h/api", started_at=datetime.now(UTC))
    StatePublisher(tmp_path, runner).publish([], server=ServerHealth())
    code, out, _ = invoke(app, "--prune", "--state-dir", str(tmp_path))
    assert code == exitcodes.OK
    assert out.startswith("Removed 1 stale snapshot file(s).\n")
    assert not (tmp_path / f"runner-{pid}.json").exists()
    assert (tmp_path / f"runner-{os.getpid()}.json").exists()


@pytest.mark.parametrize("is_terminal", [False, True])
def test_off_a_terminal_every_row_is_printed_whole_on_one_line(is_terminal: bool) -> None:
    # Given a console 60 columns wide, a terminal or a pipe (rich's width for a pipe is 80 or $COLUMNS)
    file = StringIO()
    console = Console(file=file, width=60, force_terminal=is_terminal, color_system=None)
    status.print_whole(console, render_status([a_wide_record()], NOW))
    lines = file.getvalue().splitlines()
    if is_terminal:  # Then a terminal gets the narrow layout
        assert max(len(line) for line in lines) <= 60
        return
    # Then a pipe gets each line at its full width: the runner line unwrapped, every column, every cell
    assert lines[0].endswith("server ok, last call 0.4s ago")
    assert lines[1].split()[-2:] == ["LAST", "OUTPUT"]
    assert lines[3].split() == [
        "heal_thumbnails_for_ever", "a1b2c3d4", "9b2d0c11", "2701234", "undelivered", "-", "2m05s", "3.2s",
        "ago", "in", "4.8s", "in", "6.8s", "in", "55m00s", "50.0M", "x" * 40,
    ]  # fmt: skip


def test_off_a_terminal_a_task_s_output_lines_are_whole() -> None:
    task = a_task(recent_output=("y" * 150,))
    file = StringIO()
    console = Console(file=file, width=60, color_system=None)
    status.print_whole(console, render_task(a_record(task), task, NOW))
    assert file.getvalue().splitlines()[-1] == "  " + "y" * 150


def test_run_watch_rerenders_as_snapshots_change() -> None:
    # Given a loader that yields a runner from its second call on and stops the view on its third
    stop = threading.Event()
    calls: list[int] = []

    def load() -> list[SnapshotRecord]:
        calls.append(1)
        if len(calls) >= 3:
            stop.set()
        return [] if len(calls) == 1 else [a_record(a_task())]

    console = Console(file=StringIO(), width=140, force_terminal=True, color_system=None)
    status.run_watch(
        console,
        load,
        lambda: NOW,
        task_id=None,
        state_dir=Path("/s"),
        stop=stop,
        reload_seconds=0.001,
        auto_refresh=False,
    )
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "No conductor-run runners on this host (state directory /s)." in out
    assert "runner 4242  worker host-a" in out
    assert len(calls) == 3


# --- a real publishing process, read by the real command -----------------------------------------

PUBLISHER_SCRIPT = """
import sys, time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from leasecore.snapshot import OutputTail, ServerHealth, TaskSnapshot, TaskState
from leasecore.state.statefile import StatePublisher, runner_info_for_this_process

info = runner_info_for_this_process(worker_id="script", server_url="http://bob:s3cret@127.0.0.1:9/api")
publisher = StatePublisher(Path(sys.argv[1]), info)
started = datetime.now(UTC)
tail = OutputTail()
i = 0
while True:
    i += 1
    tail.append(f"line {i}")
    now = datetime.now(UTC)
    task = TaskSnapshot("task-xyz", "wf-xyz", "demo", TaskState.RUNNING, started, child_pid=None,
                        last_ack_at=now, next_heartbeat_at=now + timedelta(seconds=8),
                        lease_deadline_at=now + timedelta(seconds=10), lease_timeout_seconds=10.0,
                        recent_output=tail.lines())
    publisher.publish([task], server=ServerHealth(last_ok_at=now))
    time.sleep(0.05)
"""


def run_status(
    state: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``conductor-run status`` in a child process, its stdout and stderr pipes."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "status", "--state-dir", str(state), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.fixture
def publisher_process(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER_SCRIPT, str(tmp_path)])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_real_publisher_process_is_live_then_stale_once_killed(
    tmp_path: Path, publisher_process: subprocess.Popen[bytes]
) -> None:
    snapshot_file = tmp_path / f"runner-{publisher_process.pid}.json"
    wait_until(snapshot_file.exists)

    live = run_status(tmp_path, "--json")
    assert live.returncode == 0, live.stderr
    [runner] = json.loads(live.stdout)["runners"]
    assert runner["stale"] is False
    assert runner["pid"] == publisher_process.pid
    assert runner["runner"]["server_url"] == "http://127.0.0.1:9/api"
    assert runner["tasks"][0]["task_id"] == "task-xyz"
    assert runner["tasks"][0]["health"] == "healthy"
    assert runner["tasks"][0]["last_output_line"].startswith("line ")
    assert "s3cret" not in snapshot_file.read_text()

    publisher_process.kill()  # SIGKILL: the file stays behind, the process is a zombie until reaped
    wait_until(lambda: probe_process(publisher_process.pid, None) is ProcessState.GONE)
    dead = run_status(tmp_path, "--json")
    [runner] = json.loads(dead.stdout)["runners"]
    assert runner["stale"] is True
    assert runner["stale_reason"] == "runner process is gone"
    assert runner["tasks"][0]["health"] == "stale"

    publisher_process.wait(timeout=30)
    human = run_status(tmp_path)
    assert f"runner {publisher_process.pid}  STALE (runner process is gone)" in human.stdout

    pruned = run_status(tmp_path, "--prune")
    assert pruned.returncode == 0
    assert pruned.stdout.startswith("Removed 1 stale snapshot file(s).")
    assert not snapshot_file.exists()


def test_status_piped_prints_whole_rows_whatever_columns_says(tmp_path: Path) -> None:
    # Given a live runner (this process) with a long output line, and COLUMNS=60 in the environment
    output = "frame 120/500 " + "y" * 120
    publish_here(tmp_path, live_task(child_pid=2701234, recent_output=(output,)))
    # When status writes to a pipe
    piped = run_status(tmp_path, env={**os.environ, "COLUMNS": "60"})
    # Then the row, found by its pid as grep would, holds the task id prefix and the whole output line
    assert piped.returncode == 0, piped.stderr
    [row] = [line for line in piped.stdout.splitlines() if " 2701234 " in line]
    assert row.split()[:4] == ["encode_video", TASK_ID[:8], "9b2d0c11", "2701234"]
    assert row.rstrip().endswith(output)
    assert "LAST OUTPUT" in piped.stdout


def test_watch_on_a_terminal_refreshes_until_ctrl_c(
    tmp_path: Path, publisher_process: subprocess.Popen[bytes]
) -> None:
    wait_until((tmp_path / f"runner-{publisher_process.pid}.json").exists)
    main_fd, child_fd = pty.openpty()
    env = {**os.environ, "COLUMNS": "160", "LINES": "40", "TERM": "xterm"}
    watcher = subprocess.Popen(
        [sys.executable, "-m", "cli", "status", "--watch", "--state-dir", str(tmp_path)],
        stdin=child_fd,
        stdout=child_fd,
        stderr=child_fd,
        env=env,
        close_fds=True,
    )
    os.close(child_fd)
    seen = bytearray()

    def read_some() -> None:
        ready, _, _ = select.select([main_fd], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):  # EIO once the child side is closed
                seen.extend(os.read(main_fd, 65536))

    try:
        # The output line changes every 50 ms: two different ones means the view refreshed.
        def refreshed() -> bool:
            read_some()
            return len(set(re_lines(seen))) >= 2

        wait_until(refreshed)
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 0
        read_some()
    finally:
        watcher.kill()
        watcher.wait(timeout=30)
        os.close(main_fd)
    text = seen.decode(errors="replace")
    assert "Traceback" not in text
    assert "Aborted" not in text


def re_lines(data: bytearray) -> list[str]:
    import re

    return re.findall(r"line \d+", data.decode(errors="replace"))


def test_task_labels_are_the_shortest_prefix_no_other_id_starts_with() -> None:
    """The sorted-neighbour labels against the definition, checked pair by pair, on ids built from
    two letters so that they share long prefixes and some are prefixes of others."""
    from cli.render import prefix_labels

    rng = random.Random(7)
    for _ in range(300):
        count = rng.randint(0, 30)
        ids = {"".join(rng.choice("ab") for _ in range(rng.randint(1, 14))) for _ in range(count)}
        expected = {}
        for task_id in ids:
            size = 8
            while size < len(task_id) and any(o.startswith(task_id[:size]) for o in ids - {task_id}):
                size += 1
            expected[task_id] = task_id[:size]
        assert prefix_labels(ids) == expected, ids


def test_the_cgroup_mechanism_and_each_tasks_memory_are_shown() -> None:
    record = a_record(a_task(memory_bytes=3 * 1024 * 1024 * 1024 // 2))
    assert record.snapshot is not None
    runner = dataclasses.replace(record.snapshot.runner, cgroup="cgroup v1: one group per task tree in pids")
    record = dataclasses.replace(record, snapshot=dataclasses.replace(record.snapshot, runner=runner))
    text = to_text(render_status([record], NOW), width=200)
    assert "\n  task trees: cgroup v1: one group per task tree in pids\n" in text
    assert " 1.5G " in text
    (task,) = record.snapshot.tasks
    assert "memory          1.5G" in to_text(render_task(record, task, NOW))
    # And the snapshot keeps both through its JSON form.
    back = RunnerSnapshot.from_json_dict(record.snapshot.to_json_dict())
    assert back.runner.cgroup == runner.cgroup and back.tasks[0].memory_bytes == 3 * 1024**3 // 2


def test_a_tree_ended_by_the_dead_mans_switch_says_so_in_both_views() -> None:
    switched = a_task(state=TaskState.REPORTING, fence_reason="lease_expired", fenced_by="switch")
    fenced = a_task(task_id="7c1e2f33-0000-4000-8000-000000000001", state=TaskState.REPORTING,
                    fence_reason="lease_expired", fenced_by="runner")  # fmt: skip
    host = to_text(render_status([a_record(switched, fenced)], NOW), width=200)
    assert host.count("fencing (switch)") == 1  # the runner's own fence shows no marker
    one = to_text(render_task(a_record(switched), switched, NOW), width=120)
    assert "fenced by" in one and "the fork server's dead-man's switch (the runner was stalled)" in one
    other = to_text(render_task(a_record(fenced), fenced, NOW), width=120)
    assert re.search(r"fenced by\s+runner", other)
    assert TaskSnapshot.from_json_dict(switched.to_json_dict()).fenced_by == "switch"  # status --json
