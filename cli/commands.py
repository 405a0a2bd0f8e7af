"""The list of commands. Each module adds itself with one line here."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    """Register every command module on ``app``."""
    # One line per command module, e.g.:  from cli import server; server.register(app)
