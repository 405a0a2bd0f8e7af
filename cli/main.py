"""The console-script entry point: a plain ``run`` without typer, everything else through the app.

The typer app lives in :mod:`cli.app` (``cli.main.app`` still names it, loaded on first use). A
runner lives for weeks, and typer with the pydantic it converts parameters with is about 12 MB of
its idle RSS: :mod:`cli.fastrun` reads a plain ``run`` command line and calls the same ``run``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cli.app import app as app


def __getattr__(name: str) -> Any:
    if name == "app":  # ``from cli.main import app``: the typer app, imported on first use
        from cli.app import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _register() -> None:
    from cli.app import register

    register()


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
    from cli import fastrun, reexec

    reexec.allow()  # `run` may re-execute itself without secrets in its environment (cli/reexec.py)
    overrides = fastrun.plain_run(sys.argv[1:], os.environ)
    if overrides is not None:
        from cli.run import run

        run(overrides)  # ends with SystemExit(code), as under typer
        return  # pragma: no cover - run always raises
    from cli.app import app

    _register()
    app(prog_name="conductor-run")  # the same usage lines under `python -m cli`
