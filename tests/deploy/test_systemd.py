"""deploy/systemd/conductor-run@.service: valid for systemd, and its stop settings fit the runner."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from leasecore.config.loader import resolve
from tests.deploy.stopbudget import MARGIN_SECONDS, stop_budget_seconds

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "deploy" / "systemd" / "conductor-run@.service"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "/usr/bin/systemd-analyze"


def service_section() -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return dict(parser["Service"])


@pytest.mark.skipif(not Path(SYSTEMD_ANALYZE).exists(), reason="systemd-analyze is not installed")
def test_systemd_analyze_verify_accepts_an_instance_of_the_unit(tmp_path: Path) -> None:
    # verify wants ExecStart's binary to exist: the copy points at this checkout's conductor-run.
    here = Path(sys.executable).parent / "conductor-run"
    assert here.is_file()
    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/conductor-run run --config /etc/conductor-run/%i.toml" in text
    instance = tmp_path / "conductor-run@encoder.service"
    instance.write_text(text.replace("/usr/local/bin/conductor-run", str(here)))
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", str(instance)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert (done.returncode, done.stdout + done.stderr) == (0, "")  # a warning is a failure too


@pytest.mark.skipif(not Path(SYSTEMD_ANALYZE).exists(), reason="systemd-analyze is not installed")
def test_verify_does_fail_on_a_broken_copy(tmp_path: Path) -> None:
    # The check above can fail: a misspelt setting is reported.
    here = Path(sys.executable).parent / "conductor-run"
    broken = tmp_path / "conductor-run@encoder.service"
    broken.write_text(UNIT.read_text().replace("/usr/local/bin/conductor-run", str(here))
                      .replace("KillMode=mixed", "KillMode=mixd"))
    done = subprocess.run([SYSTEMD_ANALYZE, "verify", str(broken)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert "kill mode" in (done.stdout + done.stderr).lower()  # so the empty-output check above bites


def test_systemd_stops_only_the_runner_and_waits_longer_than_it_needs_with_the_defaults() -> None:
    service = service_section()
    assert service["KillMode"] == "mixed"  # SIGTERM to the main process, SIGKILL to the rest at the end
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert service["Delegate"] == "yes"
    assert "143" in service["SuccessExitStatus"].split()
    assert "3" in service["RestartPreventExitStatus"].split()
    # Sized for a config that turns drain on and keeps the default drain_timeout and kill_grace.
    defaults = resolve(None, {}, {"task_type": "t", "drain": True}, cwd="/", hostname="h", require_task=False)
    assert float(service["TimeoutStopSec"]) >= stop_budget_seconds(defaults) + MARGIN_SECONDS
    assert "%i" in service["ExecStart"] and "%i" in service["EnvironmentFile"]
    assert service["EnvironmentFile"].startswith("-")  # credentials are optional (Conductor OSS)


def test_reload_goes_through_the_control_socket_of_the_main_process() -> None:
    service = service_section()
    argv = service["ExecReload"].split()
    assert argv[:2] == ["/usr/local/bin/conductor-run", "reload"]
    assert argv[argv.index("--runner") + 1] == "$MAINPID"
    state_dir = service["Environment"].partition("CONDUCTOR_RUN_STATE_DIR=")[2]
    assert argv[argv.index("--state-dir") + 1] == state_dir == "/var/lib/conductor-run"


def test_the_docs_example_unit_waits_longer_than_its_runner_needs() -> None:
    """docs/deployment.md "Running a worker" shows a unit of its own (not the template above), with
    --drain and a longer --drain-timeout: its TimeoutStopSec must fit the same budget, or systemd
    SIGKILLs a runner that is still reporting its tasks."""
    page = (ROOT / "docs" / "deployment.md").read_text()
    ini = page.split("```ini\n")[1:]
    blocks = [block for block in ini if "ExecStart=/usr/local/bin/conductor-run run" in block]
    assert len(blocks) == 1, "the example unit of docs/deployment.md was not found"
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(blocks[0].split("```", 1)[0])
    service = dict(parser["Service"])
    argv = service["ExecStart"].split()
    assert "--drain" in argv
    flags = {"drain": True, "drain_timeout": float(argv[argv.index("--drain-timeout") + 1]),
             "task_type": argv[argv.index("--task-type") + 1]}  # fmt: skip
    config = resolve(None, {}, flags, cwd="/", hostname="h", require_task=False)
    assert config.runner.drain_timeout == 300  # the flag was read (so the budget below counts it)
    assert float(service["TimeoutStopSec"]) >= stop_budget_seconds(config) + MARGIN_SECONDS
