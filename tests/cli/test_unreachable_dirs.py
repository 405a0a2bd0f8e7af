"""A path below a directory this user may not enter: status, run and init say so, never a traceback.

``Path.exists`` and ``Path.is_dir`` raise PermissionError there (they swallow only "no such file"),
so each of these crashed with one, e.g. a non-root ``status`` that inherited ``HOME=/root``. Root
enters every directory: the CLI runs as nobody (setpriv), through a system Python 3.11 (this venv's
may live under /root) with the repository and the venv's pure-Python packages on PYTHONPATH.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import tempfile
from pathlib import Path

import pytest

from cli import exitcodes

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3.11"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or not os.path.exists(SYSTEM_PYTHON),
    reason="needs root, setpriv and /usr/bin/python3.11 to run the CLI as a user kept out of a directory",
)


def _as_nobody(args: list[str], home: str = "/tmp") -> subprocess.CompletedProcess[str]:
    packages = [p for p in site.getsitepackages() if p.startswith(str(REPO))] or site.getsitepackages()
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "PYTHONPATH": os.pathsep.join([str(REPO), *packages])}
    argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-m", "cli", *args]
    return subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def closed(tmp_path: Path) -> Path:
    """A directory only root may enter (pytest's tmp_path is root's)."""
    tmp_path.chmod(0o700)
    return tmp_path


@pytest.mark.parametrize("args", [["status"], ["status", "--json"], ["status", "--prune"], ["status", "ab1"]])
def test_status_refuses_a_state_dir_it_cannot_enter(closed: Path, args: list[str]) -> None:
    done = _as_nobody([*args, "--state-dir", str(closed / "state")])
    assert "Traceback" not in done.stderr
    why = f"cannot use state directory {closed / 'state'}: Permission denied"
    assert done.returncode == exitcodes.CONFIG
    assert done.stderr.strip() == f"conductor-run: configuration error: {why}"


def test_status_with_a_default_state_dir_under_a_home_it_cannot_enter(closed: Path) -> None:
    # sudo -u keeping the environment: HOME still names root's home.
    done = _as_nobody(["status"], home=str(closed))
    assert "Traceback" not in done.stderr
    assert done.returncode == exitcodes.CONFIG
    assert f"state directory {closed}/.local/state/conductor-run: Permission denied" in done.stderr


def test_status_names_the_owner_of_a_closed_state_dir() -> None:
    # It can be looked at (in /tmp) but is root's, 0700: the owner check's message and exit 3 (click's
    # own "is not readable" made it a usage error, exit 2).
    closed = Path(tempfile.mkdtemp(prefix="state-", dir="/tmp"))
    try:
        done = _as_nobody(["status", "--state-dir", str(closed)])
    finally:
        closed.rmdir()
    assert done.returncode == exitcodes.CONFIG
    assert f"state directory {closed} belongs to uid 0, not to this user (uid 65534)" in done.stderr


def test_run_refuses_a_state_dir_it_cannot_enter(closed: Path) -> None:
    args = ["run", "--server", "http://127.0.0.1:9/api", "--task-type", "x", "--state-dir", str(closed / "s")]
    done = _as_nobody([*args, "--", "true"])
    assert "Traceback" not in done.stderr
    assert done.returncode == exitcodes.CONFIG
    assert f"cannot use state directory {closed / 's'}: Permission denied" in done.stderr


def test_init_refuses_a_file_it_cannot_reach(closed: Path) -> None:
    done = _as_nobody(["init", str(closed / "conductor.toml")])
    assert "Traceback" not in done.stderr
    assert (done.returncode, done.stderr.strip()) == (
        exitcodes.USAGE,
        f"conductor-run: cannot write {closed / 'conductor.toml'}: Permission denied",
    )
    assert not (closed / "conductor.toml").exists()


def test_a_config_file_it_cannot_reach_is_not_called_missing(closed: Path) -> None:
    config = closed / "conductor.toml"
    config.write_text('[[task]]\ntype = "x"\ncommand = ["true"]\n')
    done = _as_nobody(["config", "--config", str(config)])
    assert done.returncode == exitcodes.CONFIG
    assert done.stderr.strip() == (
        f"conductor-run: configuration error: config file {config} (from --config) cannot be looked at: "
        "Permission denied"
    )
