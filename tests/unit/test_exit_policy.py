"""The exit-code policy and the child's ``$`` keys: config (``exit_codes``, ``--exit-code``, conflicts
with the shorthands) and the result mapping's precedence (pure: ChildExit values, no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.config.loader import parse_toml, resolve
from leasecore.errors import ConfigError
from leasecore.models import Task, TaskStatus
from leasecore.process.results.task_result import to_task_result
from leasecore.process.spec import ChildExit, CommandSpec, ExitRule
from leasecore.runner.plans import exit_rules

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'
TASK = Task("t1", "wf1", "encode")


def _resolve(text: str, overrides: dict[str, Any] | None = None) -> Any:
    loaded = parse_toml(text, "conductor.toml")
    return resolve(loaded, {}, overrides or {}, cwd="/work", hostname="h").tasks[0]


def _error(text: str, overrides: dict[str, Any] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        _resolve(text, overrides)
    return str(info.value)


# --- config ---------------------------------------------------------------------------------------

def test_a_table_in_the_file_is_the_policy_with_its_provenance() -> None:
    task = _resolve(BASE + 'exit_codes = { 75 = "in_progress:30", 3 = "FAILED_WITH_TERMINAL_ERROR" }\n')
    assert task.exit_codes == {"3": "FAILED_WITH_TERMINAL_ERROR", "75": "IN_PROGRESS:30"}
    assert "conductor.toml:4" in str(task.sources["exit_codes"])
    assert exit_rules(task.exit_codes) == {3: ExitRule(TaskStatus.FAILED_WITH_TERMINAL_ERROR),
                                           75: ExitRule(TaskStatus.IN_PROGRESS, 30)}


def test_flags_replace_the_file_and_may_repeat() -> None:
    task = _resolve(BASE + 'exit_codes = { 3 = "FAILED" }\n',
                    {"exit_codes": ["4=COMPLETED", "9=IN_PROGRESS", "4=COMPLETED"]})
    assert task.exit_codes == {"4": "COMPLETED", "9": "IN_PROGRESS"}
    assert str(task.sources["exit_codes"]) == "flag --exit-code"


@pytest.mark.parametrize("rule", [
    '{ 0 = "FAILED" }', '{ 256 = "FAILED" }', '{ 3 = "DONE" }', '{ 3 = "FAILED:10" }', '{ 3 = 1 }',
    '{ x = "FAILED" }', '{ 3 = "IN_PROGRESS:-1" }', '["3"]', '"3=FAILED"',
])
def test_a_bad_policy_names_the_key_where_and_what_is_allowed(rule: str) -> None:
    message = _error(BASE + f"exit_codes = {rule}\n")
    assert "exit_codes" in message and "conductor.toml:4" in message
    assert "IN_PROGRESS:SECONDS" in message and "1..255" in message


def test_one_code_mapped_twice_on_the_command_line_is_an_error() -> None:
    message = _error(BASE, {"exit_codes": ["3=FAILED", "3=COMPLETED"]})
    assert "--exit-code" in message and "mapped twice" in message


@pytest.mark.parametrize(("shorthand", "other"), [
    ("terminal_exit_codes = [3]", "terminal_exit_codes"),
    ("in_progress_exit_code = 3", "in_progress_exit_code"),
])
def test_a_shorthand_that_disagrees_is_an_error_naming_both(shorthand: str, other: str) -> None:
    message = _error(BASE + f'{shorthand}\nexit_codes = {{ 3 = "COMPLETED" }}\n')
    assert "exit_codes" in message and other in message and "exit code 3" in message


def test_a_shorthand_that_agrees_is_fine() -> None:
    task = _resolve(BASE + 'terminal_exit_codes = [3]\nin_progress_exit_code = 75\n'
                    'exit_codes = { 3 = "FAILED_WITH_TERMINAL_ERROR", 75 = "IN_PROGRESS:5" }\n')
    assert task.exit_codes["75"] == "IN_PROGRESS:5"


# --- the result: precedence -----------------------------------------------------------------------

TERMINAL = TaskStatus.FAILED_WITH_TERMINAL_ERROR
SPEC = CommandSpec(argv=("x",), callback_after_seconds=60, in_progress_exit_code=75,
                   terminal_exit_codes=frozenset({2}),
                   exit_codes={4: ExitRule(TaskStatus.COMPLETED), 5: ExitRule(TaskStatus.IN_PROGRESS, 7),
                               6: ExitRule(TaskStatus.FAILED_WITH_TERMINAL_ERROR)})


def _result(code: int | None = 0, output: dict[str, Any] | None = None, **exit_: Any) -> Any:
    exit_.setdefault("stderr_tail", "oops")
    return to_task_result(TASK, ChildExit(code, exit_.pop("signal", None), 1.0, output=output, **exit_),
                          SPEC, worker_id="w")


@pytest.mark.parametrize(("code", "status", "callback"), [
    (0, TaskStatus.COMPLETED, 0), (1, TaskStatus.FAILED, 0), (2, TERMINAL, 0), (4, TaskStatus.COMPLETED, 0),
    (5, TaskStatus.IN_PROGRESS, 7), (6, TERMINAL, 0), (75, TaskStatus.IN_PROGRESS, 60),
])
def test_each_policy_maps_its_code(code: int, status: TaskStatus, callback: int) -> None:
    result = _result(code)
    assert (result.status, result.callback_after_seconds) == (status, callback)
    if status in (TaskStatus.FAILED, TaskStatus.FAILED_WITH_TERMINAL_ERROR):
        assert result.reason_for_incompletion == f"exit code {code}: oops"


@pytest.mark.parametrize(("status", "code"), [
    ("FAILED", 0), ("FAILED_WITH_TERMINAL_ERROR", 0), ("COMPLETED", 1), ("IN_PROGRESS", 0),
])
def test_the_childs_status_decides_over_the_plain_exit_code(status: str, code: int) -> None:
    result = _result(code, {"$status": status, "$reason": "my words", "$callbackAfterSeconds": 9, "n": 1})
    assert result.status is TaskStatus(status)
    assert result.output_data["n"] == 1
    assert not any(key.startswith("$") for key in result.output_data)
    if status == "COMPLETED":
        assert result.reason_for_incompletion is None
    else:
        assert result.reason_for_incompletion == "my words"
    assert result.callback_after_seconds == (9 if status == "IN_PROGRESS" else 0)


def test_a_failure_set_by_the_child_without_a_reason_says_so() -> None:
    result = _result(0, {"$status": "FAILED_WITH_TERMINAL_ERROR"})
    words = "the command set $status FAILED_WITH_TERMINAL_ERROR (exit code 0)"
    assert result.reason_for_incompletion == words


def test_the_policy_decides_over_the_childs_status_but_takes_its_reason_and_callback() -> None:
    assert _result(2, {"$status": "COMPLETED"}).status is TaskStatus.FAILED_WITH_TERMINAL_ERROR
    failed = _result(6, {"$status": "IN_PROGRESS", "$reason": "bad input"})
    assert (failed.status, failed.reason_for_incompletion) == (TERMINAL, "bad input")
    assert _result(5, {"$callbackAfterSeconds": 1}).callback_after_seconds == 1
    assert _result(75, {"$status": "FAILED"}).status is TaskStatus.IN_PROGRESS


@pytest.mark.parametrize("ended", [{"signal": 9}, {"oom_kills": 1}])
def test_the_runners_own_verdict_decides_over_everything(ended: dict[str, Any]) -> None:
    code = None if "signal" in ended else 137
    result = _result(code, {"$status": "COMPLETED", "$reason": "fine"}, **ended)
    assert result.status is TaskStatus.FAILED and result.reason_for_incompletion != "fine"
    assert "$status" not in result.output_data


def test_an_exec_timeout_decides_over_the_childs_status() -> None:
    result = to_task_result(TASK, ChildExit(None, 15, 1.0, output={"$status": "COMPLETED"}), SPEC,
                            worker_id="w", timed_out=True)
    assert result.status is TaskStatus.FAILED and "exec timeout" in (result.reason_for_incompletion or "")


@pytest.mark.parametrize(("output", "words"), [
    ({"$status": "DONE"}, "must be one of COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR, IN_PROGRESS"),
    ({"$status": 3}, "not 3"),
    ({"$reason": ["x"]}, "$reason must be a string, not an array"),
    ({"$status": "IN_PROGRESS", "$callbackAfterSeconds": -1}, "$callbackAfterSeconds must be whole seconds"),
    ({"$status": "IN_PROGRESS", "$callbackAfterSeconds": 1.5}, "not 1.5"),
    ({"$status": "IN_PROGRESS", "$callbackAfterSeconds": True}, "not true"),
])
def test_an_invalid_dollar_value_is_failed_with_a_reason(output: dict[str, Any], words: str) -> None:
    result = _result(0, output)
    assert result.status is TaskStatus.FAILED
    assert result.reason_for_incompletion.startswith("CONDUCTOR_OUTPUT_FILE: ")
    assert words in result.reason_for_incompletion
    assert result.output_data["outputError"] == result.reason_for_incompletion
    assert not any(key.startswith("$") for key in result.output_data)
