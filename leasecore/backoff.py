"""Capped exponential backoff with jitter (pure: the random source is passed in).

The product's one backoff: heartbeat retries (``Backoff(1.0, 1.5, 2.0)`` gives 1.0 s, 1.5 s, 2.0 s,
2.0 s, ...), the poll loop's waits after empty and failed polls (``pollpolicy.PollBackoff``) and the
waits between attempts of a final update (``lease.finalfailure.REPORT_BACKOFF``). Owns no state,
sleeps never and reads no clock.

Jitter only ever *shortens* a delay (by up to ``jitter_ratio``): the nominal delay stays an upper
bound, so a heartbeat retry is never later than planned, and many workers that failed at the same
moment (a server outage) spread their retries instead of hammering the server in step.

    >>> backoff = Backoff(initial_seconds=1.0, multiplier=1.5, max_seconds=2.0)
    >>> [backoff.delay(n) for n in (1, 2, 3, 4)]
    [1.0, 1.5, 2.0, 2.0]
    >>> Backoff(1.0, 2.0, 8.0, jitter_ratio=0.5).delay(3, random_value=0.5)
    3.0

Threads: any (no state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from leasecore.errors import ConfigError

__all__ = ["Backoff"]


@dataclass(frozen=True, eq=False)
class Backoff:
    """Delay before retry number ``attempt`` (1-based): ``initial * multiplier**(attempt-1)``, capped."""

    initial_seconds: float = 1.0
    multiplier: float = 2.0
    max_seconds: float = 30.0
    jitter_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.initial_seconds <= 0:
            raise ConfigError(f"backoff initial delay must be > 0, got {self.initial_seconds}")
        if self.multiplier < 1:
            raise ConfigError(f"backoff multiplier must be >= 1, got {self.multiplier}")
        if self.max_seconds < self.initial_seconds:
            raise ConfigError(
                f"backoff cap ({self.max_seconds}) must be >= the initial delay ({self.initial_seconds})"
            )
        if not 0 <= self.jitter_ratio < 1:
            raise ConfigError(f"backoff jitter ratio must be in [0, 1), got {self.jitter_ratio}")

    def nominal(self, attempt: int) -> float:
        """The delay before retry ``attempt`` without jitter."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        delay = self.initial_seconds
        if self.multiplier == 1:
            return delay
        # Multiply step by step (not ** with a huge exponent) so attempt 10_000 cannot overflow.
        for _ in range(attempt - 1):
            delay *= self.multiplier
            if delay >= self.max_seconds:
                return self.max_seconds
        return min(delay, self.max_seconds)

    def delay(self, attempt: int, random_value: float = 0.0) -> float:
        """The delay before retry ``attempt``, shortened by ``jitter_ratio * random_value``.

        ``random_value`` is a draw from [0, 1] (e.g. ``random.random()``); 0 means no jitter, 1 the
        shortest delay (still above 0: the ratio is below 1).
        """
        if not 0 <= random_value <= 1:
            raise ValueError(f"random_value must be in [0, 1], got {random_value}")
        return self.nominal(attempt) * (1.0 - self.jitter_ratio * random_value)

    def delays(self, random: Callable[[], float] = lambda: 0.0) -> Iterator[float]:
        """An endless sequence of delays for attempts 1, 2, 3, ... (for a retry loop)."""
        attempt = 1
        while True:
            yield self.delay(attempt, random())
            attempt += 1
