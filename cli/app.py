"""The ``conductor-run`` typer app: registers every command; each lives in its own module.

Imported only when typer reads the command line (``cli.main.main``): a plain ``run`` starts without
typer (``cli.fastrun``).
"""

from __future__ import annotations

import typer

from leasecore import __version__

app = typer.Typer(
    name="conductor-run",
    help="Run any shell command or script as a Conductor worker: poll, run, heartbeat, fence, report.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion; _CONDUCTOR_RUN_COMPLETE=bash_source etc.
    # Plain click help: readable at 80 columns, and on/off flags are not shown as taking a <bool>.
    rich_markup_mode=None,
    pretty_exceptions_show_locals=False,  # locals can hold credentials
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"conductor-run {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Run any shell command or script as a Conductor worker."""


_registered = False


def register() -> None:
    """Register every command on ``app`` (once): each command module exposes ``register(app)``."""
    global _registered
    if _registered:
        return
    from cli import commands

    commands.register_all(app)
    _registered = True
