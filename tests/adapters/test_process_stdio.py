"""The stdio protocol through the real Supervisor: a conductor-cli style script
(``sample_tasks/cli_stdio_worker.py``) reads the whole task on stdin and its stdout is kept as the
result document, bounded, while stderr still streams as lines."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from leasecore.models import Task, TaskStatus
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.results.stdio_protocol import STDOUT_LIMIT_BYTES

from .process_support import Lines, sample

RAW = {
    "taskId": "t-42",
    "workflowInstanceId": "wf-42",
    "taskType": "greet",
    "referenceTaskName": "greet_ref",
    "pollCount": 1,
    "domain": "blue",
    "inputData": {"name": "Ada", "mode": "complete", "lookFor": ["s3cr3t-value"]},
    "workflowTask": {"name": "greet", "taskReferenceName": "greet_ref", "type": "SIMPLE"},
}


def stdio_spec(**fields: Any) -> CommandSpec:
    return CommandSpec(argv=sample("cli_stdio_worker.py"), protocol="stdio", **fields)


def run(tmp_path: Path, raw: dict[str, Any], environ: dict[str, str] | None = None) -> tuple[Any, Lines]:
    tasks_tmp = tmp_path / "tasks"
    tasks_tmp.mkdir(exist_ok=True)
    env = {"PATH": os.environ.get("PATH", os.defpath)} | (environ or {})
    lines = Lines()
    with Supervisor(tmp_path / "state", environ=env, tmp_dir=str(tasks_tmp)) as supervisor:
        child = supervisor.spawn(Task.from_json(raw), stdio_spec(), worker_id="w1", on_line=lines)
        exit_ = child.wait(30)
        assert exit_ is not None, "the child did not finish"
        assert child.wait_gone(10)
    assert list(tasks_tmp.iterdir()) == []  # the task's directory, task.json included, is gone
    return exit_, lines


def test_the_script_reads_the_whole_task_and_its_stdout_is_the_result(tmp_path: Path) -> None:
    secrets = {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET": "s3cr3t-value",
               "CONDUCTOR_AUTH_TOKEN": "s3cr3t-value", "CONDUCTOR_ACCESS_KEY_ID": "k",
               "CONDUCTOR_ACCESS_KEY_SECRET": "s3cr3t-value"}  # fmt: skip
    exit_, lines = run(tmp_path, RAW, secrets)
    assert exit_.exit_code == 0
    assert exit_.stdout_tail == ""  # stdout is the document, not a tail
    assert lines.find("stderr", "working on task t-42 (complete)")  # stderr still streams
    assert not [line for stream, line in lines.items if stream == "stdout"]  # stdout never does
    result = to_task_result(Task.from_json(RAW), exit_, stdio_spec(), worker_id="w1")
    assert result.status is TaskStatus.COMPLETED, result
    out = result.output_data
    assert out["greeting"] == "hello Ada"
    assert out["taskIdFromStdin"] == "t-42" and out["inputFromStdin"] == RAW["inputData"]
    assert out["cliEnv"] == {"TASK_TYPE": "greet", "TASK_ID": "t-42", "WORKFLOW_ID": "wf-42",
                             "EXECUTION_ID": "wf-42", "POLL_DOMAIN": "blue"}  # fmt: skip
    assert out["conductorTaskId"] == "t-42"  # conductor-run's own variables are there too
    assert out["secretsSeen"] == []
    assert not set(secrets) & set(out["envNames"])
    assert [entry.log for entry in result.logs] == ["read the task from stdin", "greeted Ada"]


def test_stdout_past_the_bound_is_read_to_its_end_but_not_kept(tmp_path: Path) -> None:
    raw = RAW | {"inputData": {"mode": "flood"}}
    exit_, _ = run(tmp_path, raw)
    assert exit_.exit_code == 0  # never blocked on a full pipe: it ran to its end
    assert exit_.stdout_document is not None and len(exit_.stdout_document) == STDOUT_LIMIT_BYTES + 1
    result = to_task_result(Task.from_json(raw), exit_, stdio_spec(), worker_id="w1")
    assert result.status is TaskStatus.FAILED
    assert ("worker stdout is too large: 4194328 bytes, over the 3145728-byte (3 MiB) limit"
            in str(result.reason_for_incompletion))  # the whole size printed, though not all of it kept
    assert len(json.dumps(result.output_data)) < 64 * 1024


def test_a_crash_and_garbage_keep_their_stderr(tmp_path: Path) -> None:
    exit_, lines = run(tmp_path, RAW | {"inputData": {"mode": "crash"}})
    result = to_task_result(Task.from_json(RAW), exit_, stdio_spec(), worker_id="w1")
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == "worker execution failed: exit status 3: something broke"
    assert lines.find("stderr", "something broke")
    exit_, _ = run(tmp_path, RAW | {"inputData": {"mode": "garbage"}})
    result = to_task_result(Task.from_json(RAW), exit_, stdio_spec(), worker_id="w1")
    assert str(result.reason_for_incompletion).startswith("invalid worker stdout JSON: Expecting value")
    assert "stdout began: 'this is not JSON\\n'" in str(result.reason_for_incompletion)
