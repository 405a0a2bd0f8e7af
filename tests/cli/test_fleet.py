"""`conductor-run fleet`: the table and the live view (cli/fleet.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from datetime import UTC, datetime
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from cli import exitcodes
from cli.fleet import render_fleet, run_watch
from leasecore.config.loader import load_config
from leasecore.errors import ConductorUnavailable
from leasecore.fleet.view import FleetRow, WorkerPoll, fleet_rows
from leasecore.server import EmbeddedServer
from tests.support import wait_until
from tests.tlsrelay import TlsRelay, make_private_ca

AT = datetime(2026, 12, 1, 22, 0, 0, tzinfo=UTC)
URL = "http://conductor:8080/api"
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")


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
            wait_until(lambda: "fleet at" in out_path.read_text(), 30, "the first frame of fleet --watch")
            assert proc.poll() is None  # still watching
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=30) == exitcodes.OK
            assert "Traceback" not in out_path.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- --ca-bundle, as for run (the key ca_bundle, the flag first) -----------------------------------


def _fleet_json(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    from typer.testing import CliRunner

    from cli.main import _register, app

    _register()
    result = CliRunner().invoke(app, ["fleet", "--json", *args], env={"COLUMNS": "200", **env})
    assert "Traceback" not in result.stdout + result.stderr
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_ca_bundle_flag_trusts_a_private_ca_and_wins_over_the_environment(tmp_path: Path) -> None:
    certs = make_private_ca(tmp_path)
    system = "/etc/ssl/certs/ca-certificates.crt"  # a real bundle without the test's CA
    untrusting = {name: system if Path(system).exists() else "" for name in CA_VARS}
    with EmbeddedServer() as server:
        port = int(server.url.split(":")[2].split("/")[0])
        with TlsRelay(certs, "127.0.0.1", port) as relay:
            url = relay.url_for("/api")
            code, out, err = _fleet_json("--server", url, "--ca-bundle", str(certs.ca), env=untrusting)
            assert code == exitcodes.OK, err
            assert json.loads(out)["server"] == url
            code, _, err = _fleet_json("--server", url, env=untrusting)  # the flag is what trusted it
            assert code == exitcodes.UNREACHABLE, err


def test_a_missing_ca_bundle_is_exit_3_naming_the_flag(tmp_path: Path) -> None:
    missing = tmp_path / "none.pem"
    code, _, err = _fleet_json("--server", "https://127.0.0.1:1/api", "--ca-bundle", str(missing), env={})
    assert code == exitcodes.CONFIG
    assert f"ca_bundle {missing} (from flag --ca-bundle)" in err and err.count("\n") == 1
