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


def test_encoded_is_byte_for_byte_json_dumps_of_to_json() -> None:
    """The head written field by field gives json.dumps' own bytes (its escapes, separators and
    order), whatever the fields hold; unusual types go through json.dumps itself."""
    import dataclasses

    base = TaskResult(task_id="t", workflow_id="w", status=TaskStatus.COMPLETED)
    cases = [
        base,
        dataclasses.replace(base, worker_id="host-1", output_data={"exitCode": 0, "signal": None}),
        dataclasses.replace(base, status=TaskStatus.IN_PROGRESS, callback_after_seconds=30),
        dataclasses.replace(base, status=TaskStatus.FAILED,
                            reason_for_incompletion='exit 3: "bad"\n\t\\ é ☃ \x00 \U0001f600',
                            worker_id="naïve\u2028host", output_data={"k": "v\x7f"}),
        dataclasses.replace(base, task_id="", workflow_id="", reason_for_incompletion="", worker_id=""),
        dataclasses.replace(base, callback_after_seconds=True),
        dataclasses.replace(base, task_id=7, worker_id=8),  # type: ignore[arg-type]
        _result(exitCode=3, stdout="x"),  # with logs
        dataclasses.replace(base, output_data={
            "f": [0.1, -2.5e-308, 1e300, float("nan"), float("inf"), -0.0], "t": (1, [None, True, False]),
            "deep": {"a": {"b": {"c": ["é", "\x1f", "☃"]}}}, "": {}, "big": 2**70, "s": "\ud800"}),
    ]
    for result in cases:
        assert result.encoded() == json.dumps(result.to_json()).encode("ascii"), result
