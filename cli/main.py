"""The ``conductor-run`` typer app: registers every command; each lives in its own module."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

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


def _register() -> None:
    # Each command module exposes ``register(app)``; importing them here keeps main.py the one list.
    from cli import commands

    commands.register_all(app)


COMPLETE_VAR = "_CONDUCTOR_RUN_COMPLETE"
COMPLETION_SHELLS = ("bash", "zsh", "fish")


def _typer_completion_instruction(environ: MutableMapping[str, str]) -> None:
    """Accept click's spelling of the completion instruction (``bash_source``, ``zsh_complete``...)
    as well as typer's own (``source_bash``): click documents the first, typer only reads the second."""
    value = environ.get(COMPLETE_VAR, "")
    shell, _, instruction = value.partition("_")
    if shell in COMPLETION_SHELLS and instruction in ("source", "complete"):
        environ[COMPLETE_VAR] = f"{instruction}_{shell}"


def main() -> None:
    """Console-script entry point."""
    _typer_completion_instruction(os.environ)
    from cli import reexec

    reexec.allow()  # `run` may re-execute itself without secrets in its environment (cli/reexec.py)
    _register()
    app(prog_name="conductor-run")  # the same usage lines under `python -m cli`
