"""The tasks of a dead runner's trees become FAILED results in the outbox of their own server, and are
delivered only while still ours (``leasecore.state.orphans``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from leasecore.clock import FakeClock
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.process.linux.leftovers import TreeRecord
from leasecore.state.orphans import orphan_reason, orphan_result, save_orphans, tree_meta
from leasecore.state.outbox import Outbox, server_key

URL = "http://user:secret@conductor.example:8080/api"
OTHER = "http://other.example/api"


def _tree(key: str, meta: dict[str, Any] | None) -> TreeRecord:
    return TreeRecord(key, 4242, 1, "0" * 32, "", meta)


def _meta(task_id: str, *, url: str = URL, poll_count: int = 2) -> dict[str, Any]:
    task = Task(task_id=task_id, workflow_id=f"wf-{task_id}", task_type="job", poll_count=poll_count)
    return tree_meta(url)(task, "worker-1")


def test_tree_meta_names_the_task_and_the_server_by_hash_never_the_url() -> None:
    meta = _meta("t1")
    assert meta == {"server": server_key(URL), "task_id": "t1", "workflow_id": "wf-t1", "task_type": "job",
                    "poll_count": 2, "worker_id": "worker-1"}
    assert "secret" not in json.dumps(meta) and "example" not in json.dumps(meta)


def test_server_key_is_the_sha256_of_the_url_an_older_runner_named_its_files_by() -> None:
    # server_key uses CPython's builtin SHA-256 to spare the start-up hashlib: the same digest.
    for url in (URL, URL + "/", "http://127.0.0.1:8080/api", "https://conductor.example/api"):
        assert server_key(url) == hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def test_an_orphan_becomes_a_failed_result_with_the_reason() -> None:
    found = orphan_result(77, _meta("t1"))
    assert found == (server_key(URL), TaskResult("t1", "wf-t1", TaskStatus.FAILED,
                                                 reason_for_incompletion=orphan_reason(77),
                                                 worker_id="worker-1"), 2)
    assert orphan_reason(77) == ("the worker running this task died (runner pid 77); its process tree "
                                 "was killed")


@pytest.mark.parametrize("meta", [
    None,
    {},
    {"server": "k", "task_id": "t", "workflow_id": "w"},  # no pollCount: cannot tell another run apart
    {"server": "k", "task_id": "t", "workflow_id": "w", "poll_count": 0},
    {"server": "k", "task_id": "t", "workflow_id": "w", "poll_count": True},
    {"server": "k", "task_id": 5, "workflow_id": "w", "poll_count": 1},
    {"server": "", "task_id": "t", "workflow_id": "w", "poll_count": 1},
])
def test_meta_that_names_no_reportable_task_is_not_reported(meta: dict[str, Any] | None) -> None:
    assert orphan_result(1, meta) is None


def test_each_orphan_goes_to_its_own_servers_outbox(tmp_path: Path) -> None:
    clock = FakeClock()
    trees = [_tree("a", _meta("t1")), _tree("b", _meta("t2", url=OTHER, poll_count=5)), _tree("c", None)]
    assert save_orphans(tmp_path, 4242, trees, clock=clock) == 2
    ours = Outbox(tmp_path, server=URL, clock=clock).entries()
    assert [(e.result.task_id, e.result.status, e.poll_count) for e in ours] == [("t1", TaskStatus.FAILED, 2)]
    assert ours[0].result.reason_for_incompletion == orphan_reason(4242)
    theirs = Outbox(tmp_path, server=OTHER, clock=clock).entries()  # kept for a runner of that server
    assert [(e.result.task_id, e.poll_count) for e in theirs] == [("t2", 5)]


def test_a_result_already_saved_for_the_task_is_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, server=URL, clock=FakeClock())
    outbox.save(TaskResult("t1", "wf-t1", TaskStatus.COMPLETED, output_data={"x": 1}), poll_count=2)
    assert save_orphans(tmp_path, 4242, [_tree("a", _meta("t1"))]) == 0
    (entry,) = outbox.entries()
    assert (entry.result.status, entry.result.output_data) == (TaskStatus.COMPLETED, {"x": 1})


def test_an_orphan_is_delivered_only_while_the_task_is_still_ours(tmp_path: Path) -> None:
    save_orphans(tmp_path, 4242, [_tree("a", _meta("t1")), _tree("b", _meta("t2"))])
    sent: list[TaskResult] = []
    server = {"t1": TaskOwnership(TaskStatus.IN_PROGRESS, 2, "worker-1"),  # still ours
              "t2": TaskOwnership(TaskStatus.IN_PROGRESS, 3, "other-worker")}  # polled again since
    report = Outbox(tmp_path, server=URL).deliver(sent.append, read_task=server.get)
    assert (report.delivered, report.dropped) == (1, 1)
    assert [(r.task_id, r.status) for r in sent] == [("t1", TaskStatus.FAILED)]
    assert not list(tmp_path.glob("*.json"))
