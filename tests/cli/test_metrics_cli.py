"""Bad metrics input: one line naming the key, where it came from and what is allowed; exit 3,
before any task is polled and whether or not the Conductor server is up; and ``--help`` says it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import exitcodes
from cli.main import _register, app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def _commands() -> None:
    _register()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_cli(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The real CLI against a server that is not there (a closed loopback port): its exit code, stderr."""
    argv = [sys.executable, "-m", "cli", "run", "--server", f"http://127.0.0.1:{_closed_port()}/api",
            "--task-type", "t", "--state-dir", str(tmp_path / "state"), *flags, "--", "true"]
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    done = subprocess.run(argv, cwd=REPO, env=base | (env or {}), capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr


def one_line_config_error(code: int, err: str) -> str:
    assert code == exitcodes.CONFIG, err
    assert err.startswith("conductor-run: configuration error: ") and err.count("\n") == 1, err
    return err


def test_a_port_in_use_is_exit_3_naming_the_port_even_with_the_server_down(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = one_line_config_error(*run_cli(tmp_path, "--metrics-port", str(port)))
    assert (f"invalid metrics_port = {port} (from flag --metrics-port): cannot listen on "
            f"http://127.0.0.1:{port}: Address already in use (another process listens there: pick "
            "another port)") in err


def test_an_address_that_is_not_an_ip_is_exit_3(tmp_path: Path) -> None:
    err = one_line_config_error(*run_cli(tmp_path, "--metrics-port", "0", "--metrics-host", "my-host"))
    assert ("invalid metrics_host = 'my-host' (from flag --metrics-host): expected an IP address to listen "
            "on, such as 127.0.0.1, 0.0.0.0 or ::1") in err


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--metrics-port", "65536"], {}, "invalid metrics_port = 65536 (from flag --metrics-port): "
                                         "expected a TCP port from 0 to 65535"),
        (["--metrics-port", "-5"], {}, "invalid metrics_port = -5 (from flag --metrics-port)"),
        ([], {"CONDUCTOR_RUN_METRICS_PORT": "99999"}, "invalid metrics_port = '99999' (from env "
                                                       "CONDUCTOR_RUN_METRICS_PORT)"),
        ([], {"CONDUCTOR_RUN_METRICS_PORT": "9464", "CONDUCTOR_RUN_METRICS_HOST": "1.2.3"},
         "invalid metrics_host = '1.2.3' (from env CONDUCTOR_RUN_METRICS_HOST)"),
    ],
)
def test_out_of_range_ports_and_bad_addresses_are_one_line_exit_3(
    args: list[str], env: dict[str, str], expected: str
) -> None:
    result = CliRunner().invoke(app, ["run", "--task-type", "t", *args, "--", "true"],
                                env={"COLUMNS": "200", **env})
    assert result.exit_code == exitcodes.CONFIG, result.output
    assert result.stderr.startswith("conductor-run: configuration error: ")
    assert result.stderr.count("\n") == 1 and expected in result.stderr, result.stderr


def test_help_names_the_metrics_flags_their_default_and_other_sources() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    flat = "".join(result.output.split())
    for part in ("--metrics-port PORT Serve /metrics, /healthz and /readyz on this port (0: any free port, "
                 "logged). Default: off; env CONDUCTOR_RUN_METRICS_PORT; file [worker] metrics_port.",
                 "--metrics-host ADDR The address the metrics endpoint listens on. Default: 127.0.0.1; "
                 "env CONDUCTOR_RUN_METRICS_HOST; file [worker] metrics_host."):
        assert "".join(part.split()) in flat, part


def test_help_names_the_label_flag_its_choices_default_and_other_sources() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    flat = "".join(result.output.split())
    part = ("--metrics-task-type-label taskType|task_type The metrics' label name for the task type: "
            "taskType (the Conductor SDKs' name, which their dashboards query) or task_type (snake_case: "
            "promtool check metrics finds nothing). Default: taskType; env "
            "CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL; file [worker] metrics_task_type_label.")
    assert "".join(part.split()) in flat, result.output


def test_a_bad_label_name_is_exit_3_with_one_line() -> None:
    result = CliRunner().invoke(app, ["run", "--task-type", "t", "--metrics-task-type-label", "task-type",
                                      "--", "true"], env={"COLUMNS": "200"})
    assert result.exit_code == exitcodes.CONFIG, result.output
    assert result.stderr == ("conductor-run: configuration error: invalid metrics_task_type_label = "
                             "'task-type' (from flag --metrics-task-type-label): expected 'taskType' or "
                             "'task_type'\n")
