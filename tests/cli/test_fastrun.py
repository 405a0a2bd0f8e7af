"""``cli.fastrun``: a plain ``run`` command line gives ``run`` the overrides typer would, and any
other one is left to typer (so every usage error still reads as typer words it)."""

from __future__ import annotations

from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from cli import fastrun
from cli.runoptions import RUN_OPTIONS, with_run_options
from leasecore.config.keys import CLI_KEYS, KeySpec

PLAIN = [
    [],
    ["--", "true"],
    ["--task-type", "t", "--", "sh", "-c", "echo $1", "--", "x"],
    ["--task-type=t", "--concurrency", "4", "--kill-grace", "2.5", "--", "sleep", "1"],
    ["--server", "http://127.0.0.1:1/api", "--state-dir", "/tmp/s", "--log-format", "json"],
    ["--log-level", "debug", "--log-level=warning", "--log-format", "text"],
    ["--once", "--drain", "--no-lease-extend", "--once-wait", "3", "--max-tasks", "10"],
    ["--lease-extend", "--no-lease-extend", "--lease-extend"],
    ["--terminal-exit-code", "3", "--terminal-exit-code=7", "--terminal-exit-code", "3"],
    ["--exit-code", "3=FAILED_WITH_TERMINAL_ERROR", "--exit-code=75=IN_PROGRESS:30"],
    ["--concurrency", "2", "--concurrency", "8"],  # the last one wins
    ["--shell", "echo hi; exit 3", "--task-type", "a b"],
    ["--heartbeat-timeout", "10", "--exec-timeout", "0", "--drain-timeout", "0.25", "--poll-timeout", "100"],
    ["--worker-id", "w1", "--domain", "d", "--protocol", "stdio", "--user", "nobody", "--group", "g"],
    ["--config", "c.toml", "--ca-bundle", "ca.pem", "--server="],
    ["--task-type", "t", "--"],
    ["--", "--help"],
    ["--", "--", "-x"],
    ["--metrics-port", "0", "--metrics-host", "127.0.0.1", "--cgroup", "off"],
    ["--memory-max", "512M", "--pids-max", "100", "--cpu-max", "0.5", "--nofile", "1024"],
]

NOT_PLAIN = [
    ["--help"],
    ["-h"],
    ["--task-type", "t", "--help", "--", "true"],
    ["true"],  # a word before --: typer's reading of interspersed arguments decides
    ["--concurency", "4"],
    ["--concurrency"],
    ["--concurrency", "x"],
    ["--concurrency", "-1"],
    ["--concurrency", "0x10"],
    ["--concurrency", " 4"],
    ["--kill-grace", "1e3"],
    ["--kill-grace", "nan"],
    ["--server", "-x"],
    ["--once=yes"],
    ["--no-once"],
    ["--version"],
]


def _typer_overrides(args: list[str]) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def capture(overrides: dict[str, Any]) -> None:
        seen.append(overrides)

    app = typer.Typer()
    app.command("run")(with_run_options(capture))

    @app.callback()
    def _root() -> None:
        pass

    result = CliRunner().invoke(app, ["run", *args])
    assert result.exit_code == 0, (args, result.output)
    (overrides,) = seen
    return overrides


_SAMPLES = {"str": "x1", "int": "7", "float": "2.5", "ints": "3", "strs": "3=FAILED"}


def _every_flag_once(spec: KeySpec) -> list[list[str]]:
    """Command lines giving ``spec``'s flag(s) a value of its kind, in both spellings where it has two."""
    assert spec.flag is not None
    if spec.flag_kind == "bool":
        return [[flag] for flag in spec.flag.split("/")]
    value = _SAMPLES[spec.flag_kind]
    return [[spec.flag, value], [f"{spec.flag}={value}"], [spec.flag, value, spec.flag, value]]


@pytest.mark.parametrize("spec", CLI_KEYS, ids=lambda spec: spec.name)
def test_every_declared_flag_reads_the_same_on_both_paths(spec: KeySpec) -> None:
    # Both paths read their flags off the same declarations; this holds them to one reading, for
    # every flag a declaration adds (its kind decides the conversion on both).
    for args in _every_flag_once(spec):
        fast = fastrun.plain_run(["run", *args, "--", "true"], {})
        assert fast is not None, args
        assert fast == _typer_overrides([*args, "--", "true"]), args
        assert fast[spec.override] is not None, args


def test_the_lean_path_and_typer_take_the_same_options_in_the_same_order() -> None:
    assert list(fastrun.FLAGS) == [name for name, _, _ in RUN_OPTIONS if name != "command"]


@pytest.mark.parametrize("args", PLAIN, ids=lambda a: " ".join(a) or "(none)")
def test_a_plain_command_line_gives_what_typer_gives(args: list[str]) -> None:
    fast = fastrun.plain_run(["run", *args], {})
    assert fast is not None, args
    assert fast == _typer_overrides(args)
    assert [type(v) for v in fast.values()] == [type(v) for v in _typer_overrides(args).values()]


@pytest.mark.parametrize("args", NOT_PLAIN, ids=" ".join)
def test_anything_else_is_left_to_typer(args: list[str]) -> None:
    assert fastrun.plain_run(["run", *args], {}) is None


def test_only_run_and_never_while_completing() -> None:
    assert fastrun.plain_run(["status"], {}) is None
    assert fastrun.plain_run([], {}) is None
    assert fastrun.plain_run(["run", "--", "true"], {"_CONDUCTOR_RUN_COMPLETE": "bash_source"}) is None
    assert fastrun.plain_run(["run", "--", "true"], {"HOME": "/"}) is not None
