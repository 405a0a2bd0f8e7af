"""``conductor-run run``'s live view: rendering from an in-memory snapshot, and the real CLI on a pty."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import pty
import select
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console

from cli import exitcodes
from cli.runview import ConsoleLogHandler, LiveView, wants_live_view
from leasecore.snapshot import RunnerInfo, RunnerSnapshot, ServerHealth, TaskSnapshot, TaskState
from tests.integration.helpers import World
from tests.support import wait_until

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def snapshot() -> RunnerSnapshot:
    task = TaskSnapshot(
        task_id="3f2a9c1e-0000-4000-8000-000000000001",
        workflow_id="wf-1",
        task_type="encode_video",
        state=TaskState.RUNNING,
        started_at=NOW - timedelta(seconds=75),
        child_pid=4242,
        last_ack_at=NOW - timedelta(seconds=3),
        next_heartbeat_at=NOW + timedelta(seconds=20),
        lease_deadline_at=NOW + timedelta(seconds=27),
        lease_timeout_seconds=30,
        recent_output=("frame 1", "frame 2 of 9"),
    )
    runner = RunnerInfo(pid=777, worker_id="host-a", server_url="http://c:8080/api", started_at=NOW)
    return RunnerSnapshot(runner, ServerHealth(last_ok_at=NOW), (task,), updated_at=NOW)


def rendered(view: LiveView) -> str:
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False, color_system=None).print(view.renderable())
    return out.getvalue()


def test_the_view_shows_each_task_in_flight_from_the_latest_snapshot() -> None:
    view = LiveView(Console(file=io.StringIO()), now=lambda: NOW)
    assert "starting" in rendered(view)
    view.update(snapshot())
    text = rendered(view)
    parts = ("encode_video", "3f2a9c1e", "4242", "running", "1m15s", "3.0s ago", "in 27.0s", "frame 2 of 9")
    for part in parts:
        assert part in text, (part, text)


@pytest.mark.parametrize("width", [60, 100])
def test_the_view_on_a_narrow_terminal_keeps_the_pid_and_task_id_whole(width: int) -> None:
    # Given a task with a 7-digit pid and a long type, on a terminal narrower than the whole table
    snap = snapshot()
    task = dataclasses.replace(snap.tasks[0], child_pid=2701234, task_type="heal_thumbnails_for_ever")
    view = LiveView(Console(file=io.StringIO()), now=lambda: NOW)
    view.update(dataclasses.replace(snap, tasks=(task,)))
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=True, color_system=None).print(view.renderable())
    [row] = [line for line in out.getvalue().splitlines() if line.startswith("heal_")]
    # Then the pid and the task id prefix are there in full; the type gave way
    assert " 2701234 " in row and " 3f2a9c1e " in row and len(row.rstrip()) <= width
    assert "heal_thumbnails_for_ever" not in row


def test_the_view_is_only_for_a_terminal_with_text_logs() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert wants_live_view(terminal, "text")
    assert not wants_live_view(terminal, "json")
    assert not wants_live_view(Console(file=io.StringIO(), force_terminal=False), "text")


def test_log_lines_go_through_the_console_as_plain_text() -> None:
    out = io.StringIO()
    handler = ConsoleLogHandler(Console(file=out, width=80, force_terminal=False))
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    handler.emit(logging.LogRecord("x", logging.INFO, __file__, 1, "task [bold]%s[/] started", ("a",), None))
    assert out.getvalue() == "INFO task [bold]a[/] started\n"  # never parsed as markup


def test_the_real_runner_on_a_terminal_shows_its_task_live(world: World, tmp_path: Path) -> None:
    world.define(response_timeout=30)
    world.start_workflow(seconds=60)
    main_fd, child_fd = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    env |= {"COLUMNS": "200", "LINES": "40", "TERM": "xterm"}
    argv = [sys.executable, "-m", "cli", "run", "--server", world.server.url, "--task-type", world.task_type,
            "--state-dir", str(world.state_dir), "--poll-timeout", "500", "--",
            "/bin/sh", "-c", "echo live-output-marker; exec sleep 60"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdin=child_fd, stdout=child_fd, stderr=child_fd, env=env,
                            close_fds=True)
    os.close(child_fd)
    seen = bytearray()

    def read_some() -> str:
        ready, _, _ = select.select([main_fd], [], [], 0.1)
        if ready:
            with contextlib.suppress(OSError):  # EIO once the child side is closed
                seen.extend(os.read(main_fd, 65536))
        return seen.decode(errors="replace")

    try:
        (pid,) = wait_until(world.child_pids, what="the child to start")
        # The table: header, the child's pid in a row, its last output line (streamed, ~1 s later).
        wait_until(lambda: all(p in read_some() for p in ("LAST OUTPUT", str(pid), "live-output-marker")),
                   what="the live view")
        assert f"started: pid {pid}" in read_some()  # log lines still show
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == exitcodes.SIGTERM
        read_some()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        os.close(main_fd)
    assert "Traceback" not in seen.decode(errors="replace")
