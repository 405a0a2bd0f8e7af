"""`conductor-run fleet` against the embedded server, with real `conductor-run run` processes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from cli import exitcodes
from leasecore.server import EmbeddedServer
from tests.integration.fleet_scenario import check_the_scenario, fleet, two_runners_and_a_stalled_type


def test_fleet_shows_two_runners_polling_and_the_type_nobody_polls_first(tmp_path: Path) -> None:
    with EmbeddedServer() as server:
        worlds, doc = two_runners_and_a_stalled_type(tmp_path, server)
        try:
            check_the_scenario(doc, worlds, server.url)
        finally:
            for world in worlds:
                world.close()


def run_cmd(*args: str, cwd: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    done = subprocess.run([sys.executable, "-m", "cli", "run", "--task-type", "t", "--state-dir",
                           str(cwd / "state"), *args, "--", "/bin/true"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=cwd, check=False,
                          stdin=subprocess.DEVNULL)
    return done.returncode, done.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_server_is_exit_4_with_runs_message(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/api"
    done = fleet("--server", url, "--json", cwd=tmp_path)
    assert done.returncode == exitcodes.UNREACHABLE
    assert done.stdout == ""
    assert done.stderr.startswith(f"conductor-run: server unreachable at {url}: ")
    assert "connection refused" in done.stderr and "Traceback" not in done.stderr
    code, err = run_cmd("--server", url, cwd=tmp_path)
    assert code == exitcodes.UNREACHABLE and err.startswith(f"conductor-run: server unreachable at {url}: ")


def test_refused_or_missing_credentials_are_exit_4_as_for_run(tmp_path: Path) -> None:
    with EmbeddedServer(auth_key="fleet-key", auth_secret="fleet-secret") as server:
        wrong = {"CONDUCTOR_AUTH_KEY": "fleet-key", "CONDUCTOR_AUTH_SECRET": "not-the-secret"}
        done = fleet("--server", server.url, env=wrong, cwd=tmp_path)
        assert done.returncode == exitcodes.UNREACHABLE
        assert done.stderr.startswith(f"conductor-run: the server at {server.url} refused our credentials: ")
        hint = "Check CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET (the key came from env CONDUCTOR_AUTH_KEY)"
        assert hint in done.stderr
        assert "not-the-secret" not in done.stderr + done.stdout
        none = fleet("--server", server.url, cwd=tmp_path)
        assert none.returncode == exitcodes.UNREACHABLE
        assert none.stderr.startswith(f"conductor-run: the server at {server.url} wants credentials: ")
        right = {"CONDUCTOR_AUTH_KEY": "fleet-key", "CONDUCTOR_AUTH_SECRET": "fleet-secret"}
        ok = fleet("--server", server.url, "--json", env=right, cwd=tmp_path)
        assert ok.returncode == exitcodes.OK, ok.stderr


def test_the_server_comes_from_the_config_file_and_the_environment_as_for_run(tmp_path: Path) -> None:
    with EmbeddedServer() as server:
        (tmp_path / "conductor.toml").write_text(f'[server]\nurl = "{server.url}"\n')
        from_file = fleet("--json", cwd=tmp_path)
        assert from_file.returncode == exitcodes.OK, from_file.stderr
        assert f'"server": "{server.url}"' in from_file.stdout
        from_env = fleet("--json", env={"CONDUCTOR_SERVER_URL": server.url})
        assert from_env.returncode == exitcodes.OK, from_env.stderr


def test_bad_input_is_a_one_line_error(tmp_path: Path) -> None:
    bad_url = fleet("--server", "not a url", cwd=tmp_path)
    assert bad_url.returncode == exitcodes.CONFIG
    assert bad_url.stderr.startswith("conductor-run: configuration error: ")
    assert "Traceback" not in bad_url.stderr
    missing = fleet("--config", str(tmp_path / "nope.toml"), cwd=tmp_path)
    assert missing.returncode == exitcodes.CONFIG and "nope.toml" in missing.stderr
    both = fleet("--json", "--watch", cwd=tmp_path)
    assert both.returncode == exitcodes.USAGE and "cannot be combined" in both.stderr
    empty = fleet("--task-type", " ", cwd=tmp_path)
    assert empty.returncode == exitcodes.USAGE and "--task-type is empty" in empty.stderr


def test_a_password_in_the_server_url_never_reaches_the_output(tmp_path: Path) -> None:
    with EmbeddedServer() as server:
        port = server.url.split(":")[2].split("/")[0]
        secret_url = f"http://fleetuser:hunter2secret@127.0.0.1:{port}/api"
        ok = fleet("--server", secret_url, "--json", cwd=tmp_path)
        assert ok.returncode == exitcodes.OK, ok.stderr
        assert "hunter2secret" not in ok.stdout + ok.stderr
        assert json.loads(ok.stdout)["server"] == server.url  # the credentials part is left out
    down = fleet("--server", f"http://fleetuser:hunter2secret@127.0.0.1:{free_port()}/api", cwd=tmp_path)
    assert down.returncode == exitcodes.UNREACHABLE
    assert "hunter2secret" not in down.stdout + down.stderr
