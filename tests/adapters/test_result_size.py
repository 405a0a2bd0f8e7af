"""A result may be as big as the server keeps without external storage (3 MiB of outputData), on
both sides of that limit, under both protocols, with real children through the real Supervisor."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.payload import OUTPUT_DATA_LIMIT_BYTES, json_size

from .process_support import sample

MIB = 1024 * 1024
RAW = {"taskId": "t-1", "workflowInstanceId": "wf-1", "taskType": "big", "referenceTaskName": "big_ref",
       "pollCount": 1, "inputData": {}}  # fmt: skip
# Writes {"blob": "x" * SIZE} to the output file, then prints PRINT bytes on stdout (a tail).
NATIVE = ("import json, os, sys; size, printed = int(sys.argv[1]), int(sys.argv[2]); "
          "open(os.environ['CONDUCTOR_OUTPUT_FILE'], 'w').write(json.dumps({'blob': 'x' * size})); "
          "sys.stdout.write(('y' * 99 + chr(10)) * (printed // 100))")  # fmt: skip


def run(tmp_path: Path, spec: CommandSpec, input_data: dict[str, Any]) -> TaskResult:
    raw = RAW | {"inputData": input_data}
    with Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)},
                    tmp_dir=str(tmp_path)) as supervisor:  # fmt: skip
        exit_ = supervisor.spawn(Task.from_json(raw), spec, worker_id="w").wait(60)
    assert exit_ is not None and exit_.exit_code == 0, exit_
    return to_task_result(Task.from_json(raw), exit_, spec, worker_id="w")


def native(size: int, printed: int = 0) -> CommandSpec:
    return CommandSpec(argv=(sys.executable, "-c", NATIVE, str(size), str(printed)))


STDIO = CommandSpec(argv=sample("cli_stdio_worker.py"), protocol="stdio")


@pytest.mark.parametrize("size", [int(1.5 * MIB), OUTPUT_DATA_LIMIT_BYTES - 200])
def test_a_stdio_document_up_to_the_limit_completes(tmp_path: Path, size: int) -> None:
    result = run(tmp_path, STDIO, {"mode": "big", "size": size})
    assert result.status is TaskStatus.COMPLETED, result.reason_for_incompletion
    assert result.output_data == {"blob": "x" * size}
    assert json_size(result.output_data) <= OUTPUT_DATA_LIMIT_BYTES


def test_a_stdio_document_past_the_limit_fails_saying_its_size(tmp_path: Path) -> None:
    size = OUTPUT_DATA_LIMIT_BYTES + 100
    result = run(tmp_path, STDIO, {"mode": "big", "size": size})
    assert result.status is TaskStatus.FAILED
    printed = len(json.dumps({"status": "COMPLETED", "output": {"blob": "x" * size}})) + 1  # + newline
    assert (result.reason_for_incompletion or "").startswith(
        f"worker stdout is too large: {printed} bytes, over the 3145728-byte (3 MiB) limit the server keeps "
        "without external storage; print the result document only, and write big results elsewhere; "
        "stdout began: "
    )
    assert json_size(result.output_data) < 64 * 1024  # the diagnostics only


def test_a_native_output_file_up_to_the_limit_completes_with_the_additions(tmp_path: Path) -> None:
    size = int(2.5 * MIB)
    result = run(tmp_path, native(size, printed=1000), {})
    assert result.status is TaskStatus.COMPLETED, result.reason_for_incompletion
    assert result.output_data["blob"] == "x" * size and result.output_data["exitCode"] == 0
    assert result.output_data["stdoutTail"].endswith("y" * 99)


def test_a_native_output_file_past_the_limit_fails_saying_its_size(tmp_path: Path) -> None:
    size = OUTPUT_DATA_LIMIT_BYTES + 1000
    result = run(tmp_path, native(size), {})
    assert result.status is TaskStatus.FAILED
    file_bytes = len(json.dumps({"blob": "x" * size}))
    assert result.reason_for_incompletion == (
        f"CONDUCTOR_OUTPUT_FILE is too large: {file_bytes} bytes, over the 3145728-byte (3 MiB) limit the "
        "server keeps without external storage; write big results elsewhere"
    )
    assert "blob" not in result.output_data


def test_the_whole_output_data_counts_not_only_the_file(tmp_path: Path) -> None:
    size = OUTPUT_DATA_LIMIT_BYTES - 1000  # the file fits; with a 60 KiB stdout tail, outputData does not
    result = run(tmp_path, native(size, printed=60_000), {})
    assert result.status is TaskStatus.FAILED
    reason = result.reason_for_incompletion or ""
    assert reason.startswith("outputData (the output file's object, the tails, ...) is too large: ")
    assert "over the 3145728-byte (3 MiB) limit" in reason
    shown = int(reason.split("too large: ")[1].split(" bytes")[0])
    assert OUTPUT_DATA_LIMIT_BYTES < shown < OUTPUT_DATA_LIMIT_BYTES + 70_000
    assert "blob" not in result.output_data and result.output_data["outputError"] == reason
    assert json_size(result.output_data) < 128 * 1024


def test_the_size_is_measured_as_the_real_server_measures_it() -> None:
    """Probed on the Conductor 3.32.1 jar: outputData {"blob": "x" * (3 MiB - 11)} (3145728 bytes of
    compact JSON) stayed inline; one byte more was moved to external storage."""
    assert json_size({"blob": "x" * (3 * MIB - 11)}) == OUTPUT_DATA_LIMIT_BYTES
    assert json_size({"é": "ü", "n": [1, 2.5, None, True]}) == len('{"é":"ü","n":[1,2.5,null,true]}'.encode())


@pytest.mark.parametrize("chars", [0, 1000, 65536, 250_000, 262_000, 263_000, 600_000])
def test_without_an_output_file_the_size_is_measured_only_when_it_could_pass_the_limit(chars: int) -> None:
    """Without a file's object, outputData is encoded to be measured only when its tails and error
    could pass the limit at 6 bytes a character (a control character's escape): a result is the same
    either way, and tails that do pass it fail the task saying so."""
    from leasecore.process.spec import ChildExit

    tail = "\x01" * chars  # 6 bytes each in JSON: the worst case
    exit_ = ChildExit(exit_code=0, signal=None, duration_seconds=0.1, stdout_tail=tail, stderr_tail=tail)
    result = to_task_result(Task.from_json(RAW), exit_, CommandSpec(argv=("true",)), worker_id="w")
    whole = {"exitCode": 0, "signal": None, "durationSeconds": 0.1, "stdoutTail": tail, "stderrTail": tail,
             "resources": {"max_rss_bytes": None, "cpu_user_seconds": None, "cpu_system_seconds": None}}
    if json_size(whole) <= OUTPUT_DATA_LIMIT_BYTES:
        assert result.status == TaskStatus.COMPLETED and result.output_data == whole
    else:
        assert result.status == TaskStatus.FAILED
        assert result.reason_for_incompletion is not None and "too large" in result.reason_for_incompletion
        assert "stdoutTail" not in result.output_data
