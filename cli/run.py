"""``conductor-run run``: turn a command into a Conductor worker.

Thin on purpose: flags (all defaulting to None, "not given") become overrides for the one config
merge (``leasecore.config.loader.load_config``); the resolved config goes to
``leasecore.runner.wiring.run_worker``, which builds the real collaborators and runs the loop; the
outcome becomes an exit code here, once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from cli import exitcodes, reexec
from cli.logformat import JsonFormatter, PlainFormatter
from leasecore.config.keys import KEYS
from leasecore.config.loader import ResolvedConfig, find_config_file, load_config, load_file
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorRunError,
    ConfigError,
)

if TYPE_CHECKING:  # rich and the live view are imported only on a terminal (idle memory, start time)
    from collections.abc import Callable

    import typer
    from rich.console import Console

    from cli.runview import LiveView
    from leasecore.models import Task, TaskResult
    from leasecore.runner.ports import RunOutcome

_SIGNAL_CODES = {signal.SIGINT: exitcodes.SIGINT, signal.SIGTERM: exitcodes.SIGTERM,
                 signal.SIGHUP: exitcodes.SIGHUP}


def exit_code_for(outcome: RunOutcome, *, once: bool, max_tasks: int | None = None) -> int:
    """The process's exit code for a finished run (docs/cli.md "Exit codes").

    ``--once`` and ``--max-tasks`` are for cron-like callers: a task that did not complete is exit 5,
    so a failed batch is never mistaken for a good one. A plain run that served until stopped is 0.
    """
    if outcome.signum is not None:
        return _SIGNAL_CODES.get(signal.Signals(outcome.signum), 128 + outcome.signum)
    if outcome.poller_failed:  # a bug ended a poller (its traceback is logged): never a clean 0
        return exitcodes.UNEXPECTED
    if once:
        if outcome.started == 0:
            return exitcodes.NO_TASK
        return exitcodes.OK if outcome.all_completed else exitcodes.TASK_FAILED
    if max_tasks is not None and outcome.started and not outcome.all_completed:
        return exitcodes.TASK_FAILED
    return exitcodes.OK


# Every logger of the project lives under one of these: the runner's own (``conductor_run.*``) and the
# adapters named after their module (``leasecore.runner.leasing.engine``,
# ``leasecore.process.supervisor.supervisor``, ...).
PROJECT_LOGGERS = ("conductor_run", "leasecore")

# The ``log_level`` setting's values (its checker allows only these) -> the logging module's levels.
LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR}


def configure_logging(log_format: str, console: Console | None = None, log_level: str = "info") -> None:
    """Plain lines (or JSON lines) on stderr, for every logger of the project (``PROJECT_LOGGERS``),
    from ``log_level`` up.

    With ``console`` (a live view shares the terminal) the lines go through it, above the view. The
    filters of the handler it replaces (a reload's, which may mask secrets) go on the new one.
    """
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if console is not None:
        from cli.runview import ConsoleLogHandler

        handler = ConsoleLogHandler(console)
    # UTC, as the trailing Z says; the seconds' text made once a second (cli.logformat)
    handler.setFormatter(JsonFormatter() if log_format == "json" else PlainFormatter())
    # Neither format shows the caller's file and line, thread or process: not looking them up saves
    # a stack walk and three calls per record (two lines per task).
    logging._srcfile = None  # the logging HOWTO's "Optimization" names it
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    for name in PROJECT_LOGGERS:  # one handler for all: same format, same level, same stream
        for old in logging.getLogger(name).handlers:
            for kept in old.filters:
                if kept not in handler.filters:
                    handler.addFilter(kept)
    for name in PROJECT_LOGGERS:
        root = logging.getLogger(name)
        root.handlers[:] = [handler]
        root.propagate = False
    set_log_level(log_level)


def set_log_level(log_level: str) -> None:
    """Show the project's log lines from ``log_level`` up (debug, info, warning, error), from now on.

    A logger's level, not its handler's: a line below it is not even formatted, and the loggers'
    cached answers to ``isEnabledFor`` are cleared by ``setLevel``, so a reload's change holds at once
    in every thread."""
    for name in PROJECT_LOGGERS:
        logging.getLogger(name).setLevel(LOG_LEVELS[log_level])


def _fail(message: str, code: int, log_format: str | None) -> SystemExit:
    """The one line that ends a run: plain text, or with ``json`` a log line of level error.

    A SystemExit, not typer's Exit: ``run`` is also entered without typer (``cli.fastrun``), and
    click lets a SystemExit through as the exit status (its CliRunner records it the same way)."""
    if log_format == "json":
        record = logging.LogRecord("conductor_run", logging.ERROR, __file__, 0, "%s", (message,), None)
        _echo_err(JsonFormatter().format(record))
    else:
        _echo_err(f"conductor-run: {message}")
    return SystemExit(code)


def _echo_err(line: str) -> None:
    stream = sys.stderr
    if stream is None:  # pragma: no cover - no stderr at all (a daemon's closed fd 2)
        return
    stream.write(line + "\n")
    stream.flush()


def _asked_log_format(flag: str | None, config_flag: str | None) -> str | None:
    """The log format asked for, for an error of the configuration as a whole (nothing is resolved).

    The merge's order: the flag, else the environment, else the file's ``[worker] log_format`` when
    the file can be read. An invalid value is not json: its own error stays plain text.
    """
    if flag is not None:
        return flag
    for name in KEYS["log_format"].env:
        if os.environ.get(name):
            return os.environ[name]
    try:
        path = find_config_file(config_flag, os.environ, os.getcwd())
        loaded = load_file(path, cwd=os.getcwd()) if path else None
    except ConfigError:
        return None
    worker = loaded.data.get("worker") if loaded else None
    value = worker.get("log_format") if isinstance(worker, dict) else None
    return value if isinstance(value, str) else None


def run(overrides: dict[str, Any]) -> None:
    """Poll a task type and run a command for each task, with heartbeats and tree fencing.

    The command comes after -- (CMD [ARGS]..., run without a shell; the task's input arrives on stdin,
    in $CONDUCTOR_INPUT_FILE and as CONDUCTOR_INPUT_<KEY> variables), or from --shell, or from the
    config file's [[task]] command. Every option below can also be set in the config file or the
    environment, as each says; a flag wins over both.
    """
    try:
        environ = reexec.receive()  # os.environ, plus the secrets a re-exec handed over
        resolved = load_config(overrides, environ, os.getcwd())
        # No secret may stay in this process's exec-time environment (/proc/<pid>/environ, which a
        # child running as root can read): re-execute without them (returns when there are none).
        reexec.hand_off(name for task in resolved.tasks for name in task.secrets)
    except ConfigError as exc:
        asked = _asked_log_format(overrides["log_format"], overrides["config"])
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG, asked) from None
    except ConductorRunError as exc:
        raise _fail(str(exc), exitcodes.UNEXPECTED, overrides["log_format"]) from None
    view = live_view_for(resolved.runner.log_format)
    configure_logging(resolved.runner.log_format, view.console if view is not None else None,
                      resolved.runner.log_level)
    for warning in resolved.warnings:
        logging.getLogger("conductor_run.config").warning("%s", warning)
    raise SystemExit(serve(resolved, view, load_again=loader_for(overrides, environ, resolved, view),
                           mask_environ=environ))


Reloading = tuple[Callable[[], "ResolvedConfig"], Callable[["ResolvedConfig"], None]]


def loader_for(overrides: dict[str, Any], environ: Mapping[str, str], resolved: ResolvedConfig,
               view: LiveView | None) -> Reloading:
    """What a reload calls (``conductor-run reload``, SIGHUP): the configuration loaded as at start,
    same flags and environment, from the same file (found again by its path as found at start: a
    file that appeared since is not read; one gone since is an error), and the logging it asks for
    (format and level, applied before the reload's own line is logged, so that line already obeys
    them)."""
    cwd = os.getcwd()
    pinned = dict(overrides)
    if resolved.config_file is not None:
        pinned["config"] = os.path.join(cwd, resolved.config_file)

    def load_again() -> ResolvedConfig:
        if resolved.config_file is None and find_config_file(None, environ, cwd) is not None:
            raise ConfigError("this runner started without a config file: a reload reads none "
                              "(start it with --config FILE to reload one)", key="config")
        return load_config(pinned, environ, cwd)

    applied = [resolved.runner.log_format, resolved.runner.log_level]

    def on_reloaded(new: ResolvedConfig) -> None:
        log_format, log_level = new.runner.log_format, new.runner.log_level
        if log_format != applied[0]:  # JSON lines never go through the live view's console
            configure_logging(log_format, view.console if view is not None and log_format == "text" else None,
                              log_level)
        elif log_level != applied[1]:
            set_log_level(log_level)
        applied[:] = [log_format, log_level]

    return load_again, on_reloaded


def live_view_for(log_format: str) -> LiveView | None:
    """A live view when stderr is a terminal and logs are text; otherwise None, without importing rich."""
    if log_format != "text" or not _maybe_terminal():
        return None
    from rich.console import Console

    from cli.runview import LiveView, wants_live_view

    console = Console(stderr=True)
    return LiveView(console) if wants_live_view(console, log_format) else None


def _maybe_terminal() -> bool:
    """False only when rich would surely not see a terminal (rich decides the rest)."""
    if any(name in os.environ for name in ("FORCE_COLOR", "TTY_COMPATIBLE")):  # rich's overrides
        return True
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError, OSError):  # replaced or closed stderr
        return False


def serve(
    resolved: ResolvedConfig,
    view: LiveView | None = None,
    *,
    load_again: Reloading | None = None,
    decide: Callable[[RunOutcome, ResolvedConfig], int] | None = None,
    echo_result: Callable[[Task, TaskResult], None] | None = None,
    mask_environ: Mapping[str, str] | None = None,
) -> int:
    """Run the worker for ``resolved``; every error of the tree becomes a message and an exit code.

    ``load_again``: what a reload loads and how it applies the logging (``loader_for``); None:
    reloads are refused. ``decide(outcome, resolved)``: the exit code of a finished run (default:
    ``run``'s, docs/cli.md "Exit codes"); ``echo_result``: see ``leasecore.runner.wiring.run_worker``.
    ``mask_environ``: the environment whose secret values are masked (the re-exec'd one included)."""
    from leasecore.runner.wiring import run_worker  # heavy imports only once the flags are valid
    from leasecore.snapshot import redact_url

    url = redact_url(resolved.server.url)  # a password in the URL never reaches a message
    log_format = resolved.runner.log_format
    try:
        load, on_reloaded = load_again if load_again is not None else (None, None)
        if view is None:
            outcome = run_worker(resolved, environ=os.environ, load_again=load, on_reloaded=on_reloaded,
                                 echo_result=echo_result, mask_environ=mask_environ)
        else:
            with view.showing():
                outcome = run_worker(resolved, environ=os.environ, on_snapshot=view.update, load_again=load,
                                     on_reloaded=on_reloaded, echo_result=echo_result,
                                     mask_environ=mask_environ)
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG, log_format) from None
    except ConductorAuthError as exc:
        if exc.without_credentials:  # the message already says what to set
            message = f"the server at {url} wants credentials: {exc}"
            raise _fail(message, exitcodes.UNREACHABLE, log_format) from None
        raise _fail(f"the server at {url} refused our credentials: {exc}. {_credentials_hint(resolved)}",
                    exitcodes.UNREACHABLE, log_format) from None
    except ConductorError as exc:
        raise _fail(f"server unreachable at {url}: {exc}", exitcodes.UNREACHABLE, log_format) from None
    except ConductorRunError as exc:
        raise _fail(str(exc), exitcodes.UNEXPECTED, log_format) from None
    if decide is not None:
        return decide(outcome, resolved)
    return exit_code_for(outcome, once=resolved.runner.once, max_tasks=resolved.runner.max_tasks)


def _credentials_hint(resolved: ResolvedConfig) -> str:
    """Where the credentials came from (never their values)."""
    if resolved.server.auth_token is not None:
        source = resolved.server.sources.get("auth_token")
        return f"Check CONDUCTOR_AUTH_TOKEN (from {source}): it is sent as given and never refreshed."
    if resolved.server.auth_key is None:
        return "No credentials are configured: set CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET."
    source = resolved.server.sources.get("auth_key")
    where = f" (the key came from {source})" if source is not None else ""
    return f"Check CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET{where}."


def register(app: typer.Typer) -> None:
    from cli.runoptions import with_run_options  # typer's option objects: not on the lean start path

    app.command("run")(with_run_options(run))
