"""conductor-cli's ``worker stdio`` contract, the pure part (``leasecore/process/results/stdio_protocol.py``):
the result document parsed on many inputs, the exit mapping, the bounded stdout capture, the
child's extra variables and stdin."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from leasecore.errors import SpawnError
from leasecore.limits import Limits
from leasecore.models import Task, TaskStatus
from leasecore.process import CommandSpec, to_task_result
from leasecore.process.results.stdio_protocol import (
    MAX_LOG_ENTRIES,
    STDOUT_LIMIT_BYTES,
    InvalidReply,
    StdoutDocument,
    parse_reply,
    task_json,
    to_stdio_result,
)
from leasecore.process.spec import ChildExit, build_child_env, is_secret_name, stdio_env

STDIO = CommandSpec(argv=("w",), protocol="stdio", terminal_exit_codes=frozenset({9}))
NO_RESOURCES = {"max_rss_bytes": None, "cpu_user_seconds": None, "cpu_system_seconds": None}


def task(**raw: Any) -> Task:
    body = {"taskId": "t-1", "workflowInstanceId": "wf-1", "taskType": "greet", "inputData": {"a": 1}}
    return Task.from_json(body | raw)


def exit_(code: int | None = 0, stdout: bytes = b"", *, sig: int | None = None, stderr: str = "") -> Any:
    return ChildExit(exit_code=code, signal=sig, duration_seconds=1.23456, stderr_tail=stderr,
                     stdout_document=stdout)  # fmt: skip


def result_of(stdout: bytes | str, code: int | None = 0, **kw: Any) -> Any:
    data = stdout.encode() if isinstance(stdout, str) else stdout
    return to_stdio_result(task(), exit_(code, data, **kw), STDIO, worker_id="w1")


def reason_of(stdout: bytes | str) -> str:
    with pytest.raises(InvalidReply) as info:
        parse_reply(stdout.encode() if isinstance(stdout, str) else stdout)
    return str(info.value)


# ----------------------------------------------------------------------------- valid documents


@pytest.mark.parametrize(
    "status", ["COMPLETED", "FAILED", "IN_PROGRESS", "FAILED_WITH_TERMINAL_ERROR"]
)
def test_each_status_of_the_contract_is_taken_as_is(status: str) -> None:
    reply = parse_reply(json.dumps({"status": status}).encode())
    assert reply.status.value == status
    assert reply.output == {} and reply.logs == () and reply.reason == ""


def test_a_full_document_maps_onto_the_update() -> None:
    doc = {"status": "COMPLETED", "output": {"n": 1, "deep": {"x": [1, 2]}}, "logs": ["one", "two"],
           "reason": "fine"}  # fmt: skip
    result = result_of(json.dumps(doc))
    assert result.status is TaskStatus.COMPLETED
    assert result.output_data == {"n": 1, "deep": {"x": [1, 2]}}  # output is the whole outputData
    assert [entry.log for entry in result.logs] == ["one", "two"]
    assert result.reason_for_incompletion == "fine"
    assert result.callback_after_seconds == 0
    assert result.worker_id == "w1" and result.task_id == "t-1" and result.workflow_id == "wf-1"


def test_failed_carries_its_reason() -> None:
    result = result_of('{"status": "FAILED", "reason": "bad input", "output": {"k": 2}}')
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == "bad input"
    assert result.output_data == {"k": 2}


def test_terminal_error_is_honoured_not_turned_into_failed() -> None:
    result = result_of('{"status": "FAILED_WITH_TERMINAL_ERROR", "reason": "never"}')
    assert result.status is TaskStatus.FAILED_WITH_TERMINAL_ERROR
    assert result.reason_for_incompletion == "never"


def test_in_progress_takes_callback_after_seconds() -> None:
    result = result_of('{"status": "IN_PROGRESS", "callbackAfterSeconds": 30}')
    assert result.status is TaskStatus.IN_PROGRESS
    assert result.callback_after_seconds == 30
    assert result_of('{"status": "IN_PROGRESS"}').callback_after_seconds == 0  # conductor-cli: at once
    assert result_of('{"status": "IN_PROGRESS", "callbackAfterSeconds": 5.0}').callback_after_seconds == 5


def test_callback_after_seconds_is_ignored_for_a_final_status() -> None:
    assert result_of('{"status": "COMPLETED", "callbackAfterSeconds": 30}').callback_after_seconds == 0


@pytest.mark.parametrize(
    "text",
    [
        '  \n{"status": "COMPLETED"}\n\n',  # whitespace around the document
        '{"status": "COMPLETED", "unknown": [1, 2], "extra": null}',  # unknown fields ignored
        '{"Status": "COMPLETED"}',  # Go's encoding/json matches field names case-insensitively
        '{"STATUS": "COMPLETED", "OUTPUT": {"a": 1}}',
        '{"status": "COMPLETED", "output": null, "logs": null, "reason": null}',  # nulls: absent
    ],
)
def test_documents_go_accepts_are_accepted(text: str) -> None:
    assert parse_reply(text.encode()).status is TaskStatus.COMPLETED


def test_an_exact_field_name_wins_over_another_case() -> None:
    reply = parse_reply(b'{"Status": "FAILED", "status": "COMPLETED"}')
    assert reply.status is TaskStatus.COMPLETED


def test_a_repeated_key_takes_its_last_value_like_go() -> None:
    assert parse_reply(b'{"status": "FAILED", "status": "COMPLETED"}').status is TaskStatus.COMPLETED


def test_unicode_in_the_document_survives() -> None:
    reply = parse_reply('{"status": "COMPLETED", "output": {"name": "Zoë ✓"}}'.encode())
    assert reply.output == {"name": "Zoë ✓"}


def test_logs_are_bounded() -> None:
    logs = [f"line {i}" for i in range(MAX_LOG_ENTRIES + 50)]
    reply = parse_reply(json.dumps({"status": "COMPLETED", "logs": logs}).encode())
    assert len(reply.logs) == MAX_LOG_ENTRIES
    assert reply.logs[-1] == logs[-1]  # the newest kept


def test_a_long_reason_is_cut_to_the_reason_limit() -> None:
    result = result_of(json.dumps({"status": "FAILED", "reason": "r" * 5000}))
    assert len(result.reason_for_incompletion) == 500
    assert result.reason_for_incompletion.endswith("...")


# ----------------------------------------------------------------------------- invalid documents


@pytest.mark.parametrize(
    ("stdout", "expected"),
    [
        ("", "stdout is empty"),
        ("  \n\t ", "stdout is empty"),
        ("hello world", "invalid worker stdout JSON: Expecting value"),
        ('{"status": "COMPLETED"', "invalid worker stdout JSON: Expecting ',' delimiter"),
        ('{"status": "COMPLETED"}\n{"status": "FAILED"}', "invalid worker stdout JSON: Extra data"),
        ('progress...\n{"status": "COMPLETED"}', "invalid worker stdout JSON: Expecting value"),
        ('{"status": "COMPLETED"} trailing', "invalid worker stdout JSON: Extra data"),
        ("[1, 2]", "expected an object {status, output, logs, reason}, not an array"),
        ('"COMPLETED"', "not a string"),
        ("null", "not null"),
        ("42", "not a number"),
        ('{"status": "COMPLETED", "output": NaN}', "NaN is not a JSON value"),
        ('{"status": "COMPLETED", "output": [1]}', "output must be an object, not an array"),
        ('{"status": "COMPLETED", "output": "x"}', "output must be an object, not a string"),
        ('{"status": "COMPLETED", "logs": "one line"}', "logs must be an array of strings, not a string"),
        ('{"status": "COMPLETED", "logs": ["a", 1]}', "logs must be an array of strings"),
        ('{"status": "COMPLETED", "reason": 3}', "reason must be a string, not a number"),
        ('{"status": 1}', "status must be a string, not a number"),
        ('{"status": "IN_PROGRESS", "callbackAfterSeconds": -1}', "callbackAfterSeconds must be whole"),
        ('{"status": "IN_PROGRESS", "callbackAfterSeconds": 1.5}', "callbackAfterSeconds must be whole"),
        ('{"status": "IN_PROGRESS", "callbackAfterSeconds": "10"}', "callbackAfterSeconds must be whole"),
        ('{"status": "IN_PROGRESS", "callbackAfterSeconds": true}', "callbackAfterSeconds must be whole"),
        ('{"status": "DONE"}', "invalid status from worker: 'DONE' (expected COMPLETED, FAILED, "),
        ('{"status": "completed"}', "invalid status from worker: 'completed'"),  # values: exact case
        ('{"status": ""}', "invalid status from worker: ''"),
        ('{"output": {"a": 1}}', "invalid status from worker: no status"),
        ("{}", "invalid status from worker: no status"),
    ],
)
def test_what_is_not_the_document_fails_with_a_reason_that_says_why(stdout: str, expected: str) -> None:
    assert expected in reason_of(stdout)


def test_bytes_that_are_not_utf8_are_refused() -> None:
    assert "not UTF-8" in reason_of(b'{"status": "COMPLETED", "output": {"a": "\xff"}}')


def test_deep_nesting_is_refused_not_a_crash() -> None:
    assert "nested too deeply" in reason_of("[" * 100000 + "]" * 100000)
    deep = '{"status": "COMPLETED", "output": {"a": ' + "[" * 300 + "]" * 300 + "}}"
    assert "nested too deeply (over 256 levels)" in reason_of(deep)


def test_stdout_over_the_limit_is_refused_before_parsing() -> None:
    huge = b'{"status": "COMPLETED", "output": {"a": "' + b"x" * STDOUT_LIMIT_BYTES + b'"}}'
    assert STDOUT_LIMIT_BYTES == 3 * 1024 * 1024  # what the server keeps without external storage
    assert ("worker stdout is too large: 3145772 bytes, over the 3145728-byte (3 MiB) limit the "
            "server keeps without external storage") in reason_of(huge)  # fmt: skip
    assert "too large: at least 3145729 bytes" in reason_of(huge[: STDOUT_LIMIT_BYTES + 1])  # as kept
    fits = json.dumps({"status": "COMPLETED", "output": {"a": "x" * (STDOUT_LIMIT_BYTES - 100)}}).encode()
    assert len(fits) <= STDOUT_LIMIT_BYTES and parse_reply(fits).status is TaskStatus.COMPLETED


def test_invalid_stdout_is_failed_with_a_bounded_excerpt_and_diagnostics() -> None:
    garbage = "not json " * 10000
    result = result_of(garbage, stderr="warming up\n")
    assert result.status is TaskStatus.FAILED
    reason = result.reason_for_incompletion
    assert reason.startswith("invalid worker stdout JSON: Expecting value")
    assert "stdout began: 'not json not json" in reason
    assert len(reason) <= 500
    out = result.output_data
    assert out["exitCode"] == 0 and out["signal"] is None and out["durationSeconds"] == 1.235
    assert out["stderrTail"] == "warming up\n"
    assert out["stdoutExcerpt"] == garbage[:4096]
    assert out["resources"] == NO_RESOURCES
    assert result.logs == ()


def test_an_unknown_status_has_no_excerpt_but_names_the_value() -> None:
    result = result_of('{"status": "SUCCESS"}')
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == (
        "invalid status from worker: 'SUCCESS' (expected COMPLETED, FAILED, IN_PROGRESS or "
        "FAILED_WITH_TERMINAL_ERROR)"
    )


# ----------------------------------------------------------------------------- the exit decides first


def test_a_non_zero_exit_fails_with_its_status_and_last_stderr_line() -> None:
    result = result_of('{"status": "COMPLETED"}', 3, stderr="step 1\nsomething broke\n\n")
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == "worker execution failed: exit status 3: something broke"
    assert result.output_data == {"exitCode": 3, "signal": None, "durationSeconds": 1.235,
                                  "stderrTail": "step 1\nsomething broke\n\n",
                                  "resources": NO_RESOURCES}  # fmt: skip
    quiet = result_of("", 4).reason_for_incompletion
    assert quiet == "worker execution failed: exit status 4 (nothing on stderr)"


def test_a_terminal_exit_code_is_a_terminal_error() -> None:
    result = result_of("", 9, stderr="no such customer")
    assert result.status is TaskStatus.FAILED_WITH_TERMINAL_ERROR
    assert result.reason_for_incompletion == "worker execution failed: exit status 9: no such customer"


def test_the_in_progress_exit_code_still_yields() -> None:
    spec = CommandSpec(argv=("w",), protocol="stdio", in_progress_exit_code=75, callback_after_seconds=7)
    result = to_stdio_result(task(), exit_(75), spec, worker_id="w1")
    assert result.status is TaskStatus.IN_PROGRESS and result.callback_after_seconds == 7


def test_death_by_signal_and_the_exec_timeout() -> None:
    killed = result_of('{"status": "COMPLETED"}', None, sig=signal.SIGKILL)
    assert killed.status is TaskStatus.FAILED
    assert killed.reason_for_incompletion == "worker execution failed: killed by SIGKILL"
    assert killed.output_data["signal"] == "SIGKILL"
    spec = CommandSpec(argv=("w",), protocol="stdio", exec_timeout_seconds=30)
    timed = to_stdio_result(task(), exit_(None, sig=signal.SIGTERM), spec, worker_id="w1", timed_out=True)
    assert timed.reason_for_incompletion == "exec timeout after 30s"


MEMORY_CAPPED = CommandSpec(argv=("w",), protocol="stdio", limits=Limits(memory_max=64 * 1024 * 1024))
USAGE = {"max_rss_bytes": 67_000_000, "cpu_user_seconds": 0.5, "cpu_system_seconds": 0.25}


@pytest.mark.parametrize(("code", "sig"), [(None, signal.SIGKILL), (137, None), (0, None)])
def test_an_oom_kill_in_the_group_names_the_memory_limit_whatever_the_exit(code: Any, sig: Any) -> None:
    exit = ChildExit(exit_code=code, signal=sig, duration_seconds=2.0, stderr_tail="",
                     stdout_document=b'{"status": "COMPLETED"}', resources=USAGE, oom_kills=1,
                     memory_limit_by="cgroup")  # fmt: skip
    result = to_stdio_result(task(), exit, MEMORY_CAPPED, worker_id="w1")
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion == (
        "worker execution failed: memory limit 64 MiB exceeded: killed by the kernel's OOM killer"
    )
    assert result.output_data["resources"] == USAGE


def test_a_failing_exit_under_a_memory_rlimit_says_the_limit_was_in_force() -> None:
    exit = ChildExit(exit_code=1, signal=None, duration_seconds=2.0, stderr_tail="MemoryError\n",
                     stdout_document=b"", memory_limit_by="rlimit")  # fmt: skip
    result = to_stdio_result(task(), exit, MEMORY_CAPPED, worker_id="w1")
    assert result.reason_for_incompletion == (
        "worker execution failed: exit status 1: MemoryError"
        " (under memory limit 64 MiB, a per-process rlimit)"
    )


def test_a_valid_document_is_outputdata_as_is_without_resources() -> None:
    document = b'{"status": "COMPLETED", "output": {"n": 1}}'
    exit = ChildExit(exit_code=0, signal=None, duration_seconds=2.0, stderr_tail="",
                     stdout_document=document, resources=USAGE)  # fmt: skip
    result = to_stdio_result(task(), exit, MEMORY_CAPPED, worker_id="w1")
    assert result.status is TaskStatus.COMPLETED and result.output_data == {"n": 1}


def test_to_task_result_hands_the_stdio_protocol_over() -> None:
    result = to_task_result(task(), exit_(0, b'{"status": "COMPLETED", "output": {"x": 1}}'), STDIO,
                            worker_id="w1")  # fmt: skip
    assert result.output_data == {"x": 1}
    native = to_task_result(task(), exit_(0, b""), CommandSpec(argv=("w",)), worker_id="w1")
    assert native.status is TaskStatus.COMPLETED and "exitCode" in native.output_data


# ----------------------------------------------------------------------------- capture, env, stdin


def test_the_capture_keeps_the_document_and_one_byte_over_the_limit() -> None:
    capture = StdoutDocument(limit=10)
    for piece in (b"01234", b"56789", b"abc", b"def"):
        capture.feed(piece)
    capture.close()
    assert capture.document() == b"0123456789a"  # limit + 1: enough to tell "too large"
    assert capture.total_bytes == 16
    assert capture.tail() == "" and capture.last_line() == ""
    small = StdoutDocument(limit=10)
    small.feed(b'{"a": 1}')
    assert small.document() == b'{"a": 1}'


def test_the_child_gets_conductor_clis_variables_beside_ours() -> None:
    t = task(domain="blue")
    assert stdio_env(t) == {"TASK_TYPE": "greet", "TASK_ID": "t-1", "WORKFLOW_ID": "wf-1",
                            "EXECUTION_ID": "wf-1", "POLL_DOMAIN": "blue"}  # fmt: skip
    assert "POLL_DOMAIN" not in stdio_env(task())
    base = {"PATH": "/bin", "POLL_DOMAIN": "stale", "CONDUCTOR_AUTH_TOKEN": "tok",
            "CONDUCTOR_ACCESS_KEY_ID": "id", "CONDUCTOR_ACCESS_KEY_SECRET": "s"}  # fmt: skip
    env = build_child_env(base, STDIO, task(), worker_id="w1", input_file="/i", output_file="/o",
                          tree_token="tok")  # fmt: skip
    assert env["TASK_ID"] == "t-1" and env["EXECUTION_ID"] == "wf-1" and env["TASK_TYPE"] == "greet"
    assert env["CONDUCTOR_TASK_ID"] == "t-1" and env["CONDUCTOR_INPUT_A"] == "1"  # ours still there
    assert "POLL_DOMAIN" not in env  # no domain on this task: the runner's own value is not passed on
    for name in ("CONDUCTOR_AUTH_TOKEN", "CONDUCTOR_ACCESS_KEY_ID", "CONDUCTOR_ACCESS_KEY_SECRET"):
        assert name not in env
    native = build_child_env(base, CommandSpec(argv=("w",)), task(), worker_id="w1", input_file="/i",
                             output_file="/o", tree_token="tok")  # fmt: skip
    assert "TASK_ID" not in native and native["POLL_DOMAIN"] == "stale"  # native: unchanged


def test_conductor_cli_credential_names_are_secret() -> None:
    for name in ("CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET", "CONDUCTOR_AUTH_TOKEN",
                 "CONDUCTOR_ACCESS_KEY_ID", "conductor_access_key_secret"):  # fmt: skip
        assert is_secret_name(name), name
    assert not is_secret_name("TASK_ID")


def test_stdin_is_the_whole_task_as_the_server_sent_it() -> None:
    t = task(pollCount=2, workflowTask={"name": "greet", "taskReferenceName": "g"}, inputData={"n": "Zoë"})
    assert json.loads(task_json(t)) == dict(t.raw)
    assert "Zoë".encode() in task_json(t)
    lone = task(inputData={"s": "\ud800"})
    assert json.loads(task_json(lone))["inputData"]["s"] == "\ud800"  # escaped, still JSON


def test_a_task_too_deep_to_write_is_a_spawn_error() -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(5000):
        node["a"] = {}
        node = node["a"]
    t = Task(task_id="t", workflow_id="w", task_type="x", raw={"inputData": deep})
    with pytest.raises(SpawnError, match="nested too deeply"):
        task_json(t)
