"""``conductor-run status``: what every runner on this host is doing, from their snapshot files."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from cli import exitcodes
from cli.helptext import STATE_DIR_DEFAULT
from leasecore.clock import SystemClock
from leasecore.config.loader import CONFIG_ENV, DEFAULT_CONFIG_NAME, find_config_file, load_config
from leasecore.errors import ConfigError
from leasecore.state.statefile import (
    SnapshotRecord,
    default_state_dir,
    find_tasks,
    prune_stale,
    read_snapshots,
    status_document,
)

if TYPE_CHECKING:  # rich and the renderers are imported when the command runs, not at registration
    from rich.console import Console, RenderableType

REFRESH_PER_SECOND = 4
RELOAD_SECONDS = 0.5  # how often --watch re-reads the files; relative times tick at every refresh
_UNBOUNDED_WIDTH = 1_000_000  # "as wide as it needs": what a renderable is measured in, off a terminal


def register(app: typer.Typer) -> None:
    """Add the ``status`` command to ``app``."""
    app.command("status")(status)


def status(
    task_id: str | None = typer.Argument(None, metavar="TASK_ID", hidden=True),
    watch: bool = typer.Option(
        False, "--watch", "-w",
        help=f"Refresh live ({REFRESH_PER_SECOND}x a second, files re-read every {RELOAD_SECONDS:g} s) "
        "until Ctrl-C; off a terminal, print once.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON document (schema: docs/deployment.md)."),
    state_dir: Path | None = typer.Option(
        None,
        "--state-dir",
        metavar="DIR",
        readable=False,  # checked by check_state_dir: exit 3 with its reason, not click's exit 2
        help="Where runners publish snapshots. Default: $CONDUCTOR_RUN_STATE_DIR, else the config file's "
        f"state_dir, else {STATE_DIR_DEFAULT}.",
    ),
    config: str | None = typer.Option(
        None, "--config", metavar="FILE",
        help="Config file whose [worker] state_dir to read (found as run finds it: default "
        f"./{DEFAULT_CONFIG_NAME} when present; env {CONFIG_ENV}).",
    ),
    prune: bool = typer.Option(False, "--prune", help="Delete snapshots of runners whose process is gone."),
) -> None:
    """Show every runner on this host: tasks, child pids, lease health, server reachability.

    With TASK_ID (a task id, or a unique prefix of one): that task with its recent output; exit 7
    when no runner on this host has it.
    """
    from rich.console import Console

    from cli.render import render_view

    out = Console()
    err = Console(stderr=True, highlight=False)
    if watch and as_json:
        raise _fail("--watch and --json cannot be combined", exitcodes.USAGE)
    if task_id is not None and not task_id.strip():
        raise _fail("TASK_ID is empty: give a task id or a unique prefix of one", exitcodes.USAGE)
    try:
        directory = state_dir.expanduser() if state_dir is not None else _configured_state_dir(config)
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG) from None
    clock = SystemClock()

    def load() -> list[SnapshotRecord]:
        return read_snapshots(directory, clock.now())

    try:
        records = load()
        if prune:
            removed = prune_stale(directory, records)
            (err if as_json else out).print(f"Removed {len(removed)} stale snapshot file(s).", markup=False)
            records = load()
        if as_json:
            doc = status_document(records, clock.now(), state_dir=directory, task_id=task_id)
            typer.echo(json.dumps(doc, indent=2))
        elif watch and out.is_terminal:
            run_watch(out, load, clock.now, task_id=task_id, state_dir=directory, stop=threading.Event())
            return
        else:
            print_whole(out, render_view(records, clock.now(), task_id=task_id, state_dir=directory))
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG) from None
    except KeyboardInterrupt:
        raise typer.Exit(exitcodes.OK) from None  # Ctrl-C is how --watch ends
    if task_id is not None:
        raise typer.Exit(_task_exit_code(records, task_id, as_json=as_json))


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Print ``renderable``; off a terminal, as wide as it needs so that no line is cut or wrapped.

    A pipe or a file has no width (rich would assume 80 columns, or $COLUMNS) and is read by grep,
    awk or ``less -S``: each table row stays one line with every cell whole.
    """
    if not console.is_terminal:
        from rich.measure import Measurement

        unbounded = console.options.update_width(_UNBOUNDED_WIDTH)
        console.width = max(1, Measurement.get(console, unbounded, renderable).maximum)
    console.print(renderable)


def _fail(message: str, code: int) -> typer.Exit:
    """One unwrapped line on stderr, prefixed like every other command's errors."""
    typer.echo(f"conductor-run: {message}", err=True)
    return typer.Exit(code)


def _configured_state_dir(config: str | None) -> Path:
    """The state directory ``run`` would use here: $CONDUCTOR_RUN_STATE_DIR, else the config file's
    ``state_dir`` (the file found as ``run`` finds it), else the default. Without a config file
    nothing is loaded (a status needs no task, server or credentials)."""
    environ, cwd = os.environ, os.getcwd()
    found = find_config_file(config, environ, cwd)  # ConfigError for a --config that names no file
    if found is None or environ.get("CONDUCTOR_RUN_STATE_DIR"):  # the variable wins over the file
        return default_state_dir(environ)
    resolved = load_config({"config": config}, environ, cwd, require_task=False)
    configured = resolved.runner.state_dir
    return Path(configured).expanduser() if configured else default_state_dir(environ)


def _task_exit_code(records: Sequence[SnapshotRecord], task_id: str, *, as_json: bool) -> int:
    matches = len(find_tasks(records, task_id))
    if matches == 0:
        return exitcodes.NOT_FOUND
    if matches > 1 and not as_json:
        return exitcodes.USAGE  # an ambiguous prefix; --json lists every match instead
    return exitcodes.OK


def run_watch(
    console: Console,
    load: Callable[[], Sequence[SnapshotRecord]],
    now: Callable[[], datetime],
    *,
    task_id: str | None,
    state_dir: Path,
    stop: threading.Event,
    reload_seconds: float = RELOAD_SECONDS,
    auto_refresh: bool = True,
) -> None:
    """Show the live view until ``stop`` is set (or Ctrl-C): files re-read every ``reload_seconds``.

    Rich's refresh thread renders ``latest`` with a fresh ``now()`` several times a second, so
    relative times tick between reloads; only this thread touches the files.
    """
    from rich.live import Live

    from cli.render import render_view

    latest = [load()]

    def current() -> RenderableType:
        return render_view(latest[0], now(), task_id=task_id, state_dir=state_dir)

    with Live(
        get_renderable=current,
        console=console,
        auto_refresh=auto_refresh,
        refresh_per_second=REFRESH_PER_SECOND,
        redirect_stdout=False,
        redirect_stderr=False,
    ) as live:
        live.refresh()  # show the first state now, not at the first tick
        while not stop.wait(reload_seconds):
            latest[0] = load()
            if not auto_refresh:
                live.refresh()
