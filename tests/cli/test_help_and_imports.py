"""``--help`` says each option's unit, default and other sources; ``run`` loads only what it needs.

Help text is compared with whitespace removed (click wraps it to the terminal, inside words too).
Defaults are read from the settings dataclasses, as the help text itself is.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli import exitcodes
from cli.main import _register, app
from leasecore.config.loader import RunnerSettings, ServerSettings, TaskSettings

TYPE_PLACEHOLDER = re.compile(r"<(str|int|float|bool|path|list)[^>]*>")


def help_of(*command: str) -> str:
    _register()
    result = CliRunner().invoke(app, [*command, "--help"], prog_name="conductor-run")
    assert result.exit_code == 0, result.output
    return result.output


def squeezed(text: str) -> str:
    return "".join(text.split())


def _n(value: float) -> str:
    return f"{value:g}"


def test_run_help_gives_unit_default_and_other_sources_of_each_option() -> None:
    text = help_of("run")
    assert "Usage: conductor-run run [OPTIONS] [-- CMD [ARGS]]..." in text
    task, runner, server = TaskSettings(type=""), RunnerSettings(), ServerSettings()
    expected = [
        f"--server URL Conductor API base URL (/api is appended when missing). Default: {server.url}; "
        "env CONDUCTOR_SERVER_URL; file [server] url.",
        "--config FILE Config file. Default: ./conductor.toml when present; env CONDUCTOR_RUN_CONFIG.",
        f"--kill-grace SECONDS Seconds between SIGTERM and SIGKILL (capped at a quarter of each task's "
        f"lease). Default: {_n(task.kill_grace)} s;",
        f"--drain-timeout SECONDS Seconds to wait for children when draining. Default: "
        f"{_n(runner.drain_timeout)} s; env CONDUCTOR_RUN_DRAIN_TIMEOUT; file [worker] drain_timeout.",
        f"--poll-timeout MS Long-poll wait in ms (<= 5000). Default: {task.poll_timeout} ms;",
        "--state-dir DIR", "env CONDUCTOR_RUN_STATE_DIR; file [worker] state_dir.",
        f"--log-format text|json Log lines as text or json. Default: {runner.log_format}; "
        "env CONDUCTOR_RUN_LOG_FORMAT",
        "--heartbeat-timeout SECONDS", "Default: the task's responseTimeoutSeconds;",
        "--exec-timeout SECONDS", "(0: never). Default: 0 s (none);",
        f"--once-wait SECONDS --once: seconds to wait for a task before exiting 6. Default: "
        f"{_n(runner.once_wait)} s; command line only.",
        "--concurrency N", "--max-tasks N", "--worker-id NAME", "--domain NAME", "--task-type NAME",
        "--terminal-exit-code CODE", "--shell COMMAND",
        "CONDUCTOR_WORKER_<TASK|ALL>_KILL_GRACE; file [[task]]/[worker] kill_grace.",
    ]
    flat = squeezed(text)
    for part in expected:
        assert squeezed(part) in flat, part
    assert not TYPE_PLACEHOLDER.search(text), TYPE_PLACEHOLDER.search(text)


@pytest.mark.parametrize("command", ["status", "fleet", "server", "demo", "init", "config"])
def test_other_commands_name_their_values_not_their_types(command: str) -> None:
    text = help_of(command)
    assert text.startswith(f"Usage: conductor-run {command} [OPTIONS]")
    assert not TYPE_PLACEHOLDER.search(text), TYPE_PLACEHOLDER.search(text)


def test_other_commands_say_units_and_defaults() -> None:
    flat = squeezed(help_of("status") + help_of("server") + help_of("init") + help_of("config"))
    for part in ("[TASK_ID]", "--state-dir DIR", "Default: $CONDUCTOR_RUN_STATE_DIR, else",
                 "--token-ttl SECONDS", "--port PORT", "[default: 8080", "--sweep-mode ideal|coarse",
                 "[PATH]", "(default: ./conductor.toml)", "--config FILE", "env CONDUCTOR_RUN_CONFIG"):
        assert squeezed(part) in flat, part


HEAVY = ("rich", "leasecore.server", "leasecore.demo.scenes", "leasecore.demo.plan", "leasecore.demo.judge",
         "leasecore.demo.proxy",
         # prometheus-client only with --metrics-port (idle footprint)
         "prometheus_client", "leasecore.metrics.prom", "leasecore.metrics.tally",
         "leasecore.metrics.service")
# Not on a plain run's start path either (the idle footprint and start-up time): the CLI framework and what it
# converts with, and requests with its stack (the lean http:// transport serves).
FRAMEWORK = ("typer", "click", "pydantic", "pydantic_core", "shellingham", "requests", "urllib3",
             "charset_normalizer", "idna", "certifi", "leasecore.conductor.requests_transport", "cli.app")


def _loaded_after(code: str, tmp_path: Path, heavy: tuple[str, ...] = HEAVY,
                  environ: dict[str, str] | None = None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items()
           if not k.upper().startswith("CONDUCTOR") and k not in ("FORCE_COLOR", "TTY_COMPATIBLE")
           and not k.lower().endswith("_proxy")} | (environ or {})
    script = (
        "import atexit, json, sys\n"
        f"heavy = {heavy!r}\n"
        "atexit.register(lambda: print('LOADED=' + json.dumps(sorted(m for m in sys.modules\n"
        "    if m.split('.')[0] in ('rich', *heavy) or m in heavy))))\n" + code
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("LOADED=")]
    return {"loaded": json.loads(line[len("LOADED="):]), "code": done.returncode, "stderr": done.stderr}


def test_registering_the_commands_loads_no_renderer_server_or_demo(tmp_path: Path) -> None:
    seen = _loaded_after("from cli.main import _register\n_register()\n", tmp_path)
    assert seen["loaded"] == [], seen


def test_run_off_a_terminal_never_loads_rich_the_server_or_the_demo(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["conductor-run", "run", "--server", f"http://127.0.0.1:{port}/api", "--task-type", "t",
            "--state-dir", str(tmp_path / "state"), "--", sys.executable, "-c", "pass"]
    # Down to run_worker and its start-up check (every runner module is imported by then): exit 4.
    seen = _loaded_after(f"import sys\nsys.argv = {argv!r}\nfrom cli.main import main\nmain()\n", tmp_path)
    assert seen["code"] == exitcodes.UNREACHABLE, seen
    assert seen["loaded"] == [], seen


def _run_argv(tmp_path: Path, *extra: str) -> list[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return ["conductor-run", "run", "--server", f"http://127.0.0.1:{port}/api", "--task-type", "t",
            "--state-dir", str(tmp_path / "state"), *extra, "--", sys.executable, "-c", "pass"]


def test_a_plain_run_loads_no_cli_framework_and_no_requests(tmp_path: Path) -> None:
    argv = _run_argv(tmp_path, "--concurrency", "2", "--no-lease-extend")
    seen = _loaded_after(f"import sys\nsys.argv = {argv!r}\nfrom cli.main import main\nmain()\n", tmp_path,
                         heavy=HEAVY + FRAMEWORK, environ={"no_proxy": "example.com"})
    assert seen["code"] == exitcodes.UNREACHABLE, seen
    assert "server unreachable at http://127.0.0.1:" in str(seen["stderr"]), seen
    assert seen["loaded"] == [], seen


# Start-up CPU: modules a runner without a config file never needs (hashlib loads OpenSSL; tomllib
# and difflib only read a config file or word a misspelled key in it; the rest load with a config
# file, a reload, a saved result to redeliver, a task type with a user).
START_UP_SPARED = ("secrets", "hmac", "hashlib", "_hashlib", "tomllib", "difflib",
                   "leasecore.config.tomlfile", "leasecore.config.live", "leasecore.state.redelivery",
                   "leasecore.process.linux.runas")


def test_a_plain_run_without_a_config_file_spares_the_start_up_heavy_stdlib(tmp_path: Path) -> None:
    argv = _run_argv(tmp_path)
    seen = _loaded_after(f"import sys\nsys.argv = {argv!r}\nfrom cli.main import main\nmain()\n", tmp_path,
                         heavy=START_UP_SPARED)
    assert seen["code"] == exitcodes.UNREACHABLE, seen
    assert seen["loaded"] == [], seen


def test_what_run_loads_before_a_re_exec_is_the_configuration_not_the_supervisor(tmp_path: Path) -> None:
    # A runner with a credential in its environment re-executes itself once its configuration is
    # read (cli/reexec.py): the modules loaded before that are paid twice, so the supervisor, the
    # lease engine's ports and the result rules load only in the image that serves.
    runner_side = ("leasecore.process.supervisor.supervisor", "leasecore.process.results.task_result",
                   "leasecore.runner.ports", "leasecore.runner.wiring", "leasecore.lease")
    seen = _loaded_after("import cli.main, cli.fastrun, cli.reexec, cli.run\n", tmp_path, heavy=runner_side)
    assert seen["code"] == 0, seen
    assert seen["loaded"] == [], seen
    serving = _loaded_after("import cli.run, leasecore.runner.wiring\n", tmp_path, heavy=runner_side)
    assert serving["loaded"] == sorted(runner_side), serving  # the same check sees them when loaded


def test_a_run_typer_must_read_still_works_and_says_typers_words(tmp_path: Path) -> None:
    # A misspelled option is not plain: typer reads the line and answers with its usage error.
    argv = _run_argv(tmp_path, "--concurency", "2")
    seen = _loaded_after(f"import sys\nsys.argv = {argv!r}\nfrom cli.main import main\nmain()\n", tmp_path,
                         heavy=("typer",))
    assert seen["code"] == exitcodes.USAGE, seen
    assert "No such option: --concurency" in str(seen["stderr"]), seen
    assert "typer" in seen["loaded"], seen


def test_a_proxy_in_the_environment_loads_requests_for_the_calls(tmp_path: Path) -> None:
    argv = _run_argv(tmp_path)
    seen = _loaded_after(f"import sys\nsys.argv = {argv!r}\nfrom cli.main import main\nmain()\n", tmp_path,
                         heavy=("requests",), environ={"http_proxy": "http://127.0.0.1:9", "no_proxy": ""})
    assert seen["code"] == exitcodes.UNREACHABLE, seen
    assert "requests" in seen["loaded"], seen
