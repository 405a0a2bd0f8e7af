"""The options of ``run``, defined once and shared with ``config``.

``config`` takes any ``run`` command line and shows what that run would use, so both must take the
same options: a new one added here reaches both. Every option sets one key of the merge (its name is
the key in ``leasecore.config.loader.OVERRIDE_KEYS``) and defaults to None, "not given": the merge owns the
defaults, and ``--help`` says them (``cli.helptext``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer

from cli.helptext import STATE_DIR_DEFAULT, config_file_help, key_help

# (override key, the type typer converts the value to, the argument or option), in --help order.
RUN_OPTIONS: tuple[tuple[str, Any, Any], ...] = (
    ("command", list[str] | None, typer.Argument(None, metavar="-- CMD [ARGS]", hidden=True)),
    ("config", str | None, typer.Option(None, "--config", metavar="FILE", help=config_file_help())),
    ("server", str | None, typer.Option(None, "--server", metavar="URL", help=key_help("url"))),
    ("ca_bundle", str | None, typer.Option(None, "--ca-bundle", metavar="FILE", help=key_help("ca_bundle"))),
    ("pass_credentials", bool | None, typer.Option(
        None, "--pass-credentials", help=key_help("pass_credentials")
    )),
    ("task_type", str | None, typer.Option(
        None, "--task-type", metavar="NAME",
        help=key_help("type", what="the task type to poll (with a config file: only this [[task]] runs)",
                      default=""),
    )),
    ("shell", str | None, typer.Option(
        None, "--shell", metavar="COMMAND",
        help=key_help("shell", what="run this string with /bin/sh -c instead of -- CMD [ARGS] (task "
                      "input never enters it)", default=""),
    )),
    ("concurrency", int | None, typer.Option(
        None, "--concurrency", metavar="N", help=key_help("concurrency")
    )),
    ("worker_id", str | None, typer.Option(
        None, "--worker-id", metavar="NAME", help=key_help("worker_id", default="the hostname")
    )),
    ("domain", str | None, typer.Option(None, "--domain", metavar="NAME", help=key_help("domain"))),
    ("lease_extend_enabled", bool | None, typer.Option(
        None, "--lease-extend/--no-lease-extend", help=key_help("lease_extend_enabled")
    )),
    ("heartbeat_timeout", float | None, typer.Option(
        None, "--heartbeat-timeout", metavar="SECONDS",
        help=key_help("heartbeat_timeout", "s", default="the task's responseTimeoutSeconds"),
    )),
    ("kill_grace", float | None, typer.Option(
        None, "--kill-grace", metavar="SECONDS", help=key_help("kill_grace", "s")
    )),
    ("exec_timeout", float | None, typer.Option(
        None, "--exec-timeout", metavar="SECONDS", help=key_help("exec_timeout", "s", zero="none")
    )),
    ("terminal_exit_codes", list[int] | None, typer.Option(
        None, "--terminal-exit-code", metavar="CODE",
        help=key_help("terminal_exit_codes", what="an exit code reported FAILED_WITH_TERMINAL_ERROR "
                      "(repeatable; 1..255)", default="none"),
    )),
    ("exit_codes", list[str] | None, typer.Option(
        None, "--exit-code", metavar="CODE=STATUS[:SECONDS]",
        help=key_help("exit_codes", what="map an exit code to COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR "
                      "or IN_PROGRESS[:callbackAfterSeconds] (repeatable; 1..255)", default="none"),
    )),
    ("protocol", str | None, typer.Option(
        None, "--protocol", metavar="native|stdio", help=key_help("protocol")
    )),
    ("once", bool | None, typer.Option(
        None, "--once",
        help=key_help("once", what="run one task, then exit (exit 6 when none came within --once-wait)"),
    )),
    ("once_wait", float | None, typer.Option(
        None, "--once-wait", metavar="SECONDS", help=key_help("once_wait", "s")
    )),
    ("max_tasks", int | None, typer.Option(
        None, "--max-tasks", metavar="N", help=key_help("max_tasks", default="no limit")
    )),
    ("drain", bool | None, typer.Option(None, "--drain", help=key_help("drain"))),
    ("drain_timeout", float | None, typer.Option(
        None, "--drain-timeout", metavar="SECONDS", help=key_help("drain_timeout", "s")
    )),
    ("poll_timeout", int | None, typer.Option(
        None, "--poll-timeout", metavar="MS", help=key_help("poll_timeout", "ms")
    )),
    ("user", str | None, typer.Option(
        None, "--user", metavar="NAME", help=key_help("user", default="the runner's own (as root: warned)")
    )),
    ("group", str | None, typer.Option(
        None, "--group", metavar="NAME", help=key_help("group", default="the user's primary group")
    )),
    ("state_dir", str | None, typer.Option(
        None, "--state-dir", metavar="DIR", help=key_help("state_dir", default=STATE_DIR_DEFAULT)
    )),
    ("log_format", str | None, typer.Option(
        None, "--log-format", metavar="text|json", help=key_help("log_format")
    )),
    # #20 metrics endpoint
    ("metrics_port", int | None, typer.Option(
        None, "--metrics-port", metavar="PORT", help=key_help("metrics_port", default="off")
    )),
    ("metrics_host", str | None, typer.Option(
        None, "--metrics-host", metavar="ADDR", help=key_help("metrics_host")
    )),
    ("metrics_task_type_label", str | None, typer.Option(
        None, "--metrics-task-type-label", metavar="taskType|task_type",
        help=key_help("metrics_task_type_label"),
    )),
    # issue 19: resource limits per task tree, and the cgroup mechanism
    ("memory_max", str | None, typer.Option(
        None, "--memory-max", metavar="SIZE", help=key_help("memory_max", default="none")
    )),
    ("pids_max", int | None, typer.Option(
        None, "--pids-max", metavar="N", help=key_help("pids_max", default="none")
    )),
    ("cpu_max", str | None, typer.Option(
        None, "--cpu-max", metavar="CORES", help=key_help("cpu_max", default="none")
    )),
    ("nofile", int | None, typer.Option(
        None, "--nofile", metavar="N", help=key_help("nofile", default="inherited")
    )),
    ("cgroup", str | None, typer.Option(
        None, "--cgroup", metavar="auto|v2|v1|off", help=key_help("cgroup")
    )),
)  # fmt: skip


def with_run_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command(overrides, **own)`` as a typer command: every run option, then ``command``'s own.

    typer reads a command's options from its signature, so the returned function's signature lists
    them; it hands them to ``command`` as one overrides dict (``leasecore.config.loader.load_config``).
    """
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]  # after overrides
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        *(inspect.Parameter(name, keyword, default=option, annotation=kind)
          for name, kind, option in RUN_OPTIONS),
        *(parameter.replace(kind=keyword) for parameter in own),
    ]

    @functools.wraps(command)
    def with_options(**given: Any) -> None:
        command({name: given.pop(name) for name, _, _ in RUN_OPTIONS}, **given)

    signature = inspect.Signature(parameters, return_annotation=None)
    with_options.__signature__ = signature  # type: ignore[attr-defined]
    with_options.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_options
