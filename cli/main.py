"""The ``conductor-run`` typer app: registers every command; each lives in its own module."""

from __future__ import annotations

import typer

from leasecore import __version__

app = typer.Typer(
    name="conductor-run",
    help="Run any shell command or script as a Conductor worker: poll, run, heartbeat, fence, report.",
    no_args_is_help=True,
    add_completion=False,
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


def _register() -> None:
    # Each command module exposes ``register(app)``; importing them here keeps main.py the one list.
    from cli import commands

    commands.register_all(app)


def main() -> None:
    """Console-script entry point."""
    _register()
    app(prog_name="conductor-run")  # the same usage lines under `python -m cli`
