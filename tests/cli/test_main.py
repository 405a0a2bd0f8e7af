from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from cli.main import _register, app
from leasecore import __version__


def test_version_flag_prints_the_package_version() -> None:
    _register()
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"conductor-run {__version__}"


def test_console_script_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "Conductor worker" in proc.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
@pytest.mark.parametrize("spelling", ["{shell}_source", "source_{shell}"])
def test_shell_completion_script_for_each_shell(shell: str, spelling: str) -> None:
    """Completion is on: click's spelling (bash_source) and typer's (source_bash) both print the
    script, and the script asks conductor-run itself for the completions."""
    env = {**os.environ, "_CONDUCTOR_RUN_COMPLETE": spelling.format(shell=shell)}
    proc = subprocess.run([sys.executable, "-m", "cli"], capture_output=True, text=True, timeout=60,
                          check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "not supported" not in proc.stderr
    assert f"_CONDUCTOR_RUN_COMPLETE=complete_{shell}" in proc.stdout
    assert "conductor-run" in proc.stdout


def test_bash_completion_completes_commands_and_options() -> None:
    def complete(words: str, cword: int) -> list[str]:
        env = {**os.environ, "_CONDUCTOR_RUN_COMPLETE": "complete_bash", "COMP_WORDS": words,
               "COMP_CWORD": str(cword)}
        proc = subprocess.run([sys.executable, "-m", "cli"], capture_output=True, text=True, timeout=60,
                              check=False, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    assert complete("conductor-run sta", 1) == ["status"]
    assert "--log-format" in complete("conductor-run run --log", 2)
