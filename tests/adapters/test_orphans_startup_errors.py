"""Review regression: an outbox that cannot be looked into must not stop every later start.

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
from leasecore.orphans import save_orphans, tree_meta
from leasecore.process import leftovers

_NEVER_A_PID = 4_194_305  # above the largest pid_max Linux allows (2**22): never alive


@pytest.mark.xfail(strict=True, reason="save_orphans: an OSError from Outbox.has_saved escapes the "
                   "sweep, which then keeps the record, so every start fails the same way")
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
