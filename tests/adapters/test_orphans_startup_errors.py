"""Review regressions: nothing in a dead runner's leftovers may stop every later start.

``run_worker`` passes ``save_orphans`` straight to the start-up sweep, and the sweep keeps a dead
runner's record when ``on_orphans`` raises, so an exception escaping ``save_orphans`` fails this start
and every one after it. ``save_orphans`` logs and skips an ``OSError`` from ``Outbox.save``, but not
one from ``Outbox.has_saved`` (a ``stat`` of the task's outbox file: EACCES for an outbox directory
another user made, EIO, ENAMETOOLONG...). ENAMETOOLONG is the one that can be made here as root.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from leasecore.models import Task
from leasecore.process.linux import leftovers
from leasecore.state.orphans import save_orphans, tree_meta

_NEVER_A_PID = 4_194_305  # above the largest pid_max Linux allows (2**22): never alive


def test_an_outbox_file_that_cannot_be_statted_does_not_stop_the_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    outbox = state / "outbox"
    outbox.mkdir(parents=True)
    task = Task(task_id="x" * 300, workflow_id="wf", task_type="job", poll_count=1)
    meta = tree_meta("http://conductor.example/api")(task, "w1")
    record = state / f"processes-{_NEVER_A_PID}.json"
    record.write_text(json.dumps({
        "runner": {"pid": _NEVER_A_PID, "start_time": 1}, "forkserver": None,
        "trees": [{"key": "t1", "pid": _NEVER_A_PID + 1, "start_time": 1, "token": secrets.token_hex(16),
                   "tmpdir": "", "meta": meta}],
    }))

    leftovers.sweep(state, lambda pid, trees: save_orphans(outbox, pid, trees))

    assert not record.exists()  # handled once (logged, not reported), not again at every start


def _dead_record(state: Path, trees: list[dict[str, object]]) -> Path:
    record = state / f"processes-{_NEVER_A_PID}.json"
    record.write_text(json.dumps({"runner": {"pid": _NEVER_A_PID, "start_time": 1}, "forkserver": None,
                                  "trees": trees}))
    return record


def test_one_task_in_two_trees_is_reported_with_the_latest_claim(tmp_path: Path) -> None:
    """The dead runner was handed the same task again (pollCount 2, then 3): only the latest claim can
    still be ours, so that one is saved (an older one would be dropped as "polled again")."""
    state = tmp_path / "state"
    outbox = state / "outbox"
    outbox.mkdir(parents=True)
    make = tree_meta("http://conductor.example/api")
    claims = [Task(task_id="same", workflow_id="wf", task_type="job", poll_count=n) for n in (2, 3)]
    trees = [
        {"key": f"t{task.poll_count}", "pid": _NEVER_A_PID + task.poll_count, "start_time": 1,
         "token": secrets.token_hex(16), "tmpdir": "", "meta": make(task, "w1")}
        for task in claims
    ]
    record = _dead_record(state, trees)
    leftovers.sweep(state, lambda pid, got: save_orphans(outbox, pid, got))
    saved = [json.loads(p.read_text()) for p in outbox.rglob("*.json")]
    assert [s["poll_count"] for s in saved] == [3]
    assert not record.exists()


@pytest.mark.parametrize("content", ["[]", '{"trees": 7}', '{"runner": {"pid": 1}, "trees": []}', "{"])
def test_a_garbled_record_does_not_stop_the_sweep(tmp_path: Path, content: str) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "processes-1.json").write_text(content)
    assert leftovers.sweep(state, lambda pid, trees: None) == set()
