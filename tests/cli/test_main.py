from __future__ import annotations

import subprocess
import sys

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
