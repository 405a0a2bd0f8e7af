"""The list of commands. Each module adds itself with one line here."""

from __future__ import annotations

import typer


def register_all(app: typer.Typer) -> None:
    """Register every command module on ``app``."""
    # One line per command module, e.g.:  from cli import server; server.register(app)
    from cli import server; server.register(app)  # noqa: E702, I001
    from cli import status; status.register(app)  # noqa: E702, I001
    from cli import init; init.register(app)  # noqa: E702, I001
    from cli import config; config.register(app)  # noqa: E702, I001
    from cli import run; run.register(app)  # noqa: E702, I001
    from cli import demo; demo.register(app)  # noqa: E702, I001
