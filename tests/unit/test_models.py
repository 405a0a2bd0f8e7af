"""TaskResult's one encoding: the update body and the result-size metric share outputData's text."""

from __future__ import annotations

import json

from leasecore.models import TaskLog, TaskResult, TaskStatus


def _result(**output: object) -> TaskResult:
    return TaskResult(
        task_id="t1", workflow_id="w1", status=TaskStatus.FAILED, output_data=dict(output),
        reason_for_incompletion="exit 3", callback_after_seconds=5, worker_id="host-1",
        logs=(TaskLog("line", 7),),
    )


def test_encoded_is_to_json_as_bytes() -> None:
    result = _result(exitCode=3, stdout="naïve ☃", nested={"a": [1, 2.5, None, True]})
    assert json.loads(result.encoded()) == result.to_json()


def test_an_empty_output_encodes_as_an_empty_object() -> None:
    result = TaskResult(task_id="t", workflow_id="w", status=TaskStatus.COMPLETED)
    assert result.output_json() == "{}"
    assert json.loads(result.encoded()) == {"taskId": "t", "workflowInstanceId": "w",
                                            "status": "COMPLETED", "outputData": {}}


def test_output_json_is_encoded_once_and_its_length_is_its_size_in_bytes() -> None:
    result = _result(text="é" * 10)
    first = result.output_json()
    assert result.output_json() is first  # memoised on the frozen value
    assert first.isascii() and "\\u00e9" in first  # escaped: its length is the bytes the body carries
    assert first.encode("ascii") in result.encoded()


def test_a_replaced_result_encodes_its_own_output() -> None:
    import dataclasses

    result = _result(n=1)
    result.output_json()
    other = dataclasses.replace(result, output_data={"n": 2})
    assert json.loads(other.output_json()) == {"n": 2}
    assert json.loads(other.encoded())["outputData"] == {"n": 2}
