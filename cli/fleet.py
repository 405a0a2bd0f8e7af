"""``conductor-run fleet``: every task type's queue and the workers polling it, from the server alone.

The server, its credentials and the config file are found exactly as ``run`` finds them (one
``load_config``); the rows come from ``leasecore.fleet.view`` (pure) over ``leasecore.fleet.source`` (two
GETs). Errors end the command with ``run``'s messages and exit codes.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import typer

from cli import exitcodes
from cli.helptext import config_file_help
from cli.run import _credentials_hint, _fail
from cli.runoptions import typer_option
from leasecore.config.keys import KEYS
from leasecore.config.loader import ResolvedConfig, load_config
from leasecore.errors import ConductorAuthError, ConductorError, ConductorRunError, ConfigError
from leasecore.fleet.view import ACTIVE_POLL_SECONDS, FleetRow, fleet_document, fleet_rows
from leasecore.snapshot import redact_url

if TYPE_CHECKING:  # rich is imported when the command runs, not at registration
    from rich.console import Console, RenderableType

    from leasecore.conductor.client import ConductorClient

REFRESH_SECONDS = 2.0  # --watch: how often the server is asked again (two GETs per refresh)
REQUEST_TIMEOUT_SECONDS = 10.0


def register(app: typer.Typer) -> None:
    """Add the ``fleet`` command to ``app``."""
    app.command("fleet")(fleet)


def fleet(
    config: str | None = typer.Option(None, "--config", metavar="FILE", help=config_file_help()),
    server: str | None = typer_option(KEYS["url"]),
    ca_bundle: str | None = typer_option(KEYS["ca_bundle"]),
    task_types: list[str] | None = typer.Option(
        None, "--task-type", metavar="NAME",
        help="Show only this task type, in every domain (repeatable). Default: every type the server knows.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON document (schema: docs/deployment.md)."),
    watch: bool = typer.Option(
        False, "--watch", "-w",
        help=f"Refresh live (the server is asked every {REFRESH_SECONDS:g} s) until Ctrl-C; off a "
        "terminal, print once.",
    ),
) -> None:
    """Show every task type's queue depth and the workers polling it, across all hosts, from the server.

    One row per task type and domain: the tasks waiting in its queue and each worker's last poll.
    A type with work queued and no poll in the last 10 s is STALLED and listed first. The server
    keeps one poll record per task type and domain (the last poller's), so many workers polling the
    same type show as the one that polled last. Server, credentials and CAs as for run (--server,
    CONDUCTOR_SERVER_URL; CONDUCTOR_AUTH_KEY with CONDUCTOR_AUTH_SECRET or CONDUCTOR_AUTH_SECRET_FILE,
    or CONDUCTOR_AUTH_TOKEN; --ca-bundle, SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE; the
    config file). Exit 3: a configuration error; exit 4: the server cannot be reached or refuses the
    credentials.
    """
    if watch and as_json:
        raise _fail("--watch and --json cannot be combined", exitcodes.USAGE, None)
    wanted = [t.strip() for t in task_types or ()]
    if any(not t for t in wanted):
        raise _fail("--task-type is empty: give a task type name", exitcodes.USAGE, None)
    try:
        overrides = {"config": config, "server": server, "ca_bundle": ca_bundle}
        resolved = load_config(overrides, os.environ, os.getcwd(), require_task=False)
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG, None) from None
    from leasecore.conductor.client import ConductorClient

    url = redact_url(resolved.server.url)
    try:
        client = ConductorClient(
            resolved.server.url,
            auth_key=resolved.server.auth_key,
            auth_secret=resolved.server.auth_secret,
            auth_token=resolved.server.auth_token,
            ca_bundle=resolved.server.ca_bundle,
            timeout_seconds=REQUEST_TIMEOUT_SECONDS,
        )
    except ConfigError as exc:
        raise _fail(f"configuration error: {exc}", exitcodes.CONFIG, None) from None
    with client:
        try:
            rows = load_rows(client, wanted)  # the first answer decides the exit code, --watch too
        except ConductorRunError as exc:
            raise _fail(server_error(exc, url, resolved), _exit_code(exc), None) from None
        if as_json:
            typer.echo(json.dumps(fleet_document(url, rows), indent=2))
            return
        from rich.console import Console

        from cli.status import print_whole

        out = Console()
        if watch and out.is_terminal:
            with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how --watch ends
                run_watch(out, lambda: load_rows(client, wanted), url=url, resolved=resolved,
                          first=rows, stop=threading.Event())
            return
        print_whole(out, render_fleet(rows, url=url, at=_now()))


def load_rows(client: ConductorClient, task_types: Sequence[str]) -> list[FleetRow]:
    """Ask the server and build the rows (now = this host's clock, right after the answers)."""
    from leasecore.fleet.source import read_fleet

    answers = read_fleet(client)
    return fleet_rows(answers.queue_sizes, answers.poll_data, now_ms=int(time.time() * 1000),
                      task_types=task_types)


def server_error(exc: ConductorRunError, url: str, resolved: ResolvedConfig) -> str:
    """The one line ``run`` would print for this error (``cli.run.serve``)."""
    if isinstance(exc, ConfigError):
        return f"configuration error: {exc}"
    if isinstance(exc, ConductorAuthError):
        if exc.without_credentials:
            return f"the server at {url} wants credentials: {exc}"
        return f"the server at {url} refused our credentials: {exc}. {_credentials_hint(resolved)}"
    if isinstance(exc, ConductorError):
        return f"server unreachable at {url}: {exc}"
    return str(exc)


def _exit_code(exc: ConductorRunError) -> int:
    if isinstance(exc, ConfigError):
        return exitcodes.CONFIG
    return exitcodes.UNREACHABLE if isinstance(exc, ConductorError) else exitcodes.UNEXPECTED


def _now() -> datetime:
    return datetime.now(UTC)


def render_fleet(
    rows: Sequence[FleetRow], *, url: str, at: datetime, problem: str | None = None
) -> RenderableType:
    """The table: one row per task type and domain, stalled ones first (already sorted)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    stalled = sum(1 for row in rows if row.stalled)
    title = Text(f"fleet at {url}", style="bold")
    title.append(f"  {at.strftime('%H:%M:%S')} UTC", style="dim")
    if stalled:
        title.append(f"  {stalled} stalled", style="bold red")
    table = Table(title=title, title_justify="left", show_edge=False)
    table.add_column("task type", no_wrap=True)
    table.add_column("domain", no_wrap=True)
    table.add_column("queued", justify="right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("workers (last poll)", overflow="fold")
    styles = {"stalled": "bold red", "active": "green", "idle": "dim"}
    for row in rows:
        workers = Text()
        for i, poll in enumerate(row.workers):
            if i:
                workers.append("\n")
            recent = poll.last_poll_age_seconds <= row.active_seconds
            workers.append(poll.worker_id or "(no worker id)", style="" if recent else "dim")
            workers.append(f"  {_age(poll.last_poll_age_seconds)} ago", style="dim")
        if not row.workers:
            workers.append("(no poller)", style="dim")
        table.add_row(
            Text(row.task_type),
            Text("(default)", style="dim") if row.domain is None else Text(row.domain or '""'),
            Text(str(row.queue_depth)),
            Text(row.state.upper() if row.stalled else row.state, style=styles[row.state]),
            workers,
        )
    parts: list[RenderableType] = [table]
    if not rows:
        parts.append(Text("no task queues and no polls on this server yet", style="dim"))
    parts.append(Text(f"stalled: work queued and no poll in the last {ACTIVE_POLL_SECONDS:g} s", style="dim"))
    if problem is not None:
        parts.append(Text(f"last refresh failed: {problem}", style="yellow"))
    return Group(*parts)


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"
    return f"{int(seconds // 86400)} d"


def run_watch(
    console: Console,
    load: Callable[[], list[FleetRow]],
    *,
    url: str,
    resolved: ResolvedConfig,
    first: list[FleetRow],
    stop: threading.Event,
    refresh_seconds: float = REFRESH_SECONDS,
) -> None:
    """Show the live table until ``stop`` is set (or Ctrl-C); a failed refresh keeps the last rows
    and says why under them, and the next refresh tries again."""
    from rich.live import Live

    rows, at, problem = first, _now(), None
    with Live(render_fleet(rows, url=url, at=at), console=console, auto_refresh=False,
              redirect_stdout=False, redirect_stderr=False) as live:
        live.refresh()
        while not stop.wait(refresh_seconds):
            try:
                rows, at, problem = load(), _now(), None
            except ConductorRunError as exc:
                problem = server_error(exc, url, resolved)
            live.update(render_fleet(rows, url=url, at=at, problem=problem), refresh=True)
