"""``run`` checks local things (config, commands, state directory) before it contacts the server.

With the server down, a state directory that cannot be used is still a configuration error (exit 3),
not "server unreachable" (exit 4): the user fixes the first problem first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


# Starts the run with SIGTERM blocked, as a parent that blocked it would (a mask passes through exec).
_BLOCKED_TERM = (
    "import os, signal, sys\n"
    "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
)


@pytest.mark.parametrize("term_blocked", [False, True], ids=["plain", "started-with-term-blocked"])
def test_a_signal_during_the_server_check_ends_the_run_at_once(tmp_path: Path, term_blocked: bool) -> None:
    """A server that takes the connection and never answers holds the check for its whole timeout (5 s);
    a SIGTERM meanwhile must end the run then, as a stop (143), not as "server unreachable" (4) later.
    Also when the run was started with SIGTERM blocked: it unblocks what it handles."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/api"
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
        argv = [sys.executable, "-m", "cli", "run", "--server", url, "--task-type", "t",
                "--state-dir", str(tmp_path / "state"), "--", sys.executable, "-c", "pass"]
        if term_blocked:
            argv = [sys.executable, "-c", _BLOCKED_TERM, *argv[1:]]
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
        try:
            conn, _ = silent.accept()  # the check's request is on its way: it waits for an answer now
            with conn:
                signalled_at = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=60)
                took = time.monotonic() - signalled_at
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == exitcodes.SIGTERM, err
    assert "unreachable" not in err and "Traceback" not in err, err
    assert took < 3.5, f"the stop waited {took:.1f} s for the check's timeout"
