"""Each option is declared once, on its settings field; what is derived from the declarations says
what they say: the key table, the environment's reading, the flags of run/config/worker stdio,
--help, init's file and the configuration reference."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import reference
from cli.init import starter_text
from cli.main import _register, app
from cli.workerstdio import REPLACED
from leasecore.config import keys
from leasecore.config.checks import bool_from_text, float_from_text, int_from_text, int_range, nonempty_str
from leasecore.config.keys import CLI_KEYS, KEYS, RESTART_ONLY, SCOPES, KeySpec, keys_of
from leasecore.config.loader import OVERRIDE_KEYS, parse_toml, resolve
from leasecore.config.settings import OPTION, TaskSettings, option

REPO = Path(__file__).resolve().parents[2]


def test_every_settings_field_is_a_declared_option_and_the_table_follows_the_fields() -> None:
    for scope, cls in SCOPES.items():
        names = [item.name for item in fields(cls) if item.name != "sources"]
        assert [spec.name for spec in keys_of(scope)] == names, scope
        assert all(OPTION in item.metadata for item in fields(cls) if item.name != "sources"), scope


def test_a_new_declaration_gets_its_name_scope_default_kind_and_env_reading_from_its_field() -> None:
    @dataclass(frozen=True)
    class Probe:
        name: str = option(check=nonempty_str, help="required")
        ratio: float = option(0.5, check=float, help="a ratio", worker_prop="ratio", flag="--ratio")
        count: int | None = option(None, check=int_range(1), help="a count", restart="fixed")
        size: int | None = option(None, check=int, help="a size", kind="str", flag="--size")
        switch: bool = option(True, check=bool, help="a switch", flag="--switch/--no-switch")
        tags: Mapping[str, str] = option(check=dict, help="tags", factory=dict)

    made = {item.name: keys._spec("task", item) for item in fields(Probe)}
    name, ratio, count, size, switch, tags = made.values()
    assert (ratio.name, ratio.scope, ratio.default, ratio.flag_kind, ratio.from_text) == (
        "ratio", "task", 0.5, "float", float_from_text)
    assert (count.default, count.flag_kind, count.from_text) == (None, "int", int_from_text)
    assert count.restart == "fixed"
    assert (size.flag_kind, size.from_text("2G")) == ("str", "2G")  # the kind wins over the annotation
    assert (switch.default, switch.flag_kind, switch.from_text) == (True, "bool", bool_from_text)
    assert tags.default == {} and name.default is None
    assert ratio.override == "ratio" and Probe(name="x").ratio == 0.5


def test_no_two_keys_share_a_flag_an_override_an_environment_variable_or_an_sdk_property() -> None:
    flags = [flag for spec in KEYS.values() if spec.flag for flag in spec.flag.split("/")]
    assert len(flags) == len(set(flags)) and "--config" not in flags
    overrides = [spec.override for spec in KEYS.values() if spec.flag]
    assert len(overrides) == len(set(overrides)) and set(OVERRIDE_KEYS) == {"config", *overrides}
    env = [name for spec in KEYS.values() for name in spec.env]
    assert len(env) == len(set(env))
    props = [spec.worker_prop for spec in KEYS.values() if spec.worker_prop]
    assert len(props) == len(set(props))


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@pytest.mark.parametrize("spec", [s for s in KEYS.values() if s.env or s.worker_prop], ids=lambda s: s.name)
def test_every_environment_spelling_reads_its_key_as_declared(spec: KeySpec) -> None:
    sample = spec.example if spec.example is not None else spec.default
    if spec.name == "url":
        sample = "http://127.0.0.1:1/api"
    if sample == "":  # an empty variable counts as unset
        sample = "d1"
    assert sample is not None, f"{spec.name}: read from the environment, so declare an example"
    names = spec.env or (f"CONDUCTOR_WORKER_T_{spec.worker_prop.upper()}",)  # type: ignore[union-attr]
    environ = {names[0]: _text(sample)}
    if spec.name in ("auth_key", "auth_secret"):  # the key needs its secret
        environ = {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET": "s"} | environ
    if spec.name == "auth_secret_file":  # ... or the file of it (a secret set too would win)
        environ |= {"CONDUCTOR_AUTH_KEY": "k"}
    config = resolve(None, environ, {"task_type": "t", "command": ["true"]}, cwd="/", hostname="h")
    settings = {"server": config.server, "runner": config.runner, "task": config.tasks[0]}[spec.scope]
    assert settings.sources[spec.name].layer == "env", spec.name
    assert getattr(settings, spec.name) == spec.check(spec.from_text(_text(sample)))


def test_restart_only_keys_are_the_declared_ones() -> None:
    for scope in SCOPES:
        declared = {spec.name for spec in keys_of(scope) if spec.restart}
        assert set(RESTART_ONLY[scope]) == declared
    assert RESTART_ONLY["task"]["worker_id"] == KEYS["worker_id"].restart


def _help(*command: str) -> str:
    _register()
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return "".join(result.output.split())


def test_run_config_and_worker_stdio_take_every_declared_flag_with_its_metavar() -> None:
    pages = {"run": _help("run"), "config": _help("config"), "worker stdio": _help("worker", "stdio")}
    for spec in CLI_KEYS:
        assert spec.flag is not None
        shown = spec.flag if spec.flag_kind == "bool" else f"{spec.flag}{spec.metavar}"
        for command, page in pages.items():
            if command == "worker stdio" and spec.override in REPLACED:
                continue
            assert shown in page, (command, spec.name)
            assert "".join(spec.help.split())[1:40] in page or spec.flag_help, (command, spec.name)


def test_the_starter_file_shows_every_file_key_with_its_help_and_example() -> None:
    text = starter_text()
    for spec in KEYS.values():
        if spec.in_file and spec.in_worker:
            assert f"# {spec.name}: {spec.help}.\n" in text, spec.name
        if spec.example is not None and spec.in_worker:
            assert f"# {spec.name} = " in text, spec.name


def test_the_checked_in_reference_is_the_generated_one() -> None:
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert reference.render(page) == page, "regenerate: python -m cli.reference"
    for spec in KEYS.values():
        assert f"\n| `{spec.name}`" in page, spec.name
    assert "restart: " + KEYS["state_dir"].restart in page  # type: ignore[operator]


def test_the_reference_changes_when_a_declaration_does(monkeypatch: pytest.MonkeyPatch) -> None:
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    changed = {**KEYS, "kill_grace": KeySpec(**{**KEYS["kill_grace"].__dict__, "default": 3.0})}
    monkeypatch.setattr(reference, "KEYS", changed)
    monkeypatch.setattr(reference, "keys_of", lambda scope: [s for s in changed.values() if s.scope == scope])
    rendered = reference.render(page)
    assert "| `kill_grace` | `3` s |" in rendered and "| `kill_grace` | `10` s |" in page


def test_task_settings_defaults_are_the_declared_ones() -> None:
    task = TaskSettings(type="t")
    for spec in keys_of("task"):
        if spec.name != "type":
            assert getattr(task, spec.name) == spec.default, spec.name


@pytest.mark.parametrize("spec", [s for s in KEYS.values() if s.path], ids=lambda s: s.name)
def test_every_key_declared_a_path_is_relative_to_the_file_that_gave_it(spec: KeySpec) -> None:
    section = {"server": "[server]\n", "runner": "[worker]\n", "task": ""}[spec.scope]
    extra = 'auth_key = "k"\n' if spec.name == "auth_secret_file" else ""
    task = '[[task]]\ntype = "t"\ncommand = ["x"]\n'
    line = f'{spec.name} = "rel"\n'
    text = task + line if spec.scope == "task" else section + line + extra + task
    config = resolve(parse_toml(text, "conf/c.toml"), {"HOME": "/home/u"}, {}, cwd="/w", hostname="h")
    settings = {"server": config.server, "runner": config.runner, "task": config.tasks[0]}[spec.scope]
    assert getattr(settings, spec.name) == "/w/conf/rel"


@pytest.mark.parametrize("spec", [s for s in KEYS.values() if s.combined], ids=lambda s: s.name)
def test_every_key_declared_combined_takes_worker_and_task_together(spec: KeySpec) -> None:
    table = isinstance(spec.default, dict)
    low, high = ('{ A = "1", B = "1" }', '{ B = "2" }') if table else ('["A", "B"]', '["B"]')
    text = f'[worker]\n{spec.name} = {low}\n[[task]]\ntype = "t"\ncommand = ["x"]\n{spec.name} = {high}\n'
    value = getattr(resolve(parse_toml(text, "c.toml"), {}, {}, cwd="/", hostname="h").tasks[0], spec.name)
    assert value == ({"A": "1", "B": "2"} if table else ("A", "B"))
