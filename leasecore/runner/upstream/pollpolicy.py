"""Pure decisions of the poll loop: how long to wait before the next poll (with the product's one
backoff, ``leasecore.backoff.Backoff``), and when to say so.

No I/O, no threads, no clock reads: the poller thread (``leasecore.runner.upstream.poller``) feeds outcomes in
and sleeps for the delays that come out. Randomness (jitter) is injected so tests are deterministic.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from leasecore.backoff import Backoff


@dataclass(frozen=True, eq=False)
class BackoffPolicy:
    """Delays between polls, in seconds.

    After an empty poll the next one follows after ``empty_base_seconds``, doubling per further empty
    poll up to ``empty_cap_seconds`` (a long poll already waited on the server, so this only matters
    when the server answers at once). After an error the delay starts at ``error_base_seconds`` and
    doubles up to ``error_cap_seconds``: never a tight loop while the server is down. Each delay is
    drawn uniformly from ``[(1 - jitter) * d, d]`` so a fleet of workers does not poll in lockstep.
    """

    empty_base_seconds: float = 0.1
    empty_cap_seconds: float = 1.0
    error_base_seconds: float = 0.5
    error_cap_seconds: float = 10.0
    jitter: float = 0.5


class PollBackoff:
    """Counts consecutive empty polls and errors; says how long to wait before the next poll."""

    def __init__(self, policy: BackoffPolicy | None = None, *, rand: Callable[[], float] = random.random):
        self.policy = policy or BackoffPolicy()
        self._rand = rand
        self.consecutive_empty = 0
        self.consecutive_errors = 0

    def on_tasks(self) -> float:
        """A poll returned work: poll again at once (free slots permitting)."""
        self.consecutive_empty = 0
        self.consecutive_errors = 0
        return 0.0

    def on_empty(self) -> float:
        """A poll returned nothing."""
        self.consecutive_errors = 0
        self.consecutive_empty += 1
        p = self.policy
        return self._jittered(p.empty_base_seconds, p.empty_cap_seconds, self.consecutive_empty)

    def on_error(self) -> float:
        """A poll failed (server unreachable, 5xx, 4xx)."""
        self.consecutive_empty = 0
        self.consecutive_errors += 1
        p = self.policy
        return self._jittered(p.error_base_seconds, p.error_cap_seconds, self.consecutive_errors)

    def _jittered(self, base: float, cap: float, n: int) -> float:
        """The product's one backoff (``leasecore.backoff.Backoff``): doubling from ``base`` up to
        ``cap``, shortened by up to ``jitter`` with a draw of the injected random source."""
        if base <= 0 or cap <= 0:  # no wait configured: poll again at once
            return 0.0
        return Backoff(base, 2.0, max(base, cap), self.policy.jitter).delay(n, self._rand())


FailureKind = Literal["unreachable", "auth", "no_credentials", "rejected"]

_FAILURE_LINES: dict[str, str] = {
    "unreachable": "server unreachable: {error} (will keep retrying)",
    "auth": "the server refused our credentials: {error} (check CONDUCTOR_AUTH_KEY and "
    "CONDUCTOR_AUTH_SECRET; will keep retrying)",
    "no_credentials": "no credentials are configured: {error} (will keep retrying)",
    "rejected": "the server rejected the poll: {error} (will keep retrying)",
}
_RECOVERY_LINES: dict[str, str] = {
    "unreachable": "server reachable again",
    "auth": "the server accepts our credentials again",
    "no_credentials": "the server accepts polls without credentials again",
    "rejected": "the server accepts the poll again",
}


@dataclass(frozen=True, eq=False)
class Reachability:
    """What the poller last knew about the server: one log line per change of state, not per failure.

    The states are: reachable, or failing for one ``kind`` of reason: ``unreachable`` (network,
    timeout, 5xx), ``auth`` (401/403: our credentials were refused) or ``rejected`` (another 4xx).
    A failure of another kind than the current one is a change, and says so.
    """

    reachable: bool = True
    last_error: str | None = None
    kind: FailureKind | None = None  # why it fails, while not reachable

    def on_success(self) -> tuple[Reachability, str | None]:
        """Returns the new state and the line to log, if the state changed."""
        if self.reachable:
            return self, None
        return Reachability(), _RECOVERY_LINES[self.kind or "unreachable"]

    def on_failure(self, error: str, kind: FailureKind = "unreachable") -> tuple[Reachability, str | None]:
        """Returns the new state and the line to log, if the state changed."""
        new = Reachability(False, error, kind)
        if not self.reachable and self.kind == kind:
            return new, None
        return new, _FAILURE_LINES[kind].format(error=error)
