"""TaskResult's one encoding: the update body and the result-size metric share outputData's text; and
Task.from_json, held to what the constructor makes of the same JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from leasecore.models import Task, TaskLog, TaskResult, TaskStatus, _checkpoint_of, _int


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


def _through_init(data: Mapping[str, Any]) -> Task:
    """What from_json made through the class's own __init__ (before it set the fields in one update)."""
    from leasecore.models import _metadata_names, _metadata_values

    workflow_task = data.get("workflowTask") or {}
    task_def = data.get("taskDefinition") or workflow_task.get("taskDefinition") or {}
    input_data = data.get("inputData")
    return Task(
        task_id=str(data.get("taskId", "")), workflow_id=str(data.get("workflowInstanceId", "")),
        task_type=str(data.get("taskType") or data.get("taskDefName") or ""),
        reference_name=str(data.get("referenceTaskName") or ""), retry_count=_int(data.get("retryCount")),
        poll_count=_int(data.get("pollCount")),
        response_timeout_seconds=_int(data.get("responseTimeoutSeconds",
                                               task_def.get("responseTimeoutSeconds"))),
        timeout_seconds=_int(task_def.get("timeoutSeconds")),
        input_data=input_data if isinstance(input_data, dict) else {}, domain=data.get("domain") or None,
        worker_id=data.get("workerId") or None, raw=dict(data), start_time_ms=_int(data.get("startTime")),
        update_time_ms=_int(data.get("updateTime")),
        start_delay_seconds=_int(data.get("startDelayInSeconds")),
        checkpoint=_checkpoint_of(data.get("outputData")),
        runtime_metadata=_metadata_values(data.get("runtimeMetadata")),
        declared_metadata=_metadata_names(task_def.get("runtimeMetadata")),
    )  # fmt: skip


_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**13), st.sampled_from(["", "7", "x", "3.5"]),
                   st.floats(allow_nan=False, allow_infinity=False, width=32))  # fmt: skip
_KEYS = ["taskId", "workflowInstanceId", "taskType", "taskDefName", "referenceTaskName", "retryCount",
         "pollCount", "responseTimeoutSeconds", "domain", "workerId", "startTime", "updateTime",
         "startDelayInSeconds"]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    fields=st.dictionaries(st.sampled_from(_KEYS), _VALUE),
    task_def=st.one_of(st.none(), st.dictionaries(
        st.sampled_from(["timeoutSeconds", "responseTimeoutSeconds", "runtimeMetadata"]),
        st.one_of(_VALUE, st.lists(st.sampled_from(["A", "B", "", 3]))))),
    where=st.sampled_from(["top", "workflowTask"]),
    extra=st.dictionaries(st.sampled_from(["inputData", "outputData", "runtimeMetadata"]), st.one_of(
        st.none(), st.just({"checkpoint": {"n": 2}, "k": [1]}),
        st.just({"SECRET": "s3cret", "N": 5, "Z": None}), st.just([1, 2]))),
)  # fmt: skip
def test_from_json_sets_what_the_constructor_sets(
    fields: dict[str, Any], task_def: dict[str, Any] | None, where: str, extra: dict[str, Any]
) -> None:
    data: dict[str, Any] = {**fields, **extra}
    if task_def is not None:
        if where == "top":
            data["taskDefinition"] = task_def
        else:
            data["workflowTask"] = {"taskDefinition": task_def}
    got, want = Task.from_json(data), _through_init(data)
    assert got == want
    assert vars(got) == vars(want)  # the fields left out of == too: raw, checkpoint, runtime metadata
    assert type(got) is Task
