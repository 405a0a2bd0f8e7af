"""The checkpoint file (``leasecore.process.checkpoint``): what it may hold, how a change is seen and
said, the marked log line a later attempt reads back, progress; and the runner's retry look-up
(``leasecore.runner.loop.checkpoints.resume_retry``) against a small fake port."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from leasecore.errors import ConductorUnavailable
from leasecore.lease import LeasePolicy
from leasecore.models import Task
from leasecore.process.checkpoint import (
    CHECKPOINT_LIMIT_BYTES,
    LOG_MARKER,
    CheckpointWatch,
    from_log,
    log_line,
    parse_checkpoint,
    progress_of,
    read_checkpoint_file,
    seed_of,
)
from leasecore.runner.loop.checkpoints import child_deadline, resume_retry


@pytest.mark.parametrize(("data", "text"), [
    (b"", None), (b"  \n", None), (b"null", None), (b'{"a": 1}', '{"a":1}'), (b"[1, 2]", "[1,2]"),
    (b'"x"', '"x"'), (b"3", "3"), ('{"é": "ü"}'.encode(), '{"é":"ü"}'),
])
def test_any_json_value_is_a_checkpoint(data: bytes, text: str | None) -> None:
    read = parse_checkpoint(data)
    assert (read.text, read.error) == (text, None)


@pytest.mark.parametrize(("data", "words"), [
    (b'{"a": ', "is not valid JSON"), (b"NaN", "is not valid JSON"), (b"[" * 100 + b"]" * 100, "nests over"),
    (b'"' + b"x" * CHECKPOINT_LIMIT_BYTES + b'"', "too large"),
])
def test_what_is_not_a_checkpoint_says_why(data: bytes, words: str) -> None:
    read = parse_checkpoint(data)
    assert read.text is None and read.error is not None
    assert read.error.startswith("CONDUCTOR_CHECKPOINT_FILE") and words in read.error


def test_the_file_is_read_without_following_a_link_or_blocking_on_a_fifo(tmp_path: Path) -> None:
    assert read_checkpoint_file(str(tmp_path / "missing")).text is None
    link = tmp_path / "link"
    link.symlink_to("/etc/passwd")
    assert "symbolic link" in (read_checkpoint_file(str(link)).error or "")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in (read_checkpoint_file(str(fifo)).error or "")
    big = tmp_path / "big"
    big.write_bytes(b" " * (CHECKPOINT_LIMIT_BYTES + 5))
    assert "too large" in (read_checkpoint_file(str(big)).error or "")


def test_a_watch_says_each_change_once_and_keeps_the_last_valid_one(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text('{"step": 1}')
    watch = CheckpointWatch(str(path), seed=b'{"step": 1}')
    assert watch.look() is None  # the seed: already in the log (the run's start line says it)
    path.write_text('{"step": 2, "progress": 0.5}')
    assert watch.look() == LOG_MARKER + '{"step":2,"progress":0.5}'
    assert watch.look() is None  # unchanged file: not even read again
    assert watch.progress == 0.5
    tmp = tmp_path / "tmp"
    tmp.write_text('{"step": 3')
    os.replace(tmp, path)  # a rename: a new inode
    said = watch.look()
    assert said is not None and said.startswith("conductor-run: CONDUCTOR_CHECKPOINT_FILE is not valid JSON")
    tmp.write_text('{"step": 3')
    os.replace(tmp, path)  # rewritten, still invalid the same way: said once only
    assert watch.look() is None
    assert watch.value == {"step": 2, "progress": 0.5}  # the last valid one stands
    path.write_text('{"step": 2, "progress": 0.5}')  # back to what was logged: nothing new to say
    assert watch.look() is None


def test_the_seed_round_trips_through_the_log_line() -> None:
    value = {"step": 7, "nested": [1, {"k": "v"}]}
    text = seed_of(value).decode()
    assert json.loads(text) == value
    entries = [{"log": "hello"}, {"log": f"out\n{log_line(text)}\nmore"}, {"log": LOG_MARKER + "{broken"}]
    assert from_log(entries) == value  # the last VALID marked line, also inside a batched entry
    assert from_log([{"log": "nothing"}, "junk", {"log": 3}]) is None
    assert seed_of(None) == b""


@pytest.mark.parametrize(("value", "progress"), [
    ({"progress": 0}, 0.0), ({"progress": 0.25}, 0.25), ({"progress": 1}, 1.0), ({"progress": 1.5}, None),
    ({"progress": -0.1}, None), ({"progress": True}, None), ({"progress": "50%"}, None), ([0.5], None),
    (None, None), ({}, None),
])
def test_progress_is_a_top_level_number_from_0_to_1(value: Any, progress: float | None) -> None:
    assert progress_of(value) == progress


class _Port:
    def __init__(self, task: dict[str, Any], logs: list[Any] | None = None, fail: bool = False) -> None:
        self.task, self.logs, self.fail = task, logs, fail
        self.asked: list[str] = []

    def get_task(self, task_id: str, *, timeout_seconds: float | None = None) -> dict[str, Any]:
        self.asked.append(f"task {task_id}")
        if self.fail:
            raise ConductorUnavailable("GET /tasks: connection refused")
        return self.task

    def request(self, method: str, path: str, *, timeout_seconds: float | None = None,
                uri: str | None = None) -> Any:
        self.asked.append(f"{method} {path}")

        class Reply:
            status_code = 200 if self.logs else 204
            body = json.dumps(self.logs).encode() if self.logs else b""

            def json(self) -> Any:
                return json.loads(self.body)

        return Reply()


RETRY = Task.from_json({"taskId": "t2", "workflowInstanceId": "w", "taskType": "x", "retriedTaskId": "t1"})


def test_a_retry_takes_its_earlier_attempts_output_checkpoint_first() -> None:
    port = _Port({"outputData": {"checkpoint": {"step": 4}}})
    assert resume_retry(RETRY, port).checkpoint == {"step": 4}
    assert port.asked == ["task t1"]


def test_a_retry_falls_back_to_the_earlier_attempts_task_log() -> None:
    port = _Port({"outputData": {}}, logs=[{"log": log_line('{"step":9}')}])
    assert resume_retry(RETRY, port).checkpoint == {"step": 9}
    assert port.asked == ["task t1", "GET /tasks/t1/log"]
    assert resume_retry(RETRY, _Port({"outputData": {}})).checkpoint is None  # 204: no log at all


@pytest.mark.parametrize("status", ["TIMED_OUT", "CANCELED"])
def test_an_attempt_nobody_ended_resumes_from_its_log_over_an_older_yields_output(status: str) -> None:
    port = _Port({"status": status, "outputData": {"checkpoint": {"step": 4}}},
                 logs=[{"log": log_line('{"step":4}')}, {"log": log_line('{"step":7}')}])
    assert resume_retry(RETRY, port).checkpoint == {"step": 7}
    quiet = _Port({"status": status, "outputData": {"checkpoint": {"step": 4}}})  # no log: the output
    assert resume_retry(RETRY, quiet).checkpoint == {"step": 4}


def test_an_attempt_a_runner_ended_resumes_from_its_output_without_reading_the_log() -> None:
    port = _Port({"status": "FAILED", "outputData": {"checkpoint": {"step": 4}}},
                 logs=[{"log": log_line("1")}])
    assert resume_retry(RETRY, port).checkpoint == {"step": 4}
    assert port.asked == ["task t1"]


def test_a_failed_look_up_only_costs_the_resume() -> None:
    assert resume_retry(RETRY, _Port({}, fail=True)).checkpoint is None


def test_no_look_up_for_a_first_attempt_or_a_task_that_has_its_checkpoint() -> None:
    port = _Port({"outputData": {"checkpoint": 1}})
    first = Task.from_json({"taskId": "t1", "workflowInstanceId": "w", "taskType": "x"})
    yielded = Task.from_json({"taskId": "t2", "workflowInstanceId": "w", "taskType": "x",
                              "retriedTaskId": "t1", "outputData": {"checkpoint": {"step": 2}}})
    assert resume_retry(first, port).checkpoint is None
    assert resume_retry(yielded, port).checkpoint == {"step": 2}
    assert port.asked == []


# --- CONDUCTOR_DEADLINE: pure, a fixed "now" ------------------------------------------------------

NOW, EPOCH = 1000.0, 1_800_000_000.0


@pytest.mark.parametrize(("exec_timeout", "hard", "expected"), [
    (0.0, None, None),  # nothing known in advance
    (300.0, None, EPOCH + 300),  # the exec timeout, from the child's start
    (0.0, NOW + 120, EPOCH + 120 - 3.4),  # timeoutSeconds' fence: kill_grace 3 + margin 0.4 ahead
    (300.0, NOW + 120, EPOCH + 120 - 3.4),  # the earlier of the two
    (60.0, NOW + 120, EPOCH + 60),
    (0.0, NOW + 1, EPOCH),  # already due: now, never in the past
])
def test_the_deadline_is_the_earliest_fence_known_at_the_start(
    exec_timeout: float, hard: float | None, expected: float | None
) -> None:
    policy = LeasePolicy(response_timeout_seconds=60, kill_grace_seconds=3.0,
                         exec_timeout_seconds=exec_timeout)
    assert policy.fence_lead_seconds == pytest.approx(3.4)
    got = child_deadline(policy, hard, NOW, EPOCH)
    assert got == (None if expected is None else pytest.approx(expected))
