"""Time as a collaborator: decisions read ``monotonic()``, displays and state files read ``now()``.

Owns: the ``Clock`` protocol, ``SystemClock`` (the only code that reads real time; the layering test
allows ``time`` here alone) and ``FakeClock``, which tests advance by hand so that lease and kill
decisions are checked without sleeping. Must not: sleep, or hold state beyond the fake's instant.
Threads: any; ``FakeClock`` is meant for one test thread (or a test that steps the engine itself).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Protocol


class Clock(Protocol):
    """What the core needs to know about time."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; only differences mean anything."""
        ...

    def now(self) -> datetime:
        """Wall-clock time in UTC, for display and for state shared with other processes."""
        ...


class SystemClock:
    """The real clock."""

    # The C function itself, not a method around it: the runner reads it ~40 times per task.
    monotonic = staticmethod(time.monotonic)

    def now(self) -> datetime:
        return datetime.now(UTC)


class FakeClock:
    """A clock that moves only when told to; for tests of the pure core."""

    def __init__(self, start: float = 1000.0, wall: datetime | None = None) -> None:
        self._t = start
        self._wall0 = wall or datetime(2026, 1, 1, tzinfo=UTC)
        self._start = start

    def monotonic(self) -> float:
        return self._t

    def now(self) -> datetime:
        from datetime import timedelta

        return self._wall0 + timedelta(seconds=self._t - self._start)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go back")
        self._t += seconds
