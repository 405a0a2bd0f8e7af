"""The pure config merge: precedence, env spellings, validation messages, provenance.

No test here touches os.environ or the file system: files are TOML text, environments are dicts.
"""

from __future__ import annotations

from typing import Any

import pytest

from leasecore.config import merge
from leasecore.config.keys import KEYS
from leasecore.config.loader import OVERRIDE_KEYS, ResolvedConfig, TaskSettings, parse_toml, resolve
from leasecore.errors import ConfigError

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


def _resolve(
    text: str | None = BASE,
    environ: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ResolvedConfig:
    loaded = parse_toml(text, "conductor.toml") if text is not None else None
    return resolve(loaded, environ or {}, overrides or {}, cwd="/work", hostname="host-1", **kwargs)


def _task(*args: Any, **kwargs: Any) -> TaskSettings:
    config = _resolve(*args, **kwargs)
    assert len(config.tasks) == 1
    return config.tasks[0]


def _error(*args: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _resolve(*args, **kwargs)
    return str(info.value)


# --- precedence: one row per adjacent pair of layers -------------------------------------------------

WORKER = "[worker]\nkill_grace = 3\n"
TASK = BASE + "kill_grace = 4\n"
GLOBAL_ENV = {"CONDUCTOR_WORKER_ALL_KILL_GRACE": "5"}
TASK_ENV = {"CONDUCTOR_WORKER_ENCODE_KILL_GRACE": "6"}


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "value", "source"),
    [
        pytest.param(BASE, {}, {}, 10.0, "default", id="default"),
        pytest.param(WORKER + BASE, {}, {}, 3.0, "conductor.toml:2 [worker]", id="worker>default"),
        pytest.param(WORKER + TASK, {}, {}, 4.0, "conductor.toml:6 [[task]] 'encode'", id="task>worker"),
        pytest.param(
            WORKER + TASK,
            GLOBAL_ENV,
            {},
            5.0,
            "env CONDUCTOR_WORKER_ALL_KILL_GRACE (global)",
            id="global-env>task",
        ),
        pytest.param(
            WORKER + TASK,
            {**GLOBAL_ENV, **TASK_ENV},
            {},
            6.0,
            "env CONDUCTOR_WORKER_ENCODE_KILL_GRACE (task-specific)",
            id="task-env>global-env",
        ),
        pytest.param(
            WORKER + TASK,
            {**GLOBAL_ENV, **TASK_ENV},
            {"kill_grace": 7},
            7.0,
            "flag --kill-grace",
            id="flag>task-env",
        ),
    ],
)
def test_each_layer_beats_the_one_below(
    text: str, environ: dict[str, str], overrides: dict[str, Any], value: float, source: str
) -> None:
    task = _task(text, environ, overrides)
    assert task.kill_grace == value
    assert str(task.sources["kill_grace"]) == source


def test_the_merge_follows_the_precedence_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order is data (``merge.PRECEDENCE``), read by the merge, not written into its code: the
    table reversed, [worker] beats every other layer, and the source says so."""
    everything = (WORKER + TASK, {**GLOBAL_ENV, **TASK_ENV}, {"kill_grace": 7})
    assert _task(*everything).kill_grace == 7.0
    monkeypatch.setitem(merge.PRECEDENCE, "task", tuple(reversed(merge.PRECEDENCE["task"])))
    task = _task(*everything)
    assert task.kill_grace == 3.0
    assert str(task.sources["kill_grace"]) == "conductor.toml:2 [worker]"


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "value", "layer"),
    [
        ("", {}, {}, "http://localhost:8080/api", "default"),
        ('[server]\nurl = "http://file:1/api"\n', {}, {}, "http://file:1/api", "file"),
        (
            '[server]\nurl = "http://file:1/api"\n',
            {"CONDUCTOR_SERVER_URL": "http://env:2/api"},
            {},
            "http://env:2/api",
            "env",
        ),
        (
            '[server]\nurl = "http://file:1/api"\n',
            {"CONDUCTOR_SERVER_URL": "http://env:2/api"},
            {"server": "http://flag:3/api"},
            "http://flag:3/api",
            "flag",
        ),
    ],
)
def test_server_url_precedence(
    text: str, environ: dict[str, str], overrides: dict[str, Any], value: str, layer: str
) -> None:
    server = _resolve(text + BASE, environ, overrides).server
    assert server.url == value
    assert server.sources["url"].layer == layer


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "value", "layer"),
    [
        ("", {}, {}, None, "default"),
        ('[worker]\nstate_dir = "/f"\n', {}, {}, "/f", "file"),
        ('[worker]\nstate_dir = "/f"\n', {"CONDUCTOR_RUN_STATE_DIR": "/e"}, {}, "/e", "env"),
        (
            '[worker]\nstate_dir = "/f"\n',
            {"CONDUCTOR_RUN_STATE_DIR": "/e"},
            {"state_dir": "/c"},
            "/c",
            "flag",
        ),
    ],
)
def test_runner_setting_precedence(
    text: str, environ: dict[str, str], overrides: dict[str, Any], value: str | None, layer: str
) -> None:
    runner = _resolve(text + BASE, environ, overrides).runner
    assert runner.state_dir == value
    assert runner.sources["state_dir"].layer == layer


# --- one row per key type ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "overrides", "text", "key", "value"),
    [
        ({"CONDUCTOR_WORKER_ALL_LEASE_EXTEND_ENABLED": "off"}, {}, "", "lease_extend_enabled", False),
        ({}, {"lease_extend_enabled": False}, "", "lease_extend_enabled", False),
        ({"CONDUCTOR_WORKER_ALL_THREAD_COUNT": "4"}, {}, "", "concurrency", 4),
        ({}, {}, "thread_count = 3\n", "concurrency", 3),
        ({"CONDUCTOR_WORKER_ALL_EXEC_TIMEOUT": "1.5"}, {}, "", "exec_timeout", 1.5),
        ({}, {}, "heartbeat_timeout = 30\n", "heartbeat_timeout", 30.0),
        ({"CONDUCTOR_WORKER_ALL_DOMAIN": "gpu"}, {}, "", "domain", "gpu"),
        ({}, {}, 'domain = ""\n', "domain", None),
        ({"CONDUCTOR_WORKER_ALL_WORKER_ID": "w9"}, {}, "", "worker_id", "w9"),
        ({"CONDUCTOR_WORKER_ALL_POLL_TIMEOUT": "250"}, {}, "", "poll_timeout", 250),
        ({"CONDUCTOR_WORKER_ALL_POLL_INTERVAL": "50"}, {}, "", "poll_interval", 50),
        ({"CONDUCTOR_WORKER_ALL_PAUSED": "yes"}, {}, "", "paused", True),
        ({}, {"terminal_exit_codes": [7, 3, 7]}, "", "terminal_exit_codes", (3, 7)),
        ({}, {}, "in_progress_exit_code = 75\ncallback_after_seconds = 30\n", "in_progress_exit_code", 75),
        ({}, {}, "ownership_check_interval = 2.5\n", "ownership_check_interval", 2.5),
        ({}, {}, 'env = { LANG = "C" }\n', "env", {"LANG": "C"}),
        ({}, {}, 'secrets = ["TOKEN"]\n', "secrets", ("TOKEN",)),
        ({}, {}, "", "worker_id", "host-1"),
    ],
)
def test_every_key_type_is_parsed(
    environ: dict[str, str], overrides: dict[str, Any], text: str, key: str, value: Any
) -> None:
    assert getattr(_task(BASE + text, environ, overrides), key) == value


def test_runner_key_types() -> None:
    environ = {
        "CONDUCTOR_RUN_DRAIN": "1",
        "CONDUCTOR_RUN_DRAIN_TIMEOUT": "30",
        "CONDUCTOR_RUN_LOG_FORMAT": "json",
    }
    runner = _resolve(BASE, environ, {"once": True, "max_tasks": 3, "once_wait": 2}).runner
    assert (runner.drain, runner.drain_timeout, runner.log_format) == (True, 30.0, "json")
    assert (runner.once, runner.max_tasks, runner.once_wait) == (True, 3, 2.0)
    assert _resolve(BASE, {}, {}).runner.once_wait == 30.0


def test_update_v2_is_on_unless_turned_off_in_the_file_or_the_environment() -> None:
    # Final updates may claim the next task; [worker] update_v2 = false or CONDUCTOR_RUN_UPDATE_V2
    assert _resolve(BASE).runner.update_v2 is True
    runner = _resolve("[worker]\nupdate_v2 = false\n" + BASE).runner
    assert runner.update_v2 is False and runner.sources["update_v2"].layer == "file"
    runner = _resolve(BASE, {"CONDUCTOR_RUN_UPDATE_V2": "no"}).runner
    assert runner.update_v2 is False and "CONDUCTOR_RUN_UPDATE_V2" in str(runner.sources["update_v2"])
    message = _error(BASE, {"CONDUCTOR_RUN_UPDATE_V2": "maybe"})
    assert "update_v2" in message and "CONDUCTOR_RUN_UPDATE_V2" in message


# --- environment spellings ---------------------------------------------------------------------------

TASK_SPELLINGS = [
    "conductor.worker.encode.domain",
    "conductor_worker_encode_domain",
    "CONDUCTOR_WORKER_ENCODE_DOMAIN",
]
GLOBAL_SPELLINGS = [
    "conductor.worker.all.domain",
    "conductor_worker_all_domain",
    "CONDUCTOR_WORKER_ALL_DOMAIN",
]


@pytest.mark.parametrize("name", TASK_SPELLINGS + GLOBAL_SPELLINGS)
def test_every_sdk_spelling_is_read(name: str) -> None:
    task = _task(BASE, {name: "blue"})
    assert task.domain == "blue"
    assert str(task.sources["domain"]).startswith(f"env {name} ")


def test_task_name_as_written_with_upper_property_is_read() -> None:
    text = '[[task]]\ntype = "Encode-Video"\nshell = "true"\n'
    task = _task(text, {"CONDUCTOR_WORKER_Encode-Video_DOMAIN": "x"})
    assert task.domain == "x"


@pytest.mark.parametrize("spellings", [TASK_SPELLINGS, GLOBAL_SPELLINGS])
def test_within_one_level_the_documented_order_wins_and_the_source_says_so(spellings: list[str]) -> None:
    for winner_index, winner in enumerate(spellings):
        environ = {name: f"v{i}" for i, name in enumerate(spellings) if i >= winner_index}
        task = _task(BASE, environ)
        assert task.domain == f"v{winner_index}"
        losers = spellings[winner_index + 1 :]
        assert str(task.sources["domain"]).startswith(f"env {winner}")
        for loser in losers:
            assert loser in str(task.sources["domain"])  # "won over <loser>"


def test_agreeing_spellings_are_not_reported_as_a_conflict() -> None:
    task = _task(BASE, {"CONDUCTOR_WORKER_ALL_DOMAIN": "x", "conductor_worker_all_domain": "x"})
    assert "won over" not in str(task.sources["domain"])


def test_other_tasks_variables_do_not_leak() -> None:
    assert _task(BASE, {"CONDUCTOR_WORKER_RESIZE_DOMAIN": "x"}).domain is None


def test_empty_variable_counts_as_unset() -> None:
    task = _task(BASE, {"CONDUCTOR_WORKER_ENCODE_DOMAIN": "", "CONDUCTOR_WORKER_ALL_DOMAIN": "g"})
    assert task.domain == "g"


@pytest.mark.parametrize(
    ("word", "value"),
    [(w, True) for w in ("true", "1", "YES", "on")] + [(w, False) for w in ("false", "0", "no", "Off")],
)
def test_boolean_words(word: str, value: bool) -> None:
    assert _task(BASE, {"CONDUCTOR_WORKER_ALL_PAUSED": word}).paused is value


def test_unknown_boolean_word_is_an_error_unlike_the_sdks() -> None:
    message = _error(BASE, {"conductor.worker.encode.lease_extend_enabled": "ture"})
    assert "lease_extend_enabled" in message
    assert "conductor.worker.encode.lease_extend_enabled" in message
    assert "true/1/yes/on or false/0/no/off" in message


# --- bad values name key and source ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "expected"),
    [
        (BASE + "kill_grace = -1\n", {}, {}, ["kill_grace", "conductor.toml:4 [[task]] 'encode'", ">= 0"]),
        (
            "[worker]\nconcurrency = 0\n" + BASE,
            {},
            {},
            ["concurrency", "conductor.toml:2 [worker]", "1 to 1000"],
        ),
        (BASE + "poll_timeout = 6000\n", {}, {}, ["poll_timeout", "conductor.toml:4", "0 to 5000"]),
        (BASE + 'paused = "yes"\n', {}, {}, ["paused", "conductor.toml:4", "true or false"]),
        (
            BASE + "terminal_exit_codes = [0]\n",
            {},
            {},
            ["terminal_exit_codes", "conductor.toml:4", "1 to 255"],
        ),
        (BASE + "concurrency = true\n", {}, {}, ["concurrency", "conductor.toml:4", "integer"]),
        (BASE + "env = { A = 1 }\n", {}, {}, ["env", "conductor.toml:4", "table"]),
        (
            BASE,
            {"CONDUCTOR_WORKER_ALL_THREAD_COUNT": "two"},
            {},
            ["concurrency", "CONDUCTOR_WORKER_ALL_THREAD_COUNT"],
        ),
        (BASE, {"CONDUCTOR_WORKER_ENCODE_HEARTBEAT_TIMEOUT": "0"}, {}, ["heartbeat_timeout", "> 0"]),
        (BASE, {"CONDUCTOR_RUN_LOG_FORMAT": "xml"}, {}, ["log_format", "CONDUCTOR_RUN_LOG_FORMAT", "'json'"]),
        (BASE, {"CONDUCTOR_SERVER_URL": "localhost:8080"}, {}, ["url", "CONDUCTOR_SERVER_URL", "http://"]),
        (BASE, {}, {"kill_grace": -2.0}, ["kill_grace", "flag --kill-grace"]),
        (BASE, {}, {"poll_timeout": 9000}, ["poll_timeout", "flag --poll-timeout", "5000"]),
        (BASE, {}, {"terminal_exit_codes": [300]}, ["terminal_exit_codes", "flag --terminal-exit-code"]),
        (BASE, {}, {"max_tasks": 0}, ["max_tasks", "flag --max-tasks"]),
        (BASE, {}, {"once_wait": 0.0}, ["once_wait", "flag --once-wait", "> 0"]),
    ],
)
def test_bad_values_name_key_source_and_what_is_allowed(
    text: str, environ: dict[str, str], overrides: dict[str, Any], expected: list[str]
) -> None:
    message = _error(text, environ, overrides)
    for part in expected:
        assert part in message


def test_error_carries_key_and_source_attributes() -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(BASE, {"CONDUCTOR_WORKER_ALL_KILL_GRACE": "soon"})
    assert info.value.key == "kill_grace"
    assert info.value.source == "env CONDUCTOR_WORKER_ALL_KILL_GRACE (global)"


def test_a_bad_file_value_is_an_error_even_when_a_flag_overrides_it() -> None:
    assert "kill_grace" in _error(BASE + "kill_grace = -1\n", {}, {"kill_grace": 1})


def test_secret_values_are_never_echoed_in_errors() -> None:
    message = _error('[server]\nauth_key = "k"\nauth_secret = ""\n' + BASE)
    assert "auth_secret" in message
    assert "'k'" not in message


# --- unknown keys and structure ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[worker]\nkill_gace = 3\n" + BASE, ["conductor.toml:2", "'kill_gace'", "did you mean kill_grace?"]),
        (BASE + "comand = []\n", ["conductor.toml:4", "'comand'", "did you mean command?"]),
        ("[server]\nurll = 'x'\n" + BASE, ["'urll'", "did you mean url?"]),
        ("servr = 1\n" + BASE, ["conductor.toml:1", "top level", "did you mean server?"]),
        ("[worker]\nurl = 'http://x'\n" + BASE, ["'url'", "belongs in [server]"]),
        (BASE + "state_dir = '/x'\n", ["'state_dir'", "belongs in [worker]"]),
        ("[worker]\ntype = 'x'\n" + BASE, ["'type'", "belongs in [[task]]"]),
        (BASE + "once = true\n", ["'once'", "command-line flag only (--once)"]),
        ("[task]\ntype = 'x'\n", ["[[task]] tables"]),
        ("[[task]]\ncommand = ['x']\n", ["conductor.toml:1", "has no type"]),
        (BASE + BASE, ["conductor.toml:5", "declared twice", "conductor.toml:2"]),
        (BASE + "thread_count = 2\nconcurrency = 3\n", ["same setting"]),
        ("[[task]]\ntype = 'x'\ncommand = ['a']\nshell = 'b'\n", ["not both"]),
        ("[[task]]\ntype = 'x'\n", ["has no command"]),
        ("[[task]]\ntype = 'x'\ncommand = 'ls -l'\n", ["command", "shell = "]),
    ],
)
def test_structure_errors(text: str, expected: list[str]) -> None:
    message = _error(text)
    for part in expected:
        assert part in message


def test_toml_syntax_error_names_the_file_and_line() -> None:
    with pytest.raises(ConfigError) as info:
        parse_toml("[worker]\nkill_grace = = 3\n", "conductor.toml")
    assert "conductor.toml" in str(info.value)
    assert "line 2" in str(info.value)


def test_line_numbers_survive_multiline_values() -> None:
    text = (
        '[[task]]\ntype = "a"\ncommand = [\n  "x",\n  "kill_grace = 9",\n]\n'
        'shell_note = """\nexec_timeout = 1\n"""\n'
    )
    loaded = parse_toml(text, "c.toml")
    assert loaded.lines[("task", 0, "command")] == 3
    assert ("task", 0, "kill_grace") not in loaded.lines
    assert ("task", 0, "exec_timeout") not in loaded.lines
    assert loaded.lines[("task", 0, "shell_note")] == 7


def test_line_numbers_of_subtables_and_dotted_keys() -> None:
    text = BASE + "env.A = 'x'\n[[task]]\ntype = 'b'\nshell = 'x'\n[task.env]\nB = 'y'\n"
    loaded = parse_toml(text, "c.toml")
    assert loaded.lines[("task", 0, "env")] == 4
    assert loaded.lines[("task", 1, "env")] == 8
    assert ("task", 1, "B") not in loaded.lines


# --- which tasks run ---------------------------------------------------------------------------------

TWO = BASE + '[[task]]\ntype = "resize"\nshell = "convert"\n'


def test_every_file_task_runs_without_task_type() -> None:
    assert [task.type for task in _resolve(TWO).tasks] == ["encode", "resize"]


def test_task_type_selects_one_file_task_and_flags_apply() -> None:
    task = _task(TWO, {}, {"task_type": "resize", "concurrency": 2})
    assert (task.type, task.shell, task.concurrency) == ("resize", "convert", 2)


def test_task_type_not_in_the_file_needs_a_command() -> None:
    message = _error(TWO, {}, {"task_type": "other"})
    assert "task type 'other' (from flag --task-type) is not declared in conductor.toml" in message
    assert "'encode', 'resize'" in message  # what the file does declare
    assert "give a command after -- or with --shell" in message
    task = _task(TWO, {}, {"task_type": "other", "command": ["./other"]})
    assert (task.command, str(task.sources["command"])) == (("./other",), "flag --")


def test_flags_and_env_alone_suffice() -> None:
    task = _task(None, {"CONDUCTOR_WORKER_ALL_THREAD_COUNT": "2"}, {"task_type": "t", "shell": "echo hi"})
    assert (task.type, task.shell, task.command, task.concurrency) == ("t", "echo hi", None, 2)


def test_nothing_to_run_is_an_error_unless_allowed() -> None:
    assert "no task to run" in _error(None)
    assert _resolve(None, require_task=False).tasks == ()


def test_command_flag_needs_task_type_when_the_file_has_several_tasks() -> None:
    assert "needs --task-type" in _error(TWO, {}, {"command": ["x"]})


def test_shell_flag_replaces_the_file_command() -> None:
    task = _task(BASE, {}, {"shell": "echo replaced"})
    assert (task.command, task.shell) == (None, "echo replaced")
    assert str(task.sources["command"]) == "flag --shell"


def test_not_given_flags_are_ignored() -> None:
    overrides = dict.fromkeys(OVERRIDE_KEYS)
    overrides["terminal_exit_codes"] = []
    assert _task(BASE, {}, overrides).sources["kill_grace"].layer == "default"


def test_unknown_override_key_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="unknown override"):
        _resolve(BASE, {}, {"kill_grase": 1})


# --- the rest of the merge ---------------------------------------------------------------------------


def test_env_and_secrets_combine_worker_and_task() -> None:
    text = (
        "[worker]\nenv = { A = '1', B = '1' }\nsecrets = ['S1']\n"
        + BASE
        + "env = { B = '2' }\nsecrets = ['S2']\n"
    )
    task = _task(text)
    assert task.env == {"A": "1", "B": "2"}
    assert task.secrets == ("S1", "S2")
    assert str(task.sources["env"]) == "conductor.toml:2 [worker] + conductor.toml:7 [[task]] 'encode'"


def test_relative_cwd_is_relative_to_the_file() -> None:
    loaded = parse_toml(BASE + "cwd = 'jobs'\n", "conf/conductor.toml")
    assert resolve(loaded, {}, {}, cwd="/work", hostname="h").tasks[0].cwd == "/work/conf/jobs"
    assert _task(BASE).cwd == "/work"


def test_auth_needs_both_halves() -> None:
    message = _error(BASE, {"CONDUCTOR_AUTH_KEY": "k"})
    assert "auth_key is set (from env CONDUCTOR_AUTH_KEY) but auth_secret is not" in message
    server = _resolve(BASE, {"CONDUCTOR_AUTH_KEY": "k", "CONDUCTOR_AUTH_SECRET": "s"}).server
    assert (server.auth_key, server.auth_secret) == ("k", "s")
    assert "'s'" not in repr(server)


def test_credentials_in_the_file_are_allowed_with_a_warning() -> None:
    config = _resolve('[server]\nauth_key = "k"\nauth_secret = "s"\n' + BASE)
    assert config.server.auth_secret == "s"
    assert any("CONDUCTOR_AUTH_SECRET" in warning for warning in config.warnings)


def test_server_url_gets_api_appended() -> None:
    assert (
        _resolve(BASE, {"CONDUCTOR_SERVER_URL": "https://x.example/"}).server.url == "https://x.example/api"
    )


def test_in_progress_code_cannot_also_be_terminal() -> None:
    assert "only one thing" in _error(BASE + "terminal_exit_codes = [75]\nin_progress_exit_code = 75\n")


def test_every_key_has_a_settings_field_and_a_default() -> None:
    task_fields = set(TaskSettings.__dataclass_fields__)
    assert {spec.name for spec in KEYS.values() if spec.scope == "task"} <= task_fields
