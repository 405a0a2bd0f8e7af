"""``conductor-run pause|resume|reload|drain``: change running runners without a restart.

Each command talks to the runners that publish in a state directory (found as ``status`` finds it:
``--state-dir``, else ``$CONDUCTOR_RUN_STATE_DIR``, else the config file's ``state_dir``, else the
default), or to one (``--runner PID``), through their control sockets (``leasecore.state.control``).
It prints what changed on which runner, and exits 0 when every runner it addressed did it;
``NO_RUNNER`` when none answered; ``REFUSED`` when one refused or did not answer (``cli/exitcodes.py``).
``drain`` then waits for each drained runner to exit (the preStop hook's contract).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from cli import exitcodes
from cli.helptext import STATE_DIR_DEFAULT
from leasecore.config.loader import CONFIG_ENV, DEFAULT_CONFIG_NAME
from leasecore.errors import ConfigError
from leasecore.state.control import (
    ControlError,
    RunnerSocket,
    control_sockets,
    remove_stale,
    send_request,
    socket_path,
)
from leasecore.state.statefile import ProcessState, probe_process

# How long past the runner's own bound (drain deadline + kill grace + its margin) ``drain`` waits for
# it to exit: its last reports (at most 10 s once stopping) and a poll in flight (at most 5 s).
DRAIN_EXIT_SLACK_SECONDS = 30.0
_EXIT_POLL_SECONDS = 0.1


def register(app: typer.Typer) -> None:
    """Add ``pause``, ``resume``, ``reload`` and ``drain`` to ``app``."""
    app.command("pause")(pause)
    app.command("resume")(resume)
    app.command("reload")(reload)
    app.command("drain")(drain)


_STATE_DIR = typer.Option(
    None, "--state-dir", metavar="DIR", readable=False,
    help="Where the runners publish. Default: $CONDUCTOR_RUN_STATE_DIR, else the config file's state_dir, "
    f"else {STATE_DIR_DEFAULT}.",
)
_CONFIG = typer.Option(
    None, "--config", metavar="FILE",
    help=f"Config file whose [worker] state_dir to use (default ./{DEFAULT_CONFIG_NAME} when present; "
    f"env {CONFIG_ENV}).",
)
_RUNNER = typer.Option(None, "--runner", metavar="PID", min=1, help="Only the runner with this pid.")
_TYPES = typer.Argument(None, metavar="TASK_TYPE", show_default=False,
                        help="Task types (none: every one the runner serves).")


def pause(
    task_types: list[str] | None = _TYPES,
    state_dir: Path | None = _STATE_DIR,
    config: str | None = _CONFIG,
    runner: int | None = _RUNNER,
) -> None:
    """Stop polling TASK_TYPEs (all, when none is named) within 1 s; running tasks go on.

    A poll in flight hands back at once whatever it claims. The pause lasts until `resume`, survives
    `reload`, and ends with the process (unless the config file says paused).
    """
    _run_everywhere({"command": "pause", "task_types": task_types or []}, state_dir, config, runner)


def resume(
    task_types: list[str] | None = _TYPES,
    state_dir: Path | None = _STATE_DIR,
    config: str | None = _CONFIG,
    runner: int | None = _RUNNER,
) -> None:
    """Poll TASK_TYPEs again (all, when none is named)."""
    _run_everywhere({"command": "resume", "task_types": task_types or []}, state_dir, config, runner)


def reload(
    state_dir: Path | None = _STATE_DIR,
    config: str | None = _CONFIG,
    runner: int | None = _RUNNER,
) -> None:
    """Re-read the config file each runner started from (as SIGHUP does).

    Concurrency, paused, limits, exit-code policies, timeouts, commands, logging and the metrics
    address apply to tasks started after it; a changed server URL, credential, state_dir, user or
    other restart-only key refuses the whole reload, naming it; a file that does not load changes
    nothing.
    """
    _run_everywhere({"command": "reload"}, state_dir, config, runner)


def drain(
    timeout: float | None = typer.Option(
        None, "--timeout", metavar="SECONDS", min=0,
        help="How long running tasks may take; then they are terminated as at --drain-timeout "
        "(default: the runner's drain_timeout).",
    ),
    state_dir: Path | None = _STATE_DIR,
    config: str | None = _CONFIG,
    runner: int | None = _RUNNER,
) -> None:
    """Stop polling, let running tasks finish and report, and wait for the runner to exit (it exits 0).

    Meant for a Kubernetes preStop hook or a maintenance window.
    """
    _run_everywhere({"command": "drain", "timeout_seconds": timeout}, state_dir, config, runner)


# ---------------------------------------------------------------------------------------------------


def _run_everywhere(request: dict[str, Any], state_dir: Path | None, config: str | None,
                    runner: int | None) -> None:
    directory = _state_dir(state_dir, config)
    sockets = _sockets(directory, runner)
    answered = 0
    failed = False
    drained: list[tuple[RunnerSocket, float]] = []
    for sock in sockets:
        try:
            reply = send_request(sock.path, request)
        except ControlError as exc:
            if exc.stale and remove_stale(sock):
                typer.echo(f"runner {sock.pid}: gone (removed its control socket)", err=True)
                continue
            if exc.stale and runner is None:
                continue  # a runner that is just exiting, say
            typer.echo(f"conductor-run: runner {sock.pid}: {exc}", err=True)
            failed = True
            continue
        answered += 1
        if not reply.get("ok"):
            typer.echo(f"conductor-run: runner {sock.pid} refused: {reply.get('error', 'no reason given')}",
                       err=True)
            failed = True
            continue
        typer.echo(f"runner {sock.pid}: {_describe(request['command'], reply)}")
        if request["command"] == "drain":  # (already stopping too: it is waited for all the same)
            drained.append((sock, float(reply.get("exit_within_seconds") or 0.0)))
    for sock, within in drained:
        if _wait_gone(sock.pid, within + DRAIN_EXIT_SLACK_SECONDS):
            typer.echo(f"runner {sock.pid}: drained and exited")
        else:
            typer.echo(f"conductor-run: runner {sock.pid} has not exited within "
                       f"{within + DRAIN_EXIT_SLACK_SECONDS:.0f} s of the drain", err=True)
            failed = True
    if failed:
        raise typer.Exit(exitcodes.REFUSED)
    if answered == 0:
        where = f"runner {runner}" if runner is not None else "runner"
        typer.echo(f"conductor-run: no {where} answered in {directory}", err=True)
        raise typer.Exit(exitcodes.NO_RUNNER)


def _state_dir(state_dir: Path | None, config: str | None) -> Path:
    from cli.status import _configured_state_dir

    if state_dir is not None:
        return state_dir.expanduser()
    try:
        return _configured_state_dir(config)
    except ConfigError as exc:
        typer.echo(f"conductor-run: configuration error: {exc}", err=True)
        raise typer.Exit(exitcodes.CONFIG) from None


def _sockets(directory: Path, runner: int | None) -> list[RunnerSocket]:
    if runner is not None:
        return [RunnerSocket(runner, socket_path(directory, runner))]
    try:
        return control_sockets(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        typer.echo(f"conductor-run: cannot look into the state directory {directory}: "
                   f"{exc.strerror or exc} (only a runner's own user and root may control it)", err=True)
        raise typer.Exit(exitcodes.NO_RUNNER) from None


def _describe(command: str, reply: dict[str, Any]) -> str:
    changed = [str(c) for c in reply.get("changed") or []]
    paused = [str(t) for t in reply.get("paused") or []]
    now = f" (paused now: {', '.join(paused) if paused else 'none'})"
    if command == "pause":
        return (f"paused {', '.join(changed)}" if changed else "nothing to pause") + now
    if command == "resume":
        return (f"resumed {', '.join(changed)}" if changed else "nothing to resume") + now
    if command == "reload":
        return ("reloaded: " + "; ".join(changed) if changed else "reloaded: nothing changed") + now
    if reply.get("already_stopping"):
        return f"already stopping; waiting for it to exit ({reply.get('running', 0)} task(s) running)"
    return (f"draining: polling stopped, {reply.get('running', 0)} running task(s) may finish within "
            f"{float(reply.get('drain_timeout_seconds') or 0):g} s")


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while probe_process(pid, None) is not ProcessState.GONE:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_EXIT_POLL_SECONDS)
    return True

