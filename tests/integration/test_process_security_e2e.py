"""Adversarial review of process supervision, end to end: a real `conductor-run run --once` with credentials,
against the embedded server with auth. No credential in any state-directory file (status snapshot, tree
record, outbox), in the log, or in what the task reports; every state file 0600 in a 0700 directory, also
while the task runs."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

from cli import exitcodes
from tests.support import wait_until

from .helpers import AUTH_KEY, AUTH_SECRET, World

KEY, SECRET, TOKEN = AUTH_KEY, AUTH_SECRET, "my-token-5b2a"

# Runs for a while (so the state files exist) and reports what it could see of the secrets.
CHILD = (
    "import json, os, time\n"
    f"seen = [k for k, v in os.environ.items() if any(s in v for s in ({SECRET[:-4]!r}, 'my-token'))]\n"
    "print('started', flush=True)\n"
    "time.sleep(2)\n"
    "with open(os.environ['CONDUCTOR_OUTPUT_FILE'], 'w') as f:\n"
    "    json.dump({'seen': seen}, f)\n"
)


def _check_state_dir(state_dir: Path) -> list[Path]:
    if not state_dir.exists():
        return []  # the runner has not created it yet
    files = [p for p in state_dir.rglob("*") if p.is_file()]
    for directory in [state_dir, *(p for p in state_dir.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    for path in files:
        try:
            text = path.read_text(errors="replace")
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            continue  # replaced atomically under us
        assert SECRET not in text and TOKEN not in text and KEY not in text, path
        assert mode == 0o600, path
    return files


def test_no_credential_in_state_files_logs_or_results(auth_world: World) -> None:
    auth_world.define(response_timeout=30)
    workflow = auth_world.start_workflow()
    config = auth_world.tmp / "conductor.toml"
    config.write_text('[worker]\nsecrets = ["MY_TOKEN"]\n')
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET, "MY_TOKEN": TOKEN}
    proc = auth_world.run("--config", str(config), "--once", command=[sys.executable, "-c", CHILD], env=env)
    names: set[str] = set()

    def both_records_seen() -> bool:
        names.update(p.name.split("-")[0] for p in _check_state_dir(auth_world.state_dir))
        return {"runner", "processes"} <= names

    wait_until(both_records_seen, 30, what="the status snapshot and the tree record")
    code, log = auth_world.finish(proc)
    assert code == exitcodes.OK, log
    _check_state_dir(auth_world.state_dir)
    assert SECRET not in log and TOKEN not in log
    task = auth_world.task_of(workflow)
    assert task["status"] == "COMPLETED"
    assert task["outputData"]["seen"] == []
    body = str(task)
    assert SECRET not in body and TOKEN not in body
