"""``run`` checks local things (config, commands, state directory) before it contacts the server.

With the server down, a state directory that cannot be used is still a configuration error (exit 3),
not "server unreachable" (exit 4): the user fixes the first problem first.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from cli import exitcodes


def _closed_port_url() -> str:
    with socket.socket() as sock:  # bound then closed: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/api"


def _run(tmp_path: Path, state_dir: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    argv = [sys.executable, "-m", "cli", "run", "--server", _closed_port_url(), "--task-type", "t",
            "--state-dir", state_dir, "--once", "--", sys.executable, "-c", "pass"]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_an_unusable_state_dir_is_exit_3_even_with_the_server_down(tmp_path: Path) -> None:
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("")
    for state_dir in ("/proc/nope", str(a_file)):
        done = _run(tmp_path, state_dir)
        assert done.returncode == exitcodes.CONFIG, (state_dir, done.stderr)
        assert "state directory" in done.stderr and "unreachable" not in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_with_a_good_state_dir_the_server_being_down_is_exit_4(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    done = _run(tmp_path, str(state_dir))
    assert done.returncode == exitcodes.UNREACHABLE, done.stderr
    assert "server unreachable" in done.stderr
