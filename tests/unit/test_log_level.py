"""The ``log_level`` option: its merge (default, file, environment, flag), its errors, that a reload may
change it, and how the CLI applies it at start and on a reload (the project's loggers' level)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cli import fastrun
from cli.run import PROJECT_LOGGERS, configure_logging, loader_for
from leasecore.config.keys import KEYS, RESTART_ONLY
from leasecore.config.live import reload_changes
from leasecore.config.loader import ResolvedConfig, load_config, parse_toml, resolve
from leasecore.config.settings import RunnerSettings
from leasecore.errors import ConfigError

BASE = '[[task]]\ntype = "encode"\ncommand = ["./encode.sh"]\n'


def _resolve(text: str = BASE, environ: dict[str, str] | None = None,
             overrides: dict[str, Any] | None = None) -> ResolvedConfig:
    return resolve(parse_toml(text, "conductor.toml"), environ or {}, overrides or {}, cwd="/work",
                   hostname="host-1")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """configure_logging changes the process's loggers: put them back as they were."""
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers),
                    logging.getLogger(name).propagate) for name in PROJECT_LOGGERS}
    yield
    for name, (level, handlers, propagate) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.handlers[:] = handlers
        logger.propagate = propagate


def test_the_declaration_a_worker_key_with_its_env_and_flag_live_on_reload() -> None:
    spec = KEYS["log_level"]
    assert (spec.scope, spec.default, spec.env, spec.flag) == ("runner", "info", ("CONDUCTOR_RUN_LOG_LEVEL",),
                                                               "--log-level")
    assert "log_level" not in RESTART_ONLY["runner"]


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "level", "source"),
    [
        (BASE, {}, {}, "info", "default"),
        ('[worker]\nlog_level = "warning"\n' + BASE, {}, {}, "warning", "conductor.toml:2 [worker]"),
        ('[worker]\nlog_level = "warning"\n' + BASE, {"CONDUCTOR_RUN_LOG_LEVEL": "error"}, {}, "error",
         "CONDUCTOR_RUN_LOG_LEVEL"),
        (BASE, {"CONDUCTOR_RUN_LOG_LEVEL": "error"}, {"log_level": "debug"}, "debug", "flag --log-level"),
    ],
)
def test_the_level_comes_from_the_flag_else_the_environment_else_the_file_else_info(
    text: str, environ: dict[str, str], overrides: dict[str, Any], level: str, source: str
) -> None:
    runner = _resolve(text, environ, overrides).runner
    assert runner.log_level == level
    assert source in str(runner.sources["log_level"])


@pytest.mark.parametrize(
    ("text", "environ", "overrides", "named"),
    [
        ('[worker]\nlog_level = "verbose"\n' + BASE, {}, {}, "conductor.toml:2"),
        ('[worker]\nlog_level = "DEBUG"\n' + BASE, {}, {}, "conductor.toml:2"),  # the values are lower case
        ('[worker]\nlog_level = 10\n' + BASE, {}, {}, "conductor.toml:2"),
        (BASE, {"CONDUCTOR_RUN_LOG_LEVEL": "trace"}, {}, "CONDUCTOR_RUN_LOG_LEVEL"),
        (BASE, {}, {"log_level": "critical"}, "flag --log-level"),
    ],
)
def test_a_bad_level_names_the_key_where_it_came_from_and_every_allowed_value(
    text: str, environ: dict[str, str], overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(text, environ, overrides)
    message = str(info.value)
    assert "log_level" in message and named in message, message
    for allowed in ("'debug'", "'info'", "'warning'", "'error'"):
        assert allowed in message, message


def test_a_task_cannot_set_the_level() -> None:
    with pytest.raises(ConfigError) as info:
        _resolve(BASE + 'log_level = "debug"\n')
    assert "log_level" in str(info.value)


def test_a_reload_may_change_the_level_and_says_so() -> None:
    old = _resolve()
    new = replace(old, runner=replace(old.runner, log_level="debug"))
    changes = reload_changes(old, new)
    assert changes.accepted and changes.changed == ("[worker] log_level: info -> debug",)
    assert reload_changes(old, replace(old, runner=RunnerSettings())).changed == ()


@pytest.mark.parametrize(("flags", "after"), [((), "error"), (("--log-level", "warning"), "warning")])
def test_a_reload_reads_the_file_again_but_a_level_given_by_flag_still_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], after: str
) -> None:
    monkeypatch.chdir(tmp_path)  # a reload loads from the directory the runner runs in
    config = tmp_path / "conductor.toml"
    task = '[[task]]\ntype = "encode"\ncommand = ["true"]\n'
    config.write_text('[worker]\nlog_level = "debug"\n' + task, "utf-8")
    overrides = fastrun.parse(["--config", str(config), *flags])
    started = load_config(overrides, {}, str(tmp_path), hostname="h")
    assert started.runner.log_level == ("warning" if flags else "debug")
    load_again, _ = loader_for(overrides, {}, started, None)
    config.write_text('[worker]\nlog_level = "error"\n' + task, "utf-8")
    again = load_again()
    assert again.runner.log_level == after
    expected = () if flags else ("[worker] log_level: debug -> error",)
    assert reload_changes(started, again).changed == expected


def _levels() -> set[int]:
    return {logging.getLogger(name).level for name in PROJECT_LOGGERS}


def test_configure_logging_sets_every_project_logger_to_the_level() -> None:
    for name, level in (("debug", logging.DEBUG), ("warning", logging.WARNING), ("error", logging.ERROR)):
        configure_logging("text", None, name)
        assert _levels() == {level}
    configure_logging("json")
    assert _levels() == {logging.INFO}  # the default, as before the option existed


def test_a_reload_applies_a_new_level_and_a_new_format_with_the_level(
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = _resolve('[worker]\nlog_level = "warning"\n' + BASE)
    configure_logging("text", None, started.runner.log_level)
    _, on_reloaded = loader_for({"config": None}, {}, started, None)
    log = logging.getLogger("leasecore.runner.loop.task_start")
    log.info("hidden at warning")

    on_reloaded(replace(started, runner=replace(started.runner, log_level="debug")))
    assert _levels() == {logging.DEBUG}
    log.debug("shown at debug")

    on_reloaded(replace(started, runner=replace(started.runner, log_level="error", log_format="json")))
    assert _levels() == {logging.ERROR}
    log.warning("hidden at error")
    log.error("shown at error, as JSON")

    lines = capsys.readouterr().err.splitlines()
    assert "hidden" not in "\n".join(lines)
    assert len(lines) == 2 and lines[0].endswith("shown at debug"), lines
    assert lines[1].startswith("{") and '"message": "shown at error, as JSON"' in lines[1], lines


def test_a_format_change_keeps_the_filters_of_the_handler_it_replaces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The runner masks secrets with a filter on the handlers it finds at start: a reload that changes
    the format builds a new handler, which must mask too."""

    class Masking(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.msg, record.args = record.getMessage().replace("hunter2", "********"), None
            return True

    configure_logging("text")
    masking = Masking()
    logging.getLogger("leasecore").handlers[0].addFilter(masking)
    configure_logging("json", None, "info")
    for name in PROJECT_LOGGERS:
        assert masking in logging.getLogger(name).handlers[0].filters
    logging.getLogger("conductor_run").warning("the password is %s", "hunter2")
    err = capsys.readouterr().err
    assert "hunter2" not in err and "********" in err, err
