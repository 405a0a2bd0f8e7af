"""The ``metrics_task_type_label`` key: the SDKs' ``taskType`` by default, ``task_type`` on request,
from flag, env or file, and a clear one-line error for anything else."""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.config.loader import parse_toml, resolve
from leasecore.errors import ConfigError

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


def _runner(environ: dict[str, str] | None = None, overrides: dict[str, Any] | None = None,
            text: str = BASE) -> Any:
    return resolve(parse_toml(text, "conductor.toml"), environ or {}, overrides or {}, cwd="/work",
                   hostname="h").runner


def test_the_label_is_the_sdks_by_default_and_set_by_flag_env_or_file() -> None:
    default = _runner()
    assert default.metrics_task_type_label == "taskType"
    assert str(default.sources["metrics_task_type_label"]) == "default"
    flag = _runner(overrides={"metrics_task_type_label": "task_type"})
    assert flag.metrics_task_type_label == "task_type"
    assert str(flag.sources["metrics_task_type_label"]) == "flag --metrics-task-type-label"
    env = _runner({"CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL": "task_type"})
    assert env.metrics_task_type_label == "task_type"
    assert str(env.sources["metrics_task_type_label"]) == "env CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL"
    file = _runner(text='[worker]\nmetrics_task_type_label = "task_type"\n' + BASE)
    assert file.metrics_task_type_label == "task_type"
    # the flag wins over the env, the env over the file
    both = _runner({"CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL": "task_type"},
                   {"metrics_task_type_label": "taskType"},
                   text='[worker]\nmetrics_task_type_label = "task_type"\n' + BASE)
    assert both.metrics_task_type_label == "taskType"


@pytest.mark.parametrize(
    ("overrides", "environ", "text", "expected"),
    [
        ({"metrics_task_type_label": "task-type"}, {}, BASE,
         "invalid metrics_task_type_label = 'task-type' (from flag --metrics-task-type-label): expected "
         "'taskType' or 'task_type'"),
        ({}, {"CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL": "TaskType"}, BASE,
         "invalid metrics_task_type_label = 'TaskType' (from env CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL)"),
        ({}, {}, '[worker]\nmetrics_task_type_label = 1\n' + BASE, "invalid metrics_task_type_label = 1"),
    ],
)
def test_another_label_name_is_one_line_naming_key_source_and_what_is_allowed(
    overrides: dict[str, Any], environ: dict[str, str], text: str, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _runner(environ, overrides, text)
    assert expected in str(info.value) and "\n" not in str(info.value)
    assert info.value.key == "metrics_task_type_label"
