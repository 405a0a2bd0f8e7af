"""Runtime metadata to the child (pure parts): which names become variables, the fail-closed check,
its reason, the Task's parsing, the masked result, and the runner's log filter."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from leasecore.config.loader import parse_toml, resolve
from leasecore.errors import ConfigError
from leasecore.masking import MASK, Masker, mask_result
from leasecore.models import Task, TaskLog, TaskResult, TaskStatus
from leasecore.process.secretenv import (
    METADATA_ENV_VALUE_LIMIT_BYTES,
    SECRETS_FILE_ENV,
    env_name_allowed,
    metadata_env,
    missing_metadata,
    missing_reason,
)
from leasecore.process.spec import CommandSpec, build_child_env
from leasecore.runner.secretbook import LogMasking, SecretBook, installed, static_values


def test_only_valid_names_outside_the_interface_and_not_set_already_become_variables() -> None:
    metadata = {
        "API_TOKEN": "t0ken-value", "lower_ok": "v1", "CONDUCTOR_TASK_ID": "spoof", "conductor_x": "spoof",
        "LD_PRELOAD": "/tmp/evil.so", "1BAD": "v", "has-dash": "v", "": "v", "PATH": "/evil",
        "WITH_NUL": "a\0b", "BIG": "x" * (METADATA_ENV_VALUE_LIMIT_BYTES + 1), "DB_PASSWORD": "kept-out",
    }  # fmt: skip
    env = metadata_env(metadata, taken={"PATH"}, is_kept_from_child=lambda name: name.startswith("DB_"))
    assert env == {"API_TOKEN": "t0ken-value", "lower_ok": "v1"}
    assert not env_name_allowed("Conductor_Secrets_File") and env_name_allowed("_x")


def test_the_child_env_names_the_file_and_never_overrides_what_is_set() -> None:
    task = Task("t1", "w1", "demo", runtime_metadata={"API_TOKEN": "abc-123", "HOME": "/evil",
                                                      "CONDUCTOR_TASK_ID": "spoof"})  # fmt: skip
    spec = CommandSpec(argv=("true",), secret_env_names=("API_*",))
    env = build_child_env({"PATH": "/bin", "HOME": "/home/u"}, spec, task, worker_id="w", input_file="/i",
                          output_file="/o", tree_token="tok", secrets_file="/d/secrets.json")  # fmt: skip
    assert env[SECRETS_FILE_ENV] == "/d/secrets.json"
    assert env["HOME"] == "/home/u" and env["CONDUCTOR_TASK_ID"] == "t1"
    assert "API_TOKEN" not in env  # a name the configuration keeps from children: the file only
    plain = build_child_env({"PATH": "/bin"}, CommandSpec(argv=("true",)), task, worker_id="w",
                            input_file="/i", output_file="/o", tree_token="tok",
                            secrets_file="/d/secrets.json")  # fmt: skip
    assert plain["API_TOKEN"] == "abc-123" and plain["HOME"] == "/evil"  # HOME was not set by the runner
    none = build_child_env({}, CommandSpec(argv=("true",)), task, worker_id="w", input_file="/i",
                           output_file="/o", tree_token="tok")  # fmt: skip
    assert SECRETS_FILE_ENV not in none and "API_TOKEN" not in none


def test_missing_names_are_the_declared_and_required_ones_not_resolved() -> None:
    assert missing_metadata(["A", "B"], ["C", "A"], {"A": "x"}) == ["B", "C"]
    assert missing_metadata([], [], {}) == []
    reason = missing_reason(["B", "C"], ["A", "B"])
    assert "declared by the task definition: B" in reason and "required_secrets" in reason and "C" in reason
    many = missing_reason([f"NAME_{i}" for i in range(500)], [])
    assert len(many) == 500 and many.endswith("...")  # bounded like every reason


def test_the_task_parses_runtime_metadata_and_the_declared_names_and_hides_the_values() -> None:
    data = {
        "taskId": "t", "workflowInstanceId": "w", "taskType": "x",
        "runtimeMetadata": {"A": "secret-a", "N": 5, "Z": None},
        "taskDefinition": {"runtimeMetadata": ["A", "B", "A", 3, ""]},
    }  # fmt: skip
    task = Task.from_json(data)
    assert task.runtime_metadata == {"A": "secret-a", "N": "5"}
    assert task.declared_metadata == ("A", "B")
    assert "secret-a" not in repr(task)
    only_wf_task = Task.from_json({"workflowTask": {"taskDefinition": {"runtimeMetadata": ["Q"]}}})
    assert only_wf_task.declared_metadata == ("Q",) and only_wf_task.runtime_metadata == {}


def test_a_result_is_masked_in_output_reason_and_logs() -> None:
    masker = Masker.of(["hunter22"])
    result = TaskResult("t", "w", TaskStatus.FAILED,
                        output_data={"a": "x hunter22", "hunter22": [1, "hunter22"]},
                        reason_for_incompletion="exit code 1: hunter22", logs=(TaskLog("log hunter22", 5),))
    masked = mask_result(masker, result)
    assert masked.output_data == {"a": f"x {MASK}", MASK: [1, MASK]}
    assert masked.reason_for_incompletion == f"exit code 1: {MASK}"
    assert masked.logs == (TaskLog(f"log {MASK}", 5),)
    clean = TaskResult("t", "w", TaskStatus.COMPLETED, output_data={"a": "b"})
    assert mask_result(masker, clean) is clean


def test_static_values_are_the_credentials_and_the_values_kept_from_children() -> None:
    values = static_values({"CONDUCTOR_AUTH_SECRET": "cred-sec", "DB_PASSWORD": "dbpw-1", "PLAIN": "plain-v"},
                           {"API_KEY": "table-key"}, ["DB_*", "API_*"], ["key-id", None, ""])  # fmt: skip
    assert sorted(values) == ["cred-sec", "dbpw-1", "key-id", "table-key"]


def test_the_runners_log_is_masked_while_a_task_is_here_and_stays_whole() -> None:
    book = SecretBook(["static-cred"])
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger("conductor_run.test_secretbook")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with installed(book, ["conductor_run.test_secretbook"]):
            book.enter("t1", ["task-secret"])
            book.enter("t2", ["task-secret"])  # a second task brings the same value
            logger.warning("reason: %s and %s", "task-secret", "static-cred")
            try:
                raise ValueError("boom task-secret")
            except ValueError:
                logger.exception("failed")
            book.leave("t1")
            logger.warning("still here: %s", "task-secret")  # the second task has it still
            book.enter("t2", ["rotated-secret"])  # entered again (a new delivery): its new values
            logger.warning("rotated: %s %s", "task-secret", "rotated-secret")
            book.leave("t2")
            logger.warning("gone: %s", "task-secret")
        logger.warning("uninstalled: %s", "static-cred")
    finally:
        logger.removeHandler(handler)
    out = stream.getvalue()
    assert "reason: *** and ***" in out and "ValueError: boom ***" in out and "still here: ***" in out
    assert "rotated: task-secret ***" in out
    assert "gone: task-secret" in out  # no task holds it any more: it is not the runner's to mask
    assert "uninstalled: static-cred" in out  # the filter is gone with the block
    assert isinstance(LogMasking(book), logging.Filter)


def test_a_value_too_short_to_mask_is_named_once_per_task_type() -> None:
    book = SecretBook()
    assert book.too_short("t", {"PIN": "123", "OK": "long-enough", "EMPTY": ""}) == ["PIN"]
    assert book.too_short("t", {"PIN": "456"}) == []  # said once
    assert book.too_short("other", {"PIN": "456"}) == ["PIN"]


def test_required_secrets_is_a_list_of_names_and_a_bad_value_names_the_key() -> None:
    ok = resolve(parse_toml('[worker]\nrequired_secrets = ["A", "B", "A"]\n[[task]]\ntype = "t"\n'
                            'command = ["true"]\n', "c.toml"), {}, {}, cwd="/", hostname="h")
    assert ok.tasks[0].required_secrets == ("A", "B")
    with pytest.raises(ConfigError) as caught:
        resolve(parse_toml('[worker]\nrequired_secrets = "A"\n[[task]]\ntype = "t"\ncommand = ["true"]\n',
                           "c.toml"), {}, {}, cwd="/", hostname="h")
    assert "required_secrets" in str(caught.value) and "runtime metadata names" in str(caught.value)


def test_json_log_lines_carry_the_masked_traceback() -> None:
    from cli.run import JsonFormatter

    book = SecretBook(["static-cred"])
    try:
        raise RuntimeError("boom static-cred")
    except RuntimeError:
        record = logging.LogRecord("conductor_run.x", logging.ERROR, __file__, 1, "failed %s",
                                   ("static-cred",), sys.exc_info())  # fmt: skip
    assert LogMasking(book).filter(record)
    line = JsonFormatter().format(record)
    assert "static-cred" not in line and "RuntimeError: boom ***" in line and "failed ***" in line
