"""A setting given twice in one table, once by its name and once by its alias, is refused naming both."""

from __future__ import annotations

import pytest

from leasecore.config.loader import parse_toml, resolve
from leasecore.errors import ConfigError

TASK = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


@pytest.mark.parametrize(
    "worker",
    ["thread_count = 2\nconcurrency = 3\n", "concurrency = 3\nthread_count = 2\n"],
)
def test_a_setting_and_its_alias_in_one_table_name_both_spellings(worker: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(parse_toml("[worker]\n" + worker + TASK, "conductor.toml"), {}, {}, cwd="/work", hostname="h")
    message = str(info.value)
    assert "thread_count" in message and "concurrency" in message, message
    assert "concurrency and concurrency" not in message
    assert "are the same setting: give one" in message
