"""The ownership checks' budget: at most ``rate`` checks per second start, for the whole runner.

Each task's lease asks for a ``GET /api/tasks/{id}`` every ``ownership_check_interval`` seconds (5 s):
that is how a task terminated, cancelled or timed out on the server is noticed, since a heartbeat to a
CANCELED task is a silent 200. Per task that is cheap; 1000 long tasks made it 200 GETs per second
from one runner. The lease engine takes the checks that are due in order (first come, first served)
and starts one only when this budget allows, so the total stays at or under ``rate`` per second
whatever the number of tasks. A task's next check is due ``ownership_check_interval`` after its last
one ended, and then waits its turn, at most tasks in flight / rate; in a steady state each task is
checked every

    max(ownership_check_interval, tasks in flight / rate)   seconds (plus one check's latency),

and never later than ownership_check_interval + tasks / rate after the last.

With the default 20 per second: up to 100 tasks keep their 5 s interval; 1000 tasks are each checked
every ~50 s. A due check waits at most ``max_queue_seconds`` (the runner's most leases / rate) for its
turn, and the wait before a re-delivered task starts counts that twice (the first check and the
confirming one of a previous holder on a runner configured like this one), so the budget never lets
two copies of a task run at once. The cost is in noticing a server-side termination: for many
tasks it takes up to that period instead of 5 s (plus kill_grace), and a re-delivered task waits
longer for its previous holder. Heartbeats never wait for this budget, nor are they counted in it:
the lease itself never waits. ``rate`` 0 turns the budget off (every check goes when due).

A token bucket holding at most ``burst`` tokens (default: one second's worth, at least 1): a quiet
runner's first checks go at once. Pure: the caller passes ``now`` (the engine's monotonic clock).

Threads: the lease engine's (its send queue), always under the engine's lock: the bucket has none of its own.
"""

from __future__ import annotations

import math

__all__ = ["CheckBudget", "check_period", "max_queue_seconds"]


def check_period(interval_seconds: float, tasks: int, rate_per_second: float) -> float:
    """Seconds between two checks of one task, with ``tasks`` in flight sharing ``rate`` checks/s
    (``rate`` 0: no budget). The formula of docs/leases.md."""
    if rate_per_second <= 0 or tasks <= 0:
        return interval_seconds
    return max(interval_seconds, tasks / rate_per_second)


def max_queue_seconds(most_leases: int, rate_per_second: float) -> float:
    """The longest a due check may wait for the budget: each lease has at most one check queued, and
    they go first come, first served, ``rate`` a second (0: no budget, no wait). The re-delivery wait
    (``leasecore.handover``) counts it: a previous holder on a runner like this one notices a
    re-delivery that much later, at most."""
    if rate_per_second <= 0 or most_leases <= 0:
        return 0.0
    return most_leases / rate_per_second


class CheckBudget:
    """At most ``rate_per_second`` ownership checks start per second (0: no limit). Not thread-safe:
    the lease engine calls it under its lock."""

    def __init__(self, rate_per_second: float, *, burst: float | None = None, now: float = 0.0) -> None:
        if not (rate_per_second >= 0 and math.isfinite(rate_per_second)):
            raise ValueError(f"the ownership check rate must be a number >= 0, not {rate_per_second!r}")
        self.rate = float(rate_per_second)
        self.burst = max(1.0, self.rate if burst is None else float(burst))
        self._tokens = self.burst
        self._at = now
        self.started = 0  # checks started through the budget (for metrics and tests)

    @property
    def unlimited(self) -> bool:
        return self.rate == 0

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now

    def available(self, now: float) -> int:
        """How many checks may start at ``now`` (a large number when unlimited)."""
        if self.unlimited:
            return 1 << 30
        self._refill(now)
        return int(self._tokens + 1e-9)

    def wait_seconds(self, now: float) -> float:
        """Seconds until the next check may start (0: now)."""
        if self.available(now) >= 1:
            return 0.0
        return max(0.0, (1.0 - self._tokens) / self.rate)

    def take(self, now: float) -> None:
        """A check starts at ``now``: spend one token (callers check ``available`` first)."""
        self.started += 1
        if self.unlimited:
            return
        self._refill(now)
        self._tokens = max(0.0, self._tokens - 1.0)
