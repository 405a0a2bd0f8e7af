"""``conductor-run server``: run the embedded Conductor-compatible server in the foreground."""

from __future__ import annotations

import queue
import signal
import sys

import typer

from cli import exitcodes
from leasecore.errors import ConfigError
from leasecore.runner.loop.signals import SHUTDOWN_SIGNALS, capture_signals

HELP = (
    "Run the embedded, in-memory Conductor-compatible server (for trying things out and for tests).\n\n"
    "NOT for production: state lives in memory and is lost on exit. It implements what a worker and a "
    "test harness use: task and workflow definitions (SIMPLE tasks in sequence), start / get / terminate "
    "/ decide, poll and batch long-poll, update, extendLease, logs, poll data, health, optional token "
    "auth.\n\n"
    "Memory is bounded: at most --max-finished-workflows finished workflows are kept (oldest finished "
    "forgotten first, with their tasks and logs: a GET of one is then a 404) and each task's last 1000 "
    "log entries.\n\n"
    "Timing: --sweep-mode ideal (default) checks every timeout promptly at its deadline; coarse imitates "
    "the real SQLite-backed Conductor server, where later re-checks of a workflow come 60-120 s late.\n\n"
    "Prints the API base URL (http://HOST:PORT/api) on stdout once listening; Ctrl-C or SIGTERM stops it."
)


def server(
    host: str = typer.Option(
        "127.0.0.1", "--host", metavar="ADDRESS", help="Address to bind (loopback by default)."
    ),
    port: int = typer.Option(
        8080, "--port", min=0, max=65535, metavar="PORT", help="Port to bind; 0 picks a free one."
    ),
    auth_key: str | None = typer.Option(
        None,
        "--auth-key",
        metavar="KEY",
        envvar="CONDUCTOR_RUN_SERVER_AUTH_KEY",
        help="Enable token auth: the keyId clients exchange at POST /api/token.",
    ),
    auth_secret: str | None = typer.Option(
        None,
        "--auth-secret",
        metavar="SECRET",
        envvar="CONDUCTOR_RUN_SERVER_AUTH_SECRET",
        help="The keySecret that goes with --auth-key (prefer the environment variable: a flag shows in ps).",
        show_default=False,
    ),
    token_ttl: float = typer.Option(
        3600.0, "--token-ttl", min=0.001, metavar="SECONDS",
        help="Seconds before an issued token expires (EXPIRED_TOKEN)."
    ),
    sweep_mode: str = typer.Option(
        "ideal", "--sweep-mode", metavar="ideal|coarse",
        help="Timeout checks: 'ideal' (prompt) or 'coarse' (like the real server)."
    ),
    max_finished_workflows: int = typer.Option(
        10_000,
        "--max-finished-workflows",
        min=1,
        metavar="N",
        help="Finished workflows kept in memory; beyond it the oldest finished is forgotten (then a 404).",
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every request to stderr."),
) -> None:
    from leasecore.server import EmbeddedServer  # only when serving: `run` never loads the server

    if sweep_mode not in ("ideal", "coarse"):
        _fail(f"--sweep-mode must be 'ideal' or 'coarse', not {sweep_mode!r}", exitcodes.USAGE)
    if (auth_key is None) != (auth_secret is None):
        _fail("--auth-key and --auth-secret go together: give both or neither", exitcodes.USAGE)
    if not host.strip():  # the socket would bind every interface while the URL printed says loopback
        _fail("--host is empty: give an address to bind (127.0.0.1: this host only; 0.0.0.0: every "
              "interface)", exitcodes.USAGE)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    srv = EmbeddedServer(
        host,
        port,
        auth_key=auth_key,
        auth_secret=auth_secret,
        token_ttl_seconds=token_ttl,
        sweep_mode="coarse" if sweep_mode == "coarse" else "ideal",
        log=log if verbose else None,
        max_finished_workflows=max_finished_workflows,
    )
    # The handler only records (SimpleQueue.put is reentrant); the main thread acts.
    signals: queue.SimpleQueue[int] = queue.SimpleQueue()

    def on_signal(signum: int, _count: int) -> None:
        signals.put(signum)

    try:
        srv.start()
    except ConfigError as exc:
        _fail(str(exc), exitcodes.CONFIG)
    try:
        # SIGHUP stops the server too (a runner reloads on it instead: SHUTDOWN_SIGNALS has no SIGHUP).
        with capture_signals(on_signal, (*SHUTDOWN_SIGNALS, signal.SIGHUP)):
            typer.echo(srv.url)
            mode = "auth on" if auth_key else "no auth"
            log(
                f"embedded Conductor server listening on {srv.url} ({mode}, {sweep_mode} sweep); Ctrl-C stops"
            )
            if srv.every_interface:  # the URL above is this host's way in; say what else reaches it
                exposed = "" if auth_key else ", and without auth anyone who can reach this host may use it"
                log(f"warning: bound to {host}, every interface: not only this host{exposed}")
            signum = signals.get()
    finally:
        srv.stop()
    codes = {signal.SIGINT: exitcodes.SIGINT, signal.SIGHUP: exitcodes.SIGHUP}
    raise typer.Exit(codes.get(signal.Signals(signum), exitcodes.SIGTERM))


def _fail(message: str, code: int) -> None:
    typer.echo(f"conductor-run server: {message}", err=True)
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("server", help=HELP)(server)
