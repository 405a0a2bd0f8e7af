"""Orkes-style token auth (CONDUCTOR_PROTOCOL.md §8): one cached token, refreshed once for all threads.

Owns: *when* a token is fetched and which token a request carries:
* proactive refresh before expiry: from the JWT ``exp`` claim when the token is a JWT, else after a
  fixed TTL (45 min, like the SDKs);
* reactive refresh when the server rejects a token (the client calls :meth:`refresh_rejected` with the
  token it sent; if another thread already replaced it, the new one is returned without a fetch);
* one refresh at a time: a thread that finds a refresh in progress waits for its outcome instead of
  starting another, so a wave of threads holding an expired token causes exactly one ``/token`` call.

Must not: do HTTP (the client injects ``fetch_token(timeout_seconds) -> str | None``; ``None``: the
server has no ``/token`` endpoint, Conductor OSS without auth), so every rule is testable with a
``FakeClock`` and a counting fake; let the token reach a message, a log line or a ``repr``.
Threads: any thread of the client; the one fetching holds the lock, the others queue behind it.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from leasecore.clock import Clock
from leasecore.errors import ConductorError, ConductorUnavailable

log = logging.getLogger(__name__)

DEFAULT_TOKEN_TTL_SECONDS = 45 * 60.0  # refresh interval when the token's expiry is unknown (SDKs: 45 min)
MAX_EARLY_REFRESH_SECONDS = 300.0  # refresh at most this long before a JWT's exp (conductor-cli: 300 s)
EARLY_REFRESH_FRACTION = 0.2  # ...and never earlier than 20 % of its remaining life before exp

FetchToken = Callable[[float], "str | None"]


@dataclass(frozen=True, eq=False)
class _TokenState:
    """What every request reads without a lock: the token and its monotonic deadlines."""

    token: str | None = field(repr=False)
    refresh_at: float  # proactive refresh from here on
    expires_at: float  # the token is certainly useless from here on (inf: unknown)
    no_auth: bool = False  # the server has no token endpoint: send no token, ever


def jwt_expiry_epoch_seconds(token: str) -> float | None:
    """The ``exp`` claim of a JWT, or ``None`` if ``token`` is not a JWT with a numeric ``exp``."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload.encode("ascii")))
    except (ValueError, binascii.Error, UnicodeError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    if isinstance(exp, bool) or not isinstance(exp, int | float) or not math.isfinite(exp):
        return None
    return float(exp)


class TokenManager:
    """Hands out the current token and refreshes it, at most one fetch at a time.

    Usage (the Conductor client does this around every request)::

        token = manager.current(timeout_seconds)            # None: send no X-Authorization header
        ... 401 EXPIRED_TOKEN with ``token`` ...
        token = manager.refresh_rejected(token, timeout_seconds)
    """

    def __init__(
        self,
        fetch_token: FetchToken,
        *,
        clock: Clock,
        ttl_seconds: float = DEFAULT_TOKEN_TTL_SECONDS,
    ) -> None:
        self._fetch_token = fetch_token
        self._clock = clock
        self._ttl_seconds = ttl_seconds
        self._state: _TokenState | None = None  # None: no token fetched yet
        self._lock = threading.Lock()  # held by the one thread that is fetching
        self._finished = 0  # fetches finished; a waiter compares it to learn that someone else tried
        self._last_error: ConductorError | None = None  # outcome of the latest attempt
        self._fetches = 0
        self._waiting = 0  # threads queued behind the lock (diagnostics and tests)
        self._waiting_lock = threading.Lock()

    def __repr__(self) -> str:
        mode = "unknown" if self._state is None else ("no-auth" if self._state.no_auth else "token")
        return f"TokenManager(mode={mode}, fetches={self._fetches})"

    @property
    def fetch_count(self) -> int:
        """How many times the token endpoint was called (for tests and diagnostics)."""
        return self._fetches

    @property
    def waiting(self) -> int:
        """Threads waiting to fetch or for a fetch in progress."""
        return self._waiting

    @property
    def no_auth(self) -> bool:
        """True once the server said it has no token endpoint."""
        return self._state is not None and self._state.no_auth

    def known_tokens(self) -> tuple[str, ...]:
        """The token currently held, to redact from error excerpts."""
        state = self._state
        return (state.token,) if state is not None and state.token else ()

    def current(self, timeout_seconds: float) -> str | None:
        """The token to send now, fetching or proactively refreshing it first if needed."""
        state = self._state
        if state is not None and (state.no_auth or self._clock.monotonic() < state.refresh_at):
            return state.token
        return self._refresh(state, timeout_seconds, rejected=False).token

    def refresh_rejected(self, rejected_token: str, timeout_seconds: float) -> str | None:
        """The server refused ``rejected_token``: return a newer token, fetching one if nobody has."""
        state = self._state
        if state is not None and state.token != rejected_token:
            return state.token  # another thread already replaced it
        return self._refresh(state, timeout_seconds, rejected=True).token

    def _refresh(self, seen: _TokenState | None, timeout_seconds: float, *, rejected: bool) -> _TokenState:
        finished_seen = self._finished
        with self._waiting_lock:
            self._waiting += 1
        try:
            acquired = self._lock.acquire(timeout=max(0.0, timeout_seconds))
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        if not acquired:
            raise ConductorUnavailable("timed out waiting for the auth token refresh in progress")
        try:
            if self._finished != finished_seen or self._state is not seen:
                # A fetch ended while we waited: share its outcome instead of fetching again.
                return self._settle(seen, self._last_error, rejected=rejected)
            self._fetches += 1
            try:
                token = self._fetch_token(timeout_seconds)
            except ConductorError as exc:
                self._last_error = exc
                return self._settle(seen, exc, rejected=rejected)
            finally:
                self._finished += 1
            self._last_error = None
            self._state = self._new_state(token)
            return self._state
        finally:
            self._lock.release()

    def _settle(
        self, seen: _TokenState | None, error: ConductorError | None, *, rejected: bool
    ) -> _TokenState:
        """Outcome for a thread after the latest fetch: the fresh state, the old token, or an error."""
        state = self._state
        if state is not None and (error is None or state is not seen):
            return state  # a newer token than the one this thread started from
        if error is None:  # pragma: no cover - a successful fetch always stores a state
            raise ConductorUnavailable("auth token refresh produced no token")
        still_usable = (
            not rejected
            and seen is not None
            and isinstance(error, ConductorUnavailable)
            and self._clock.monotonic() < seen.expires_at
        )
        if still_usable and seen is not None:
            # A proactive refresh failed on the network, but the old token has not expired yet:
            # keep using it; the next request tries the refresh again.
            log.warning("auth token refresh failed (%s); keeping the current token until it expires", error)
            return seen
        raise _fresh_copy(error)

    def _new_state(self, token: str | None) -> _TokenState:
        now = self._clock.monotonic()
        if token is None:
            log.warning("the server has no token endpoint (HTTP 404/405): continuing without auth")
            return _TokenState(token=None, refresh_at=math.inf, expires_at=math.inf, no_auth=True)
        exp = jwt_expiry_epoch_seconds(token)
        remaining = None if exp is None else exp - self._clock.now().timestamp()
        if remaining is None or remaining < 1.0:
            # Not a JWT, or its exp is already past by our wall clock (skew): refresh on the TTL, and
            # rely on the reactive refresh if the server disagrees earlier.
            return _TokenState(token=token, refresh_at=now + self._ttl_seconds, expires_at=math.inf)
        early = min(MAX_EARLY_REFRESH_SECONDS, EARLY_REFRESH_FRACTION * remaining)
        return _TokenState(token=token, refresh_at=now + remaining - early, expires_at=now + remaining)


def _fresh_copy(error: ConductorError) -> ConductorError:
    """A new exception like ``error``, so threads sharing one outcome do not share one traceback."""
    copy = type(error)(
        str(error),
        method=error.method,
        path=error.path,
        status_code=error.status_code,
        body_excerpt=error.body_excerpt,
    )
    copy.__cause__ = error.__cause__
    return copy
