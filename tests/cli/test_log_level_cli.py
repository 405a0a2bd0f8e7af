"""``--log-level`` at the command line: a bad value is exit 3 naming the flag (or variable) and the
values allowed, and ``worker stdio`` applies the level while its ``-v`` keeps conductor-cli's meaning
(print each task's JSON and its result), not a log level's."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import cli.workerstdio
from cli import exitcodes
from cli.main import _register, app
from cli.run import PROJECT_LOGGERS


@pytest.fixture(scope="module", autouse=True)
def _commands() -> None:
    _register()


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.chdir(tmp_path)
    for name in list(os.environ):
        if name.upper().startswith("CONDUCTOR"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))  # no conductor-cli profile of the machine's
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).handlers))
             for name in PROJECT_LOGGERS}
    yield
    for name, (level, handlers) in saved.items():
        logging.getLogger(name).setLevel(level)
        logging.getLogger(name).handlers[:] = handlers


def invoke(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args), env=env)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stderr


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("run", "--log-level", "loud", "--task-type", "x", "--", "true"), None, "(from flag --log-level)"),
        (("run", "--task-type", "x", "--", "true"), {"CONDUCTOR_RUN_LOG_LEVEL": "WARN"},
         "CONDUCTOR_RUN_LOG_LEVEL"),
        (("worker", "stdio", "--type", "x", "--log-level", "trace", "true"), None, "(from flag --log-level)"),
    ],
)
def test_a_bad_level_is_exit_3_naming_where_it_came_from_and_the_values(
    args: tuple[str, ...], env: dict[str, str] | None, named: str
) -> None:
    code, err = invoke(*args, env=env)
    assert code == exitcodes.CONFIG, err
    assert err.startswith("conductor-run: configuration error: invalid log_level = "), err
    assert named in err and "'debug' or 'info' or 'warning' or 'error'" in err, err
    assert "Traceback" not in err


def test_a_bad_level_in_the_file_names_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "conductor.toml").write_text('[worker]\nlog_level = "verbose"\n', "utf-8")
    code, err = invoke("run", "--task-type", "x", "--", "true")
    assert code == exitcodes.CONFIG, err
    assert "invalid log_level = 'verbose'" in err and "conductor.toml:2" in err, err


@pytest.mark.parametrize(
    ("args", "level"),
    [((), logging.INFO), (("--log-level", "warning"), logging.WARNING),
     (("--log-level", "debug", "--verbose"), logging.DEBUG)],
)
def test_worker_stdio_applies_the_level_and_its_verbose_still_echoes_the_tasks(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], level: int
) -> None:
    served: dict[str, Any] = {}

    def serve(resolved: Any, view: Any, **kwargs: Any) -> int:  # instead of contacting a server
        levels = {logging.getLogger(name).level for name in PROJECT_LOGGERS}
        served.update(resolved=resolved, levels=levels, **kwargs)
        return 0

    monkeypatch.setattr(cli.workerstdio, "serve", serve)
    server = ("--server", "http://127.0.0.1:9/api")
    code, err = invoke("worker", "stdio", "--type", "x", *server, *args, "--", "true")
    assert code == 0, err
    assert served["levels"] == {level}
    assert served["resolved"].runner.log_level == logging.getLevelName(level).lower()
    assert (served["echo_result"] is not None) == ("--verbose" in args)
