"""``conductor-run worker stdio``: conductor-cli's ``worker stdio`` command line, run by ``run``'s machinery.

A ``conductor worker stdio [FLAGS] COMMAND [ARGS...]`` line works with ``conductor-run`` put in front
of it instead: every flag of conductor-cli's ``worker stdio`` (and of its root command: ``--server``,
``--auth-*``, ``--profile``, ``--config``, ``-v``, ``-y``) means what it means there, its profiles and
YAML files are read in its order (``leasecore.config.clifile``), and flags may come after the command's
words, as cobra allows (``... python3 worker.py --count 5``; the command's own options go after
``--``). Underneath it is ``run --protocol stdio`` with ``--drain``: the same merge
(``load_config``), the same runner (``cli.run.serve``), every guarantee of ``run``. What differs is
the exit: a first signal drains (running tasks finish with their leases kept, up to
``--drain-timeout``) and the worker exits 0, as conductor-cli does; a second one ends the trees,
reports them and exits 130.

conductor-run's own run options are here too, but for those that conductor-cli's flags replace
(``--task-type``: ``--type``, ``--concurrency``: ``--count``, ``--config``: ``--run-config``, ...).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import typer

from cli import exitcodes, reexec
from cli.run import _fail, configure_logging, exit_code_for, live_view_for, serve
from cli.runoptions import RUN_OPTIONS
from leasecore.config.clifile import ENV_VARS, CliSettings, resolve_cli
from leasecore.config.loader import ResolvedConfig, load_config
from leasecore.config.settings import Source
from leasecore.errors import ConductorRunError, ConfigError
from leasecore.models import Task, TaskResult
from leasecore.runner.ports import RunOutcome

log = logging.getLogger("conductor_run.worker")

CLI_POLL_TIMEOUT_MS = 100  # conductor-cli's default --poll-timeout
MAX_POLL_TIMEOUT_MS = 5000  # conductor-run's long-poll ceiling
ECHO_LIMIT_CHARS = 64 * 1024  # --verbose prints at most this much of a task or a result

# run options that conductor-cli's flags replace here (or that make no sense: the protocol is stdio,
# a first signal always drains, the command is the arguments).
REPLACED = frozenset({"command", "config", "server", "task_type", "shell", "concurrency", "worker_id",
                      "domain", "exec_timeout", "poll_timeout", "protocol", "drain"})  # fmt: skip
KEPT_RUN_OPTIONS = tuple(option for option in RUN_OPTIONS if option[0] not in REPLACED)

# The server URL and credentials the merge reads from the environment, for conductor-cli's choice.
_SERVER_ENV = ("CONDUCTOR_SERVER_URL", "CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET", "CONDUCTOR_AUTH_TOKEN",
               "CONDUCTOR_AUTH_SECRET_FILE")  # fmt: skip
_TO_KEY = {"server": "url", "auth-key": "auth_key", "auth-secret": "auth_secret", "auth-token": "auth_token"}

HELP = """Poll a task type and run COMMAND for each task, conductor-cli's way: the task JSON on
stdin, one result document {status, output, logs, reason} on stdout.

Takes conductor-cli's `worker stdio` command line unchanged (put conductor-run in front of it instead
of conductor), its profiles (~/.conductor-cli/config[-PROFILE].yaml) and its environment, and runs it
with everything conductor-run adds: heartbeats, fencing, whole-tree kills, the outbox, status.

A first SIGINT/SIGTERM stops polling and lets running tasks finish (leases kept, up to
--drain-timeout), then exits 0; a second one ends them, reports them and exits 130.
"""

CLI_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("command", list[str] | None, typer.Argument(
        None, metavar="COMMAND [ARGS]...", show_default=False,
        help="The command run for each task, without a shell; its own options go after --.",
    )),
    ("cli_type", str | None, typer.Option(None, "--type", metavar="TASK_TYPE",
                                          help="Task type to poll for (required).")),
    ("count", int | None, typer.Option(
        None, "--count", metavar="N",
        help="How many tasks run at once (default 1). conductor-cli's batch size; here a slot that "
             "frees is refilled at once instead of when the whole batch is done.",
    )),
    ("poll_timeout", int | None, typer.Option(
        None, "--poll-timeout", metavar="MS",
        help=f"Long-poll timeout in milliseconds (default {CLI_POLL_TIMEOUT_MS}, as conductor-cli; at "
             f"most {MAX_POLL_TIMEOUT_MS}).",
    )),
    ("legacy_timeout", int | None, typer.Option(None, "--timeout", metavar="MS", hidden=True,
                                                help="Deprecated: use --poll-timeout.")),
    ("exec_timeout", int | None, typer.Option(
        None, "--exec-timeout", metavar="SECONDS",
        help="Kill the task's whole process tree after this many seconds and report FAILED "
             "(default 0: none).",
    )),
    ("worker_id", str | None, typer.Option(None, "--worker-id", metavar="ID",
                                           help="Worker id of polls and results (default: the hostname).")),
    ("domain", str | None, typer.Option(None, "--domain", metavar="DOMAIN", help="Poll this domain.")),
    ("verbose", bool, typer.Option(False, "--verbose", "-v",
                                   help="Print each task's JSON and its result JSON on stdout.")),
    ("server", str | None, typer.Option(None, "--server", metavar="URL",
                                        help="Server URL (else the profile, else CONDUCTOR_SERVER_URL).")),
    ("auth_key", str | None, typer.Option(None, "--auth-key", metavar="KEY",
                                          help="API key id (else the profile, else CONDUCTOR_AUTH_KEY).")),
    ("auth_secret", str | None, typer.Option(
        None, "--auth-secret", metavar="SECRET",
        help="API key secret (else the profile, else CONDUCTOR_AUTH_SECRET). A flag shows in `ps`: "
             "prefer the profile or the environment.",
    )),
    ("auth_token", str | None, typer.Option(None, "--auth-token", metavar="TOKEN",
                                            help="Token (else the profile, else CONDUCTOR_AUTH_TOKEN).")),
    ("server_type", str | None, typer.Option(None, "--server-type", metavar="OSS|Enterprise",
                                             help="Accepted for conductor-cli's sake; unused.")),
    ("profile", str | None, typer.Option(
        None, "--profile", metavar="NAME",
        help="Read ~/.conductor-cli/config-NAME.yaml (else $CONDUCTOR_PROFILE); it must exist.",
    )),
    ("cli_config", str | None, typer.Option(None, "--config", metavar="FILE",
                                            help="conductor-cli's YAML config file, instead of a profile.")),
    ("yes", bool, typer.Option(False, "--yes", "-y", help="Accepted for conductor-cli's sake: no prompts.")),
    ("run_config", str | None, typer.Option(
        None, "--run-config", metavar="FILE",
        help="conductor-run's own conductor.toml (else $CONDUCTOR_RUN_CONFIG, else ./conductor.toml).",
    )),
)  # fmt: skip


def worker_stdio(
    run_overrides: dict[str, Any],
    *,
    command: list[str] | None,
    cli_type: str | None,
    count: int | None,
    poll_timeout: int | None,
    legacy_timeout: int | None,
    exec_timeout: int | None,
    worker_id: str | None,
    domain: str | None,
    verbose: bool,
    server: str | None,
    auth_key: str | None,
    auth_secret: str | None,
    auth_token: str | None,
    server_type: str | None,
    profile: str | None,
    cli_config: str | None,
    yes: bool,
    run_config: str | None,
) -> None:
    del yes, server_type  # accepted for conductor-cli's command lines; nothing here depends on them
    log_format = run_overrides.get("log_format")
    if not cli_type:
        raise _fail("--type is required: conductor-run worker stdio --type TASK_TYPE COMMAND [ARGS]...",
                    exitcodes.USAGE, log_format)  # fmt: skip
    if not command:
        raise _fail("give the command to run: conductor-run worker stdio --type TASK_TYPE COMMAND [ARGS]...",
                    exitcodes.USAGE, log_format)  # fmt: skip
    warnings: list[str] = []
    polled = _poll_timeout(poll_timeout, legacy_timeout, warnings)
    try:
        environ = reexec.receive()  # os.environ, plus the secrets a re-exec handed over
        given = {"server": server, "auth-key": auth_key, "auth-secret": auth_secret, "auth-token": auth_token}
        flags = _credential_flags(environ, given)
        cli = resolve_cli(flags, profile=profile, config_file=cli_config, environ=environ, cwd=os.getcwd())
    except ConfigError as exc:  # conductor-cli's own files and flags: named as given
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG, log_format) from None
    except ConductorRunError as exc:
        raise _fail(str(exc), exitcodes.UNEXPECTED, log_format) from None
    try:
        overrides = {
            **run_overrides,
            "config": run_config,
            "command": list(command),
            "task_type": cli_type,
            "concurrency": count,
            "poll_timeout": polled,
            "exec_timeout": float(exec_timeout) if exec_timeout is not None else None,
            "worker_id": worker_id,
            "domain": domain,
            "protocol": "stdio",
            "drain": True,
        }
        resolved = _with_cli_sources(load_config(overrides, merge_environ(environ, cli), os.getcwd()), cli)
        if (held := _file_secrets_warning(cli, resolved)) is not None:
            warnings.append(held)
        # A credential flag's value is in /proc/<pid>/cmdline, which any process of the host can read:
        # re-executed (same pid) without it, the value handed over by pipe with the environment's.
        # Only what is on this image's command line (a re-executed one has none left to move).
        stash = {var: value for key, var in _FLAG_VARS.items() if (value := given.get(key))}
        os.environ.update(stash)
        try:
            argv = _without_credential_flags(sys.orig_argv) if stash else None
            reexec.hand_off((name for task in resolved.tasks for name in task.secrets), argv=argv)
        finally:  # still here: no re-exec (in-process, or not allowed)
            for var in stash:
                os.environ.pop(var, None)
    except ConfigError as exc:
        raise _fail(f"configuration error: {_our_flags(str(exc))}", exitcodes.CONFIG, log_format) from None
    except ConductorRunError as exc:
        raise _fail(str(exc), exitcodes.UNEXPECTED, log_format) from None
    view = live_view_for(resolved.runner.log_format)
    configure_logging(resolved.runner.log_format, view.console if view is not None else None,
                      resolved.runner.log_level)  # -v is conductor-cli's: the tasks' JSON, not the level
    for key in ("auth-secret", "auth-token"):
        if cli.sources.get(key, "").startswith("flag"):
            warnings.append(f"--{key} was on the command line, where other users could read it (ps) until "
                            "conductor-run re-executed itself without it, and where shell history keeps "
                            "it; prefer a profile file (mode 0600) or the environment")  # fmt: skip
    for warning in (*resolved.warnings, *warnings):
        logging.getLogger("conductor_run.config").warning("%s", warning)
    if cli.file is not None:
        log.info("conductor-cli settings from %s", cli.file)
    raise SystemExit(serve(resolved, view, decide=worker_exit_code, echo_result=echo if verbose else None))


# run's flags whose values this command takes under conductor-cli's names: a message names the one typed.
_FLAG_NAMES = {"flag --concurrency": "flag --count", "flag --task-type": "flag --type",
               "(from --config)": "(from --run-config)"}  # fmt: skip


def _our_flags(message: str) -> str:
    for run_flag, cli_flag in _FLAG_NAMES.items():
        message = message.replace(run_flag, cli_flag)
    return message


# Where a credential flag's value waits across the re-exec (CONDUCTOR_AUTH_*: a secret name, handed
# over by pipe and never inherited by a child).
_FLAG_VARS = {"auth-key": "CONDUCTOR_AUTH_FLAG_KEY", "auth-secret": "CONDUCTOR_AUTH_FLAG_SECRET",
              "auth-token": "CONDUCTOR_AUTH_FLAG_TOKEN"}  # fmt: skip


def _credential_flags(environ: dict[str, str], flags: dict[str, str | None]) -> dict[str, str | None]:
    """``flags``, with the credential flags' values a re-exec handed over (taken out of ``environ``)."""
    found = dict(flags)
    for key, var in _FLAG_VARS.items():
        value = environ.pop(var, None)
        os.environ.pop(var, None)
        if value and not found.get(key):
            found[key] = value
    return found


def _without_credential_flags(argv: list[str]) -> list[str]:
    """``argv`` without ``--auth-key``, ``--auth-secret``, ``--auth-token`` and their values (``--flag
    VALUE`` and ``--flag=VALUE``), up to a ``--`` (after it, the words are the command's)."""
    names = {f"--{key}" for key in _FLAG_VARS}
    kept: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            kept.append(word)
            kept.extend(words)
            break
        if word in names:
            next(words, None)
            continue
        if word.partition("=")[0] in names:
            continue
        kept.append(word)
    return kept


def _poll_timeout(poll_timeout: int | None, legacy: int | None, warnings: list[str]) -> int:
    """conductor-cli's: --poll-timeout, else the hidden --timeout, else 100 ms; at most 5000 here."""
    value = (
        poll_timeout if poll_timeout is not None else legacy if legacy is not None else CLI_POLL_TIMEOUT_MS
    )
    if value > MAX_POLL_TIMEOUT_MS:
        warnings.append(f"--poll-timeout {value} ms is more than conductor-run's long poll allows: "
                        f"{MAX_POLL_TIMEOUT_MS} ms is used")  # fmt: skip
        return MAX_POLL_TIMEOUT_MS
    return value


def _file_secrets_warning(cli: CliSettings, resolved: ResolvedConfig) -> str | None:
    """conductor.toml's rule for a file holding a credential, for conductor-cli's file: open to group
    or others, a warning, or a ConfigError when children run as another user (who could read it)."""
    from leasecore.config import trust

    if cli.file is None:
        return None
    where = f"file {cli.file}"
    from_file = {key: value for key, value in cli.values.items() if cli.sources.get(key) == where}
    held = {"auth_secret": from_file.get("auth-secret"), "auth_token": from_file.get("auth-token"),
            "url": from_file.get("server")}  # fmt: skip
    task = next((task for task in resolved.tasks if task.user is not None), None)
    run_as = None if task is None else f"task {task.type!r} runs its children as user {task.user!r}"
    return trust.config_file_secrets(cli.file, held, run_as)


def merge_environ(environ: Mapping[str, str], cli: CliSettings) -> dict[str, str]:
    """``environ`` for the merge, with conductor-cli's choice in place of the server variables: the
    environment's own only when conductor-cli would read them; a file's and the flags' values in
    their place (the variables, not flags: the merge's order for them, and no value on a command line)."""
    merged = {
        name: value for name, value in environ.items() if name not in _SERVER_ENV or cli.active == "env"
    }
    for key, value in cli.values.items():
        if key in _TO_KEY:
            merged[ENV_VARS[key]] = value
    return merged


def _with_cli_sources(resolved: ResolvedConfig, cli: CliSettings) -> ResolvedConfig:
    """The server's sources say where conductor-cli's values came from (a profile file, a flag)."""
    sources = dict(resolved.server.sources)
    for key, name in _TO_KEY.items():
        where = cli.sources.get(key)
        if (
            where is not None
            and sources.get(name) is not None
            and str(sources[name]) == f"env {ENV_VARS[key]}"
        ):
            sources[name] = Source(where.split(" ", 1)[0], where)
    return dataclasses.replace(resolved, server=dataclasses.replace(resolved.server, sources=sources))


def worker_exit_code(outcome: RunOutcome, resolved: ResolvedConfig) -> int:
    """conductor-cli's habit: 0 after the drain a first signal starts, 130 when a second one forced
    the end; otherwise as ``run`` (``--once``, ``--max-tasks``, a failed poller...)."""
    if outcome.forced:
        return exitcodes.FORCED
    if outcome.signum is not None:
        return exitcodes.OK
    return exit_code_for(outcome, once=resolved.runner.once, max_tasks=resolved.runner.max_tasks)


def _bounded(text: str) -> str:
    if len(text) <= ECHO_LIMIT_CHARS:
        return text
    return f"{text[:ECHO_LIMIT_CHARS]}\n... ({len(text) - ECHO_LIMIT_CHARS} more characters not shown)"


def echo(task: Task, result: TaskResult) -> None:
    """``--verbose``: the task as received and its result, framed as conductor-cli frames them
    (printed when the task ends, each bounded)."""
    document = {
        "status": result.status.value,
        "output": dict(result.output_data),
        "logs": [line.log for line in result.logs],
        "reason": result.reason_for_incompletion or "",
    }
    failed = result.status.value.startswith("FAILED")
    head = "=== Task Result (Error) ===" if failed else "=== Task Result ==="
    lines = [
        "=== Task Input ===",
        _bounded(json.dumps(task.raw, ensure_ascii=False)),
        "==================",
        head,
        _bounded(json.dumps(document, indent=2, ensure_ascii=False)),
        "=" * len(head),
    ]
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def _command() -> Any:
    """``worker_stdio`` as a typer command: conductor-cli's options, then the run options kept."""
    parameters = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
        for name, kind, option in (*CLI_OPTIONS, *KEPT_RUN_OPTIONS)
    ]

    @functools.wraps(worker_stdio)
    def command(**given: Any) -> None:
        worker_stdio({name: given.pop(name) for name, _, _ in KEPT_RUN_OPTIONS}, **given)

    command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    command.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    command.__doc__ = HELP
    return command


def register(app: typer.Typer) -> None:
    worker = typer.Typer(
        name="worker",
        help="conductor-cli's worker commands (stdio).",
        no_args_is_help=True,
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    worker.command("stdio", help=HELP, no_args_is_help=True)(_command())
    app.add_typer(worker, name="worker")
