"""The live view of ``conductor-run run`` on a terminal: the tasks in flight, refreshed in place.

Fed from the runner's in-memory snapshot (``run_worker(on_snapshot=...)``, called on the runner's
main thread: it only stores the value) and drawn by rich's refresh thread with ``cli/render.py``'s
renderables, the same as ``conductor-run status``. Log lines go through the same console, so they
scroll above the live table instead of tearing it. Not used off a terminal or with JSON logs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from cli.render import render_status
from leasecore.snapshot import RunnerSnapshot
from leasecore.state.statefile import SnapshotRecord

REFRESH_PER_SECOND = 2


def wants_live_view(console: Console, log_format: str) -> bool:
    """A live view only on a real terminal, and only with text logs (JSON logs are for machines)."""
    return log_format == "text" and console.is_terminal and not console.is_dumb_terminal


class LiveView:
    """The newest snapshot of this runner, and how to show it."""

    def __init__(self, console: Console, *, now: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.console = console
        self._now = now
        self._snapshot: RunnerSnapshot | None = None

    def update(self, snapshot: RunnerSnapshot) -> None:
        """Keep ``snapshot`` for the next refresh (one attribute store: safe from any thread)."""
        self._snapshot = snapshot

    def renderable(self) -> RenderableType:
        """This runner as ``conductor-run status`` shows it, at ``now``."""
        snapshot = self._snapshot
        if snapshot is None:
            return Text("starting...", style="dim")
        record = SnapshotRecord(Path("(this runner)"), snapshot.runner.pid, snapshot, None, False)
        return render_status([record], self._now())

    @contextmanager
    def showing(self) -> Iterator[None]:
        """Show the view inside the block; it disappears when the block ends (the logs stay)."""
        with Live(get_renderable=self.renderable, console=self.console, refresh_per_second=REFRESH_PER_SECOND,
                  transient=True, redirect_stdout=False, redirect_stderr=False):
            yield


class ConsoleLogHandler(logging.Handler):
    """Writes formatted log lines through a rich console (above a live view, never through it)."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record)
            self.console.print(Text(line), soft_wrap=True, highlight=False)
        except Exception:  # logging's contract: a handler never raises into the caller
            self.handleError(record)
