"""``conductor-run run``: turn a command into a Conductor worker.

Thin on purpose: flags (all defaulting to None, "not given") become overrides for the one config
merge (``leasecore.config.load_config``); the resolved config goes to ``leasecore.worker.run_worker``
which builds the real collaborators and runs the loop; the outcome becomes an exit code here, once.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import typer
from rich.console import Console

from cli import exitcodes
from cli.runview import ConsoleLogHandler, LiveView, wants_live_view
from leasecore.config import ResolvedConfig, load_config
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorRunError,
    ConfigError,
)
from leasecore.runtypes import RunOutcome
from leasecore.snapshot import redact_url

_SIGNAL_CODES = {signal.SIGINT: exitcodes.SIGINT, signal.SIGTERM: exitcodes.SIGTERM,
                 signal.SIGHUP: exitcodes.SIGHUP}


def exit_code_for(outcome: RunOutcome, *, once: bool) -> int:
    """The process's exit code for a finished run (README "Exit codes")."""
    if outcome.signum is not None:
        return _SIGNAL_CODES.get(signal.Signals(outcome.signum), 128 + outcome.signum)
    if once:
        if outcome.started == 0:
            return exitcodes.NO_TASK
        return exitcodes.OK if outcome.all_completed else exitcodes.TASK_FAILED
    return exitcodes.OK


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the exception, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["error"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


def configure_logging(log_format: str, console: Console | None = None) -> None:
    """Plain lines (or JSON lines) on stderr, for every conductor_run.* logger.

    With ``console`` (a live view shares the terminal) the lines go through it, above the view.
    """
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if console is not None:
        handler = ConsoleLogHandler(console)
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter()
    else:
        formatter = logging.Formatter("%(asctime)s.%(msecs)03dZ %(levelname)-7s %(message)s",
                                      "%Y-%m-%dT%H:%M:%S")
    formatter.converter = time.gmtime  # UTC, as the trailing Z says
    handler.setFormatter(formatter)
    root = logging.getLogger("conductor_run")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"conductor-run: {message}", err=True)
    return typer.Exit(code)


def run(
    command: list[str] | None = typer.Argument(None, help="The command to run per task (after --)."),
    config: str | None = typer.Option(None, "--config", help="Config file (default: ./conductor.toml)."),
    server: str | None = typer.Option(None, "--server", help="Server URL, e.g. http://host:8080/api."),
    task_type: str | None = typer.Option(None, "--task-type", help="The task type to poll."),
    shell: str | None = typer.Option(None, "--shell", help="Run this string with /bin/sh -c."),
    concurrency: int | None = typer.Option(None, "--concurrency", help="Tasks run at once (default 1)."),
    worker_id: str | None = typer.Option(None, "--worker-id", help="Worker id (default: hostname)."),
    domain: str | None = typer.Option(None, "--domain", help="Task domain to poll."),
    lease_extend: bool | None = typer.Option(
        None, "--lease-extend/--no-lease-extend", help="Send extendLease heartbeats (default on)."
    ),
    heartbeat_timeout: float | None = typer.Option(
        None, "--heartbeat-timeout", help="Seconds without an acked heartbeat before the tree is killed."
    ),
    kill_grace: float | None = typer.Option(None, "--kill-grace", help="Seconds from TERM to KILL."),
    exec_timeout: float | None = typer.Option(None, "--exec-timeout", help="Max run time (0: none)."),
    terminal_exit_code: list[int] | None = typer.Option(
        None, "--terminal-exit-code", help="Exit code meaning FAILED_WITH_TERMINAL_ERROR (repeatable)."
    ),
    once: bool | None = typer.Option(None, "--once", help="Run one task, then exit (6: none came)."),
    once_wait: float | None = typer.Option(
        None, "--once-wait", help="--once: seconds to wait for a task before exiting 6 (default 30)."
    ),
    max_tasks: int | None = typer.Option(None, "--max-tasks", help="Exit after this many tasks."),
    drain: bool | None = typer.Option(None, "--drain", help="On a signal, let running tasks finish."),
    drain_timeout: float | None = typer.Option(None, "--drain-timeout", help="Max seconds to drain."),
    poll_timeout: int | None = typer.Option(None, "--poll-timeout", help="Long-poll wait, ms (<= 5000)."),
    state_dir: str | None = typer.Option(None, "--state-dir", help="Where status snapshots go."),
    log_format: str | None = typer.Option(None, "--log-format", help="text or json."),
) -> None:
    """Poll a task type and run the command for each task, with heartbeats and tree fencing."""
    overrides = {
        "config": config, "server": server, "task_type": task_type, "command": command, "shell": shell,
        "concurrency": concurrency, "worker_id": worker_id, "domain": domain,
        "lease_extend_enabled": lease_extend, "heartbeat_timeout": heartbeat_timeout,
        "kill_grace": kill_grace, "exec_timeout": exec_timeout,
        "terminal_exit_codes": terminal_exit_code, "once": once, "once_wait": once_wait,
        "max_tasks": max_tasks,
        "drain": drain, "drain_timeout": drain_timeout, "poll_timeout": poll_timeout,
        "state_dir": state_dir, "log_format": log_format,
    }
    try:
        resolved = load_config(overrides, os.environ, os.getcwd())
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG) from None
    console = Console(stderr=True)
    view = LiveView(console) if wants_live_view(console, resolved.runner.log_format) else None
    configure_logging(resolved.runner.log_format, console if view is not None else None)
    for warning in resolved.warnings:
        logging.getLogger("conductor_run.config").warning("%s", warning)
    raise typer.Exit(serve(resolved, view))


def serve(resolved: ResolvedConfig, view: LiveView | None = None) -> int:
    """Run the worker for ``resolved``; every error of the tree becomes a message and an exit code."""
    from leasecore.worker import run_worker  # heavy imports only once the flags are valid

    url = redact_url(resolved.server.url)  # a password in the URL never reaches a message
    try:
        if view is None:
            outcome = run_worker(resolved, environ=os.environ)
        else:
            with view.showing():
                outcome = run_worker(resolved, environ=os.environ, on_snapshot=view.update)
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG) from None
    except ConductorAuthError as exc:
        raise _fail(f"the server at {url} refused our credentials: {exc}. {_credentials_hint(resolved)}",
                    exitcodes.UNREACHABLE) from None
    except ConductorError as exc:
        raise _fail(f"server unreachable at {url}: {exc}", exitcodes.UNREACHABLE) from None
    except ConductorRunError as exc:
        raise _fail(str(exc), exitcodes.UNEXPECTED) from None
    return exit_code_for(outcome, once=resolved.runner.once)


def _credentials_hint(resolved: ResolvedConfig) -> str:
    """Where the credentials came from (never their values)."""
    if resolved.server.auth_key is None:
        return "No credentials are configured: set CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET."
    source = resolved.server.sources.get("auth_key")
    where = f" (the key came from {source})" if source is not None else ""
    return f"Check CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET{where}."


def register(app: typer.Typer) -> None:
    app.command("run")(run)
