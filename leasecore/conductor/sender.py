"""``RequestSender``: one HTTP request to the Conductor server, authenticated, timed and translated.

Owns: the server's URL and request targets, per-attempt deadlines, the user agent, the token (through
:class:`~leasecore.conductor.auth.TokenManager`: fetched with ``POST /token``, refreshed once when the
server rejects it), the metrics hook, and a forced stop's cut of calls in flight. The bytes go through
one :class:`~leasecore.conductor.transport.Transport`; every library error and HTTP status becomes
the project's exception tree in :mod:`leasecore.conductor.calls`. Does not own: what a call means
(the typed calls are :class:`~leasecore.conductor.client.ConductorClient`'s), retries, sleeps.

Threads: any; one sender is shared by every thread of a client (the transport pools connections per
thread, the token refresh is single-flight).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from leasecore import __version__
from leasecore.clock import Clock, SystemClock
from leasecore.conductor.auth import DEFAULT_TOKEN_TTL_SECONDS, TokenManager
from leasecore.conductor.calls import (
    JSON,
    Reply,
    error_for_status,
    is_token_rejection,
    raise_translated,
)
from leasecore.conductor.transport import Transport, open_transport
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
    ConfigError,
)

if TYPE_CHECKING:  # requests is imported only when the lean transport does not serve
    import requests

__all__ = ["ABORTED_CALL_SECONDS", "MAX_BODY_BYTES", "POOL_MAXSIZE", "RequestSender"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a batch of large tasks fits; a runaway answer does not
POOL_MAXSIZE = 32  # >= the threads that share one client (poll loop, heartbeat senders, reporter)
ABORTED_CALL_SECONDS = 1.0  # the bound on a call made after abort() (a forced stop)
_TEXT = "text/plain; charset=utf-8"
_HEADER_SETS = 16  # (Accept, Content-Type) pairs whose header fields are kept made


class RequestSender:
    """Sends one request at a time per thread to ``base_url``; raises only ``ConductorError``s.

    ``timeout_seconds`` (default, or per request) bounds one attempt: connect, the answer and its
    body, and any token refresh the attempt needs.
    """

    def __init__(
        self,
        base_url: str,
        *,
        auth_key: str | None = None,
        auth_secret: str | None = None,
        auth_token: str | None = None,
        session: requests.Session | None = None,
        timeout_seconds: float = 10.0,
        clock: Clock | None = None,
        user_agent: str | None = None,
        token_ttl_seconds: float = DEFAULT_TOKEN_TTL_SECONDS,
        pool_maxsize: int = POOL_MAXSIZE,
        transport: Transport | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        """``ca_bundle``: PEM file (or directory) of the CAs to trust for https:// (None: certifi's,
        or what REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE name, as requests does)."""
        self.base_url = _check_base_url(base_url)
        self.root_url = self.base_url.removesuffix("/api")  # /health lives at the root
        if not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
            raise ConfigError(f"timeout must be a positive number of seconds, not {timeout_seconds!r}")
        self.timeout_seconds = timeout_seconds
        self._clock: Clock = clock or SystemClock()
        self._user_agent = user_agent or f"conductor-run/{__version__}"
        # Metrics: (method, uri template, status code or "error", seconds) after each request.
        self.request_hook: Callable[[str, str, str, float], None] | None = None
        if transport is not None and session is not None:
            raise TypeError("give a session or a transport, not both")
        # The one choice of transport (lean socket for plain HTTP without a proxy; requests for https,
        # proxies and an injected session); ``transport=`` replaces it (tests, embedding callers).
        self.transport: Transport = transport or open_transport(
            self.base_url,
            session=session,
            verify=ca_bundle or True,
            pool_maxsize=pool_maxsize,
            max_body_bytes=MAX_BODY_BYTES,
            monotonic=self._clock.monotonic,
        )
        self._aborted = False  # abort() was called: calls are cut short (a forced stop)
        self._headers: dict[tuple[str, str | None], Mapping[str, str]] = {}  # (accept, type) -> fields
        origin_length = len("{0.scheme}://{0.netloc}".format(urlsplit(self.base_url)))
        self._api_target = self.base_url[origin_length:]  # what follows host:port in a request line
        self._root_target = self.root_url[origin_length:]
        key, secret = (auth_key or "").strip(), (auth_secret or "").strip()
        if bool(key) != bool(secret):
            missing = "auth_secret" if key else "auth_key"
            raise ConfigError(
                f"{missing} is missing: give both the auth key and secret, or neither", key=missing
            )
        self._key_id = key
        self._key_secret = secret
        self.auth: TokenManager | None = None
        if key:
            self.auth = TokenManager(self._fetch_token, clock=self._clock, ttl_seconds=token_ttl_seconds)
        elif auth_token and auth_token.strip():  # conductor-cli's CONDUCTOR_AUTH_TOKEN: as given, always
            fixed = auth_token.strip()
            if any(char in fixed for char in "\r\n\0"):
                raise ConfigError("auth_token holds a line break: not a header value", key="auth_token")
            self.auth = TokenManager(
                lambda _timeout: fixed, clock=self._clock, ttl_seconds=token_ttl_seconds
            )

    def abort(self) -> None:
        """Cut every call in flight now; calls from now on get at most ``ABORTED_CALL_SECONDS``."""
        self._aborted = True
        self.transport.abort()

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        json_body: Any = None,
        text_body: str | None = None,
        accept: str = JSON,
        timeout_seconds: float | None = None,
        root: bool = False,
        idempotent: bool | None = None,
        uri: str | None = None,
    ) -> Reply:
        """One call to ``{base_url}{path}`` (``root=True``: the server root), errors translated.

        ``uri``: the path's template for ``request_hook`` (default: the path itself). ``json_body``
        is encoded with ``json.dumps``, unless it is ``bytes``: JSON encoded already, sent as is.

        A 2xx comes back as a :class:`Reply`; anything else raises. With auth, a rejected token is
        refreshed and the request sent once more, within the same deadline. ``idempotent`` (default:
        GET, HEAD, PUT, DELETE) allows one resend on a fresh connection when a kept-alive one turns
        out dead under the request.
        """
        hook = self.request_hook
        if hook is None:
            return self._request(method, path, params, json_body, text_body, accept, timeout_seconds, root,
                                 idempotent)
        started = self._clock.monotonic()
        status = "error"
        try:
            reply = self._request(method, path, params, json_body, text_body, accept, timeout_seconds, root,
                                  idempotent)
            status = str(reply.status_code)
            return reply
        except ConductorError as exc:
            status = str(exc.status_code) if exc.status_code else "error"
            raise
        finally:
            hook(method, uri or path, status, self._clock.monotonic() - started)

    def _request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str | int] | None,
        json_body: Any,
        text_body: str | None,
        accept: str,
        timeout_seconds: float | None,
        root: bool,
        idempotent: bool | None,
    ) -> Reply:
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT", "DELETE")
        budget = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        generation = self.transport.generation  # before the abort check: an abort after it cuts this call
        if self._aborted:
            budget = min(budget, ABORTED_CALL_SECONDS)
        deadline = self._clock.monotonic() + budget
        target = (self._root_target if root else self._api_target) + path
        if params:
            target += "?" + urlencode(params)
        data: bytes | None = None
        content_type: str | None = None
        if json_body is not None:
            content_type = JSON
            # bytes are JSON already encoded (a TaskResult's ``encoded()``): sent as they are
            data = json_body if isinstance(json_body, bytes) else json.dumps(json_body).encode("utf-8")
        elif text_body is not None:
            content_type = _TEXT
            data = text_body.encode("utf-8")
        headers = self._headers.get((accept, content_type)) or self._header_set(accept, content_type)
        token = self.auth.current(self._remaining(deadline, method, path)) if self.auth else None
        send = (method, path, target or "/", data)
        reply = self._send(
            *send, _with_token(headers, token), deadline, idempotent=idempotent, generation=generation
        )
        if token is not None and self.auth is not None and is_token_rejection(reply):
            token = self.auth.refresh_rejected(token, self._remaining(deadline, method, path))
            reply = self._send(
                *send, _with_token(headers, token), deadline, idempotent=idempotent, generation=generation
            )
        if 200 <= reply.status_code < 300:  # (the secrets to redact are gathered for an error only)
            return reply
        error = error_for_status(method, path, reply.status_code, reply.body, secrets=self._secrets())
        if error is not None:
            if isinstance(error, ConductorAuthError) and not self.auth:
                error.args = (f"{error} (the server wants credentials: set CONDUCTOR_AUTH_KEY/SECRET)",)
                error.without_credentials = True  # the message says what to set: callers add no hint
            raise error
        return reply

    def _send(
        self,
        method: str,
        path: str,
        target: str,
        data: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool = False,
        generation: int | None = None,
    ) -> Reply:
        self._remaining(deadline, method, path)
        try:
            status, body = self.transport.send(
                method, target, data, headers, deadline, idempotent=idempotent, generation=generation
            )
        except Exception as exc:  # translated once, here (calls.translate_errors' rules)
            raise_translated(exc, method, path)
            raise
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s -> HTTP %d, %d bytes", method, target, status, len(body))
        return Reply(method=method, path=path, status_code=status, body=body)

    def _header_set(self, accept: str, content_type: str | None) -> Mapping[str, str]:
        """The request's header fields for ``accept`` and ``content_type`` (the token is added per call):
        made once per pair and shared, never changed (a transport may keep what it made of them)."""
        fields = {"User-Agent": self._user_agent, "Accept": accept}
        if content_type is not None:
            fields["Content-Type"] = content_type
        if len(self._headers) >= _HEADER_SETS:  # callers name their own Accept: a bound all the same
            self._headers.clear()
        headers = self._headers[(accept, content_type)] = MappingProxyType(fields)
        return headers

    def _remaining(self, deadline: float, method: str, path: str) -> float:
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise ConductorUnavailable(
                f"{method} {path}: no time left for the attempt", method=method, path=path
            )
        return remaining

    def _secrets(self) -> tuple[str, ...]:
        known = self.auth.known_tokens() if self.auth else ()
        return (*known, self._key_secret) if self._key_secret else known

    def _fetch_token(self, timeout_seconds: float) -> str | None:
        """``POST {base}/token`` -> the token; ``None`` when the server has no such endpoint (OSS)."""
        method, path = "POST", "/token"
        deadline = self._clock.monotonic() + timeout_seconds
        body = json.dumps({"keyId": self._key_id, "keySecret": self._key_secret}).encode("utf-8")
        headers = {"User-Agent": self._user_agent, "Accept": JSON, "Content-Type": JSON}
        reply = self._send(method, path, self._api_target + path, body, headers, deadline)
        if reply.status_code in (404, 405):
            return None
        error = error_for_status(method, path, reply.status_code, reply.body, secrets=self._secrets())
        if isinstance(error, ConductorRejected) and reply.status_code in (400, 401, 403):
            raise ConductorAuthError(
                f"the server refused the auth key and secret (HTTP {reply.status_code})",
                method=method,
                path=path,
                status_code=reply.status_code,
                body_excerpt=error.body_excerpt,
            )
        if error is not None:
            raise error
        try:
            token = json.loads(reply.body).get("token")
        except (ValueError, AttributeError, RecursionError):
            token = None
        if not isinstance(token, str) or not token:
            raise ConductorProtocolError(
                "POST /token: answer has no token", method=method, path=path, status_code=reply.status_code
            )
        return token


def _with_token(headers: Mapping[str, str], token: str | None) -> Mapping[str, str]:
    return {**headers, "X-Authorization": token} if token else headers


def _check_base_url(base_url: str) -> str:
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"server URL must look like http://host:8080/api, not {base_url!r}", key="server.url"
        )
    return base_url.strip().rstrip("/")
