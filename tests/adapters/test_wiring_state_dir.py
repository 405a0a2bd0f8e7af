"""The wiring checks the state directory once and hands that one ``StateDir`` on.

Before the wiring was redone a start made and checked its directory (``ensure_state_dir``), made and
checked it again for the status publisher, and checked it a third time to read the snapshots of the
dead runners whose trees the sweep took over. Now ``run_worker`` makes one ``StateDir`` and the
outbox, the orphans' reports, the sweep's snapshot cleanup and the publisher all use it as it is.
Real: an embedded server on loopback, the fork server, a dead runner's records on disk.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from leasecore.config.loader import load_config
from leasecore.models import Task
from leasecore.runner.wiring import run_worker
from leasecore.server import EmbeddedServer
from leasecore.snapshot import RunnerInfo, ServerHealth
from leasecore.state import directory, statefile
from leasecore.state.directory import StateDir
from leasecore.state.orphans import tree_meta
from leasecore.state.statefile import StatePublisher


def _dead_pid() -> int:
    """The pid of a process that has exited and been reaped (a runner that died)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _plant_dead_runner(state: Path, server_url: str) -> Path:
    """A dead runner's tree record (one tree, its task named) and its status snapshot."""
    pid = _dead_pid()
    task = Task(task_id="orphan-1", workflow_id="wf-1", task_type="t", poll_count=1)
    record = {
        "runner": {"pid": pid, "start_time": 1}, "forkserver": None,
        "trees": [{"key": "t1", "pid": pid, "start_time": 1, "token": secrets.token_hex(16), "tmpdir": "",
                   "meta": tree_meta(server_url)(task, "w1")}],
    }
    (state / f"processes-{pid}.json").write_text(json.dumps(record))
    info = RunnerInfo(pid=pid, worker_id="w1", server_url=server_url, started_at=datetime.now(UTC))
    publisher = StatePublisher(StateDir.open(state), info)
    publisher.publish([], server=ServerHealth())
    return publisher.path


def test_a_start_checks_its_state_directory_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state"
    checked: list[Path] = []
    real_check = directory.check_state_dir

    def counting_check(path: Path) -> None:
        checked.append(path)
        real_check(path)

    with EmbeddedServer() as server:
        state.mkdir(mode=0o700)
        snapshot = _plant_dead_runner(state, server.url)
        monkeypatch.setattr(directory, "check_state_dir", counting_check)
        monkeypatch.setattr(statefile, "check_state_dir", counting_check)
        overrides = {"task_type": "t", "command": [sys.executable, "-c", "pass"], "server": server.url,
                     "state_dir": str(state), "once": True, "once_wait": 0.5}
        config = load_config(overrides, {"PATH": "/usr/bin:/bin"}, str(tmp_path), hostname="h")
        outcome = run_worker(config, environ={})

    assert outcome.started == 0 and outcome.signum is None  # --once found no task: a clean end
    assert checked == [state]  # made and checked once, then handed on
    assert not snapshot.exists()  # the dead runner's snapshot went with its trees
    assert not (state / "outbox").exists() or not any((state / "outbox").iterdir())  # its report: dropped
    assert not list(state.glob("runner-*.json"))  # this runner's own snapshot removed at its clean exit
