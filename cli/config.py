"""``conductor-run config``: print the effective configuration and where each value came from.

Secrets never reach the output: the keys declared sensitive (``auth_key``, ``auth_secret``,
``auth_token``), a password in the server URL, and the values of ``env`` entries named in a task's
``secrets`` or named like a credential (``*TOKEN*``, ``*PASSWORD*``, ``*SECRET*``, ``*API_KEY*``,
...) are masked. ``effective_view`` is pure.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import typer

from cli import exitcodes
from cli.runoptions import with_run_options
from leasecore.config.keys import keys_of
from leasecore.config.loader import ResolvedConfig, Source, TaskSettings, load_config
from leasecore.errors import ConfigError
from leasecore.lease import KILL_GRACE_SHARE

if TYPE_CHECKING:  # rich is imported when a table is printed, not when the command is registered
    from rich.console import Console
    from rich.table import Table

MASK = "****"
# env entries whose names look like credentials are masked even when not listed in `secrets`.
_SECRET_NAME = re.compile(r"passw|passwd|secret|token|credential|private|api_?key|access_?key|auth", re.I)

Entry = dict[str, Any]  # {"value": ..., "source": "..."}


def effective_view(config: ResolvedConfig) -> dict[str, Any]:
    """The resolved configuration as plain data (JSON-ready), secrets masked."""
    server = config.server
    server_values = {name: getattr(server, name) for name in (spec.name for spec in keys_of("server"))}
    for spec in keys_of("server"):
        if spec.sensitive:  # a credential is only ever shown as set or not
            server_values[spec.name] = MASK if server_values[spec.name] else None
    server_values["url"] = _mask_url(server.url)
    return {
        "config_file": config.config_file,
        "server": _entries(server_values, server.sources),
        "runner": _entries(_values_of(config.runner), config.runner.sources),
        "tasks": [_task_view(task) for task in config.tasks],
        "warnings": list(config.warnings),
    }


def _task_view(task: TaskSettings) -> dict[str, Any]:
    values = _values_of(task)
    values["env"] = {name: MASK if _is_secret(name, task) else value for name, value in task.env.items()}
    settings = _entries(values, task.sources)
    settings["kill_grace_cap"] = kill_grace_cap_entry(task)
    return {"type": task.type, "settings": settings}


def kill_grace_cap_entry(task: TaskSettings) -> Entry:
    """What ``kill_grace`` becomes per task: capped at a quarter of the lease (DESIGN.md §4). R comes
    with each task from the server, so the cap is a rule here, and a number when heartbeat_timeout
    (an upper bound of every lease) is set."""
    share = KILL_GRACE_SHARE
    rule = (f"min(kill_grace, {share:g} x the task's lease: responseTimeoutSeconds or a shorter "
            "heartbeat_timeout; and, with lease extension, lease - margin - 1.25 s for the heartbeats)")
    if task.heartbeat_timeout:  # the most any lease is; its real cap may be lower (a shorter R)
        cap = share * task.heartbeat_timeout
        at_most = min(task.kill_grace, cap)
        note = "capped" if task.kill_grace > cap else "not capped"
        return {"value": f"at most {at_most:g}s ({note}: {rule})", "source": "derived"}
    return {"value": rule, "source": "derived"}


def _is_secret(name: str, task: TaskSettings) -> bool:
    """Listed in ``secrets``, or named like a credential (over-masking a printout costs nothing)."""
    return name in task.secrets or _SECRET_NAME.search(name) is not None


def _values_of(settings: Any) -> dict[str, Any]:
    values = {item.name: getattr(settings, item.name) for item in fields(settings) if item.name != "sources"}
    return {name: list(value) if isinstance(value, tuple) else value for name, value in values.items()}


def _entries(values: Mapping[str, Any], sources: Mapping[str, Source]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for name, value in values.items():
        source = sources.get("command" if name == "shell" else name, Source("default"))
        if name in ("command", "shell") and value is None:
            continue  # only the one that is set
        entries[name] = {"value": value, "source": str(source)}
    return entries


def cgroup_view(config: ResolvedConfig) -> dict[str, Any]:
    """The cgroup mechanism ``run`` would use here (detected now), why not a better one, and the
    limits it would enforce per process rather than per tree, or not at all."""
    from leasecore.runner import treegroups
    setup = treegroups.setup_for(config)
    return {"mechanism": setup.mechanism, "detail": setup.describe(),
            "limits_per_tree": sorted(setup.limits), "notes": treegroups.limit_notes(config, setup)}


def _mask_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}:{MASK}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _render(view: Mapping[str, Any], console: Console) -> None:
    from rich.text import Text

    where = view["config_file"] or "(none: flags, environment and defaults only)"
    console.print(Text(f"config file: {where}"))
    console.print(_table("server", view["server"]))
    console.print(_table("runner", view["runner"]))
    for task in view["tasks"]:
        console.print(_table(f"task {task['type']}", task["settings"]))
    if not view["tasks"]:
        console.print(
            Text("no task configured: add a [[task]] to the file, or give --task-type and a command")
        )
    for warning in view["warnings"]:
        console.print(Text(f"warning: {warning}", style="yellow"))
    groups = view.get("cgroups")
    if groups:
        console.print(Text(f"task trees: {groups['detail']}"))
        for note in groups["notes"]:
            console.print(Text(f"warning: {note}", style="yellow"))


def _table(title: str, entries: Mapping[str, Entry]) -> Table:
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(title, style="bold"), title_justify="left", show_edge=False)
    table.add_column("key", no_wrap=True)
    table.add_column("value", overflow="fold")
    table.add_column("source", overflow="fold")
    for name, entry in entries.items():
        style = "dim" if entry["source"] == "default" else ""
        table.add_row(Text(name), Text(_show(entry["value"])), Text(entry["source"]), style=style)
    return table


def _show(value: Any) -> str:
    if value is None:
        return "(unset)"
    return json.dumps(value) if isinstance(value, str | list | dict | bool) else str(value)


def config_command(
    overrides: dict[str, Any],
    as_json: bool = typer.Option(False, "--json", help="Print JSON for scripts."),
) -> None:
    """Print the effective configuration per task and where each value came from (secrets masked).

    Takes the options of run: `conductor-run config OPTIONS` shows what `conductor-run run OPTIONS`
    would use.
    """
    try:
        resolved = load_config(overrides, os.environ, os.getcwd(), require_task=False)
        view = effective_view(resolved)
        view["cgroups"] = cgroup_view(resolved)
    except ConfigError as exc:
        typer.echo(f"conductor-run: configuration error: {exc}", err=True)
        raise typer.Exit(exitcodes.CONFIG) from None
    if as_json:
        typer.echo(json.dumps(view, indent=2))
    else:
        from rich.console import Console

        _render(view, Console())


def register(app: typer.Typer) -> None:
    app.command("config")(with_run_options(config_command))
