"""`conductor-run fleet`: the table and the live view (cli/fleet.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

from rich.console import Console

from cli import exitcodes
from cli.fleet import render_fleet, run_watch
from leasecore.config import load_config
from leasecore.errors import ConductorUnavailable
from leasecore.fleet import FleetRow, WorkerPoll, fleet_rows
from leasecore.server import EmbeddedServer

AT = datetime(2026, 12, 1, 22, 0, 0, tzinfo=UTC)
URL = "http://conductor:8080/api"


def text_of(renderable: object, width: int = 140) -> str:
    console = Console(file=StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined,no-any-return]


def test_the_table_puts_a_stalled_type_first_and_says_why() -> None:
    now = 1_800_000_000_000
    rows = fleet_rows(
        {"encode": 0, "gpu:encode": 4, "thumbs": 2},
        [{"queueName": "encode", "workerId": "host-a", "lastPollTime": now - 1200},
         {"queueName": "thumbs", "workerId": "host-b", "lastPollTime": now - 3_725_000}],
        now_ms=now,
    )
    out = text_of(render_fleet(rows, url=URL, at=AT))
    lines = out.splitlines()
    assert lines[0].startswith(f"fleet at {URL}  22:00:00 UTC  2 stalled")
    body = [line for line in lines if "encode" in line or "thumbs" in line]
    assert ["gpu" in body[0], "thumbs" in body[1], "encode" in body[2]] == [True, True, True]
    assert "STALLED" in body[0] and "(no poller)" in body[0] and " 4 " in body[0]
    assert "STALLED" in body[1] and "host-b  1 h 2 min ago" in body[1]
    assert "active" in body[2] and "host-a  1.2 s ago" in body[2] and "(default)" in body[2]
    assert "stalled: work queued and no poll in the last 10 s" in out


def test_an_empty_server_says_so() -> None:
    assert "no task queues and no polls on this server yet" in text_of(render_fleet([], url=URL, at=AT))


def test_the_live_view_keeps_the_last_rows_when_a_refresh_fails_and_recovers() -> None:
    stop = threading.Event()
    calls: list[int] = []
    later = [FleetRow("late_type", None, 0, (WorkerPoll("w9", 0.5),))]

    def load() -> list[FleetRow]:
        calls.append(1)
        if len(calls) == 1:
            raise ConductorUnavailable("GET /tasks/queue/all: connection failed (connection refused)")
        stop.set()
        return later

    console = Console(file=StringIO(), width=140, force_terminal=True, color_system=None)
    resolved = load_config({"server": URL}, {}, os.getcwd(), require_task=False)
    first = [FleetRow("first_type", None, 1, ())]
    run_watch(console, load, url=URL, resolved=resolved, first=first, stop=stop, refresh_seconds=0.001)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    failed = out.index(f"last refresh failed: server unreachable at {URL}: GET /tasks/queue/all")
    assert out.index("first_type") < failed < out.index("late_type")
    assert len(calls) == 2


def test_watch_on_a_terminal_stays_live_until_ctrl_c_then_exits_0(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    env |= {"FORCE_COLOR": "1", "COLUMNS": "160"}  # rich treats stdout as a terminal
    out_path = tmp_path / "out"
    with EmbeddedServer() as server, open(out_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "fleet", "--server", server.url, "--watch"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while "fleet at" not in out_path.read_text() and time.monotonic() < deadline:
                time.sleep(0.05)  # polling interval of a condition wait
            assert "fleet at" in out_path.read_text(), out_path.read_text()
            assert proc.poll() is None  # still watching
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == exitcodes.OK
            assert "Traceback" not in out_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
