"""``conductor-run init`` and ``conductor-run config`` through the real typer app."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from cli import exitcodes
from cli.init import starter_text
from cli.main import _register, app
from leasecore.config.keys import KEYS
from leasecore.config.loader import load_config, load_file, parse_toml, resolve

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _commands() -> None:
    _register()


def _invoke(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, env=env)


def _json(args: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    result = _invoke([*args, "--json"], env)
    assert result.exit_code == 0, result.output
    data: dict[str, Any] = json.loads(result.output)
    return data


# --- init --------------------------------------------------------------------------------------------


def test_init_writes_a_file_that_loads_cleanly(tmp_path: Path) -> None:
    target = tmp_path / "conductor.toml"
    result = _invoke(["init", str(target)])
    assert result.exit_code == 0, result.output
    script = tmp_path / "my_task.sh"  # the starter's command; `run` checks that it exists
    script.write_text("#!/bin/sh\n", encoding="utf-8")
    script.chmod(0o755)
    config = load_config({"config": str(target)}, {}, str(tmp_path), hostname="h")
    assert [task.type for task in config.tasks] == ["my_task"]
    assert config.warnings == ()


def test_init_defaults_to_conductor_toml_in_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert _invoke(["init"]).exit_code == 0
    assert (tmp_path / "conductor.toml").read_text(encoding="utf-8") == starter_text()


def test_init_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    target = tmp_path / "conductor.toml"
    target.write_text("# mine\n", encoding="utf-8")
    result = _invoke(["init", str(target)])
    assert result.exit_code == exitcodes.USAGE
    assert "already exists; use --force" in result.output
    assert target.read_text(encoding="utf-8") == "# mine\n"
    assert _invoke(["init", "--force", str(target)]).exit_code == 0
    assert target.read_text(encoding="utf-8") == starter_text()


def test_init_into_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    result = _invoke(["init", str(tmp_path / "nope" / "conductor.toml")])
    assert result.exit_code == exitcodes.USAGE
    assert "cannot write" in result.output
    assert "Traceback" not in result.output


def test_example_file_is_the_starter_text_and_lists_every_key() -> None:
    example = (REPO / "conductor.toml.example").read_text(encoding="utf-8")
    assert example == starter_text(), "regenerate: python -c 'from cli.init import starter_text; ...'"
    for spec in KEYS.values():
        if spec.in_file:
            assert f"{spec.name} = " in example, spec.name
        for name in spec.env:
            assert name in example


def test_example_file_loads_cleanly() -> None:
    loaded = load_file("conductor.toml.example", cwd=str(REPO))
    assert loaded.data["task"][0]["type"] == "my_task"


def test_every_commented_line_of_the_example_loads_when_uncommented() -> None:
    # Uncommenting any "# key = value" line must give a valid file: every shown value is allowed.
    text = re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", starter_text())
    resolved = resolve(parse_toml(text, "c.toml"), {}, {}, cwd="/", hostname="h")
    assert resolved.tasks[0].terminal_exit_codes == (2,)
    assert resolved.tasks[0].secrets == ("DATABASE_PASSWORD",)
    assert resolved.runner.state_dir is not None


# --- config ------------------------------------------------------------------------------------------

FILE = """\
[server]
url = "http://user:pw@conductor.example:8080/api"

[worker]
kill_grace = 3
secrets = ["DB_PASSWORD"]

[[task]]
type = "encode"
command = ["./encode.sh"]
env = { DB_PASSWORD = "hunter2", LANG = "C" }

[[task]]
type = "resize"
shell = "convert in.png out.png"
"""


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "conductor.toml").write_text(FILE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_config_finds_conductor_toml_and_shows_each_source(project: Path) -> None:
    view = _json(["config"], env={"CONDUCTOR_WORKER_ENCODE_KILL_GRACE": "5"})
    assert view["config_file"] == "conductor.toml"
    encode, resize = view["tasks"]
    assert encode["settings"]["kill_grace"] == {
        "value": 5.0,
        "source": "env CONDUCTOR_WORKER_ENCODE_KILL_GRACE (task-specific)",
    }
    assert resize["settings"]["kill_grace"] == {"value": 3.0, "source": "conductor.toml:5 [worker]"}
    assert resize["settings"]["shell"]["source"] == "conductor.toml:15 [[task]] 'resize'"
    assert "command" not in resize["settings"]


def test_config_masks_secrets(project: Path) -> None:
    env = {"CONDUCTOR_AUTH_KEY": "key-id-1", "CONDUCTOR_AUTH_SECRET": "s3cr3t-value"}
    for args in (["config"], ["config", "--json"]):
        result = _invoke(args, env)
        assert result.exit_code == 0, result.output
        for secret in ("s3cr3t-value", "key-id-1", "hunter2", ":pw@"):
            assert secret not in result.output
    view = _json(["config"], env)
    assert view["server"]["auth_secret"] == {"value": "****", "source": "env CONDUCTOR_AUTH_SECRET"}
    assert view["tasks"][0]["settings"]["env"]["value"] == {"DB_PASSWORD": "****", "LANG": "C"}
    assert view["server"]["url"]["value"] == "http://user:****@conductor.example:8080/api"


def test_config_task_type_selects_one_task(project: Path) -> None:
    view = _json(["config", "--task-type", "resize"])
    assert [task["type"] for task in view["tasks"]] == ["resize"]


def test_config_file_from_the_environment_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "other.toml").write_text(FILE, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    view = _json(["config"], env={"CONDUCTOR_RUN_CONFIG": "other.toml"})
    assert view["config_file"] == "other.toml"


def test_config_without_any_file_shows_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    view = _json(["config"])
    assert view["config_file"] is None
    assert view["tasks"] == []
    assert view["server"]["url"] == {"value": "http://localhost:8080/api", "source": "default"}
    text = _invoke(["config"])
    assert text.exit_code == 0
    assert "no task configured" in text.output


def test_config_text_output_names_values_and_sources(project: Path) -> None:
    result = CliRunner().invoke(app, ["config"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "task encode" in result.output
    assert "conductor.toml:5 [worker]" in result.output
    assert "default (hostname)" in result.output


@pytest.mark.parametrize(
    ("file_text", "env", "expected"),
    [
        ("[worker]\nkill_grace = -1\n", {}, "invalid kill_grace = -1 (from conductor.toml:2 [worker])"),
        ("[worker]\nkill_gace = 1\n", {}, "did you mean kill_grace?"),
        ("[worker\n", {}, "not valid TOML"),
        ("", {"CONDUCTOR_WORKER_ALL_PAUSED": "maybe"}, "CONDUCTOR_WORKER_ALL_PAUSED"),
    ],
)
def test_invalid_config_exits_3_with_one_line_and_no_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file_text: str, env: dict[str, str], expected: str
) -> None:
    (tmp_path / "conductor.toml").write_text(file_text + '[[task]]\ntype = "t"\nshell = "true"\n', "utf-8")
    monkeypatch.chdir(tmp_path)
    result = _invoke(["config"], env)
    assert result.exit_code == exitcodes.CONFIG
    assert expected in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)


def test_missing_config_file_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = _invoke(["config", "--config", "absent.toml"])
    assert result.exit_code == exitcodes.CONFIG
    assert "absent.toml (from --config) not found" in result.output


# --- config takes run's options: what a run with the same flags would use -----------------------------


def test_config_takes_every_option_of_run() -> None:
    import typer.main

    group = typer.main.get_command(app)
    run_cmd, config_cmd = (group.commands[name] for name in ("run", "config"))  # type: ignore[attr-defined]
    options_of = {name: {opt for param in cmd.params for opt in (*param.opts, *param.secondary_opts)}
                  for name, cmd in (("run", run_cmd), ("config", config_cmd))}
    assert options_of["run"] <= options_of["config"], options_of["run"] - options_of["config"]


def test_config_shows_a_flags_only_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: exit 2, "No such option: --shell" (and a "has no command" error without it).
    monkeypatch.chdir(tmp_path)
    view = _json(["config", "--task-type", "x", "--shell", "true"])
    (task,) = view["tasks"]
    assert task["type"] == "x"
    assert task["settings"]["shell"] == {"value": "true", "source": "flag --shell"}
    assert view["warnings"] == []
    text = CliRunner().invoke(app, ["config", "--task-type", "x", "--shell", "true"], env={"COLUMNS": "200"})
    assert text.exit_code == 0, text.output
    assert "flag --shell" in text.output
    result = _invoke(["config", "--json", "--server", "http://conductor.example:8080", "--task-type", "x",
                      "--once", "--", "true", "--fast"])
    assert result.exit_code == 0, result.output
    view = json.loads(result.output)
    assert view["server"]["url"] == {"value": "http://conductor.example:8080/api", "source": "flag --server"}
    assert view["runner"]["once"] == {"value": True, "source": "flag --once"}
    assert view["tasks"][0]["settings"]["command"] == {"value": ["true", "--fast"], "source": "flag --"}


def test_config_shows_a_flag_value_with_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    view = _json(["config", "--task-type", "x", "--kill-grace", "5", "--terminal-exit-code", "3",
                  "--no-lease-extend", "--log-format", "json"])
    settings = view["tasks"][0]["settings"]
    assert settings["kill_grace"] == {"value": 5.0, "source": "flag --kill-grace"}
    assert settings["terminal_exit_codes"] == {"value": [3], "source": "flag --terminal-exit-code"}
    assert settings["lease_extend_enabled"]["value"] is False
    assert view["runner"]["log_format"] == {"value": "json", "source": "flag --log-format"}


def test_a_config_flag_beats_the_environment_and_the_file(project: Path) -> None:
    env = {"CONDUCTOR_WORKER_RESIZE_KILL_GRACE": "5"}
    view = _json(["config", "--task-type", "resize", "--kill-grace", "7", "--shell", "true"], env)
    settings = view["tasks"][0]["settings"]
    assert settings["kill_grace"] == {"value": 7.0, "source": "flag --kill-grace"}
    assert settings["shell"] == {"value": "true", "source": "flag --shell"}  # not the file's
    without_flag = _json(["config", "--task-type", "resize"], env)["tasks"][0]["settings"]
    assert without_flag["kill_grace"]["source"] == "env CONDUCTOR_WORKER_RESIZE_KILL_GRACE (task-specific)"


def test_config_shows_a_task_without_a_command_with_a_warning(tmp_path: Path) -> None:
    # run refuses it (exit 3); config shows the rest and says what run would refuse, as it does for a
    # command that cannot start. Before: config refused it too, showing nothing.
    (tmp_path / "c.toml").write_text('[[task]]\ntype = "y"\nkill_grace = 5\n', encoding="utf-8")
    for args in (["--config", str(tmp_path / "c.toml")], ["--task-type", "x", "--kill-grace", "5"]):
        view = _json(["config", *args])
        (task,) = view["tasks"]
        assert "command" not in task["settings"] and "shell" not in task["settings"]
        assert task["settings"]["kill_grace"]["value"] == 5.0
        (warning,) = view["warnings"]
        assert f"task {task['type']!r} has no command" in warning
        result = _invoke(["run", *args])
        assert result.exit_code == exitcodes.CONFIG
        assert "has no command" in result.output


def test_config_shows_the_kill_grace_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # R comes with each task, so without a heartbeat_timeout the cap is shown as its rule; with one
    # (an upper bound of every lease) as a number, saying whether the configured grace is cut.
    monkeypatch.chdir(tmp_path)
    cap = _json(["config", "--task-type", "x", "--shell", "true"])["tasks"][0]["settings"]["kill_grace_cap"]
    assert cap["source"] == "derived" and "0.25 x the task's lease" in cap["value"]
    view = _json(["config", "--task-type", "x", "--shell", "true", "--heartbeat-timeout", "8"])
    assert view["tasks"][0]["settings"]["kill_grace_cap"]["value"].startswith("at most 2s (capped:")
    view = _json(["config", "--task-type", "x", "--shell", "true", "--heartbeat-timeout", "60",
                  "--kill-grace", "5"])  # fmt: skip
    assert view["tasks"][0]["settings"]["kill_grace_cap"]["value"].startswith("at most 5s (not capped:")
