"""The list of commands, in the order ``conductor-run --help`` shows them."""

from __future__ import annotations

import typer

from cli import config, demo, fleet, init, operate, run, server, status, workerstdio


def register_all(app: typer.Typer) -> None:
    """Register every command module on ``app``: the main job first, helpers after."""
    for module in (run, workerstdio, status, operate, fleet, server, demo, init, config):
        module.register(app)
