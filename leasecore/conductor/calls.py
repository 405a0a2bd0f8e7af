"""The Conductor client's plumbing: error translation, replies, path segments.

Owns: the one translation of library errors and statuses into the project's tree,
:func:`translate_errors` (library exceptions) plus :func:`error_for_status` (HTTP statuses):

    network error, timeout, 5xx   -> ConductorUnavailable   (retryable)
    5xx whose JSON body says
      "retryable": false          -> ConductorRejected      (a malformed request: retrying cannot help)
    404                           -> ConductorNotFound
    401/403 (after one refresh)   -> ConductorAuthError
    other 4xx, 3xx                -> ConductorRejected
    a 2xx we cannot parse, an answer whose framing is refused (http_framing) -> ConductorProtocolError

Each carries method, path, status code and a short body excerpt with any credential redacted.
Must not: send anything, retry, or import requests (``conductor.requests_transport`` holds requests' classes
and is consulted only once loaded: a lean start). Threads: any; pure functions and immutable values.
"""

from __future__ import annotations

import json
import re
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import quote

from leasecore.conductor.answer import HTTPException as LeanHTTPException
from leasecore.conductor.resolve import ResolveTimeout
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorRunError,
    ConductorUnavailable,
)
from leasecore.http_framing import FramingError

__all__ = [
    "JSON",
    "TEXT_OR_JSON",
    "Reply",
    "error_for_status",
    "excerpt_of",
    "is_token_rejection",
    "path_segment",
    "protocol_error",
    "raise_translated",
    "translate_errors",
]

EXCERPT_CHARS = 200
JSON = "application/json"
TEXT_OR_JSON = "text/plain, application/json"  # POST /api/tasks answers text/plain (§3)
# json.loads' own decoder: a body that starts with "{" and no NUL after it is UTF-8 to json.loads
# (json.detect_encoding), so such a body is decoded as UTF-8 and handed to it directly.
_decode = json.JSONDecoder().decode

# The standard library's errors and the lean transport's (conductor_lean), with what each means.
# requests' own classes come first once requests is loaded (conductor_requests.ERRORS): the client
# imports it only for https://, a proxy or an injected session; a plain http:// runner never does.
_STDLIB_ERRORS: tuple[tuple[type[BaseException], type[ConductorError], str], ...] = (
    (TimeoutError, ConductorUnavailable, "timed out"),
    (LeanHTTPException, ConductorUnavailable, "connection broke mid-answer"),
    (OSError, ConductorUnavailable, "connection failed"),
)


def _error_table() -> tuple[tuple[type[BaseException], type[ConductorError], str], ...]:
    table = _STDLIB_ERRORS
    http_client = sys.modules.get("http.client")  # loaded with requests (urllib3), or by a caller
    if http_client is not None:
        table = ((http_client.HTTPException, ConductorUnavailable, "connection broke mid-answer"), *table)
    if "requests" not in sys.modules:  # then no error raised inside can be one of requests'
        return table
    from leasecore.conductor import requests_transport as conductor_requests
    return (*conductor_requests.ERRORS, *table)


@contextmanager
def translate_errors(method: str, path: str) -> Iterator[None]:
    """Turn any requests, urllib3, http.client, socket or framing error raised inside into the project's
    tree."""
    try:
        yield
    except Exception as exc:  # the table says which are a failed call (a warning raised under -W error too)
        raise_translated(exc, method, path)
        raise


def raise_translated(exc: Exception, method: str, path: str) -> None:
    """Raise the project's error for ``exc`` (``from`` it), as ``translate_errors`` does; return when
    ``exc`` is one of the project's already, or no library error (the caller re-raises it then).
    For a hot path: an ``except`` that calls this costs nothing until something is raised, where a
    ``with translate_errors(...)`` makes a generator and its context manager on every call."""
    if isinstance(exc, ConductorRunError):
        return
    if isinstance(exc, FramingError):
        raise _framing_error(method, path, exc) from exc
    _translate(exc, method, path)


def _translate(exc: BaseException, method: str, path: str) -> None:
    """Raise the project's error for a library error ``exc``; return when it is not one."""
    for library_type, error_type, what in _error_table():
        if isinstance(exc, library_type):
            cause = _plain_cause(exc)
            detail = cause if cause else f"{type(exc).__name__}: {_short(str(exc))}"
            raise error_type(f"{method} {path}: {what} ({detail})", method=method, path=path) from exc


def _framing_error(method: str, path: str, exc: FramingError) -> ConductorError:
    """An answer whose body breaks the framing rules (or its size limit). After a 2xx status line it is
    a protocol error (the server took the request: a reporter must not send a result twice); after any
    other status the status decides, as if the body were empty; with no status known, a failed attempt.
    """
    what = f"answer refused ({exc.message})"
    status = exc.answer_status
    if status is None:
        return ConductorUnavailable(f"{method} {path}: {what}", method=method, path=path)
    if 200 <= status < 300:
        return ConductorProtocolError(
            f"{method} {path}: {what}", method=method, path=path, status_code=status
        )
    error = error_for_status(method, path, status, b"")
    assert error is not None  # not a 2xx
    error.args = (f"{error}: {what}",)
    return error


def _plain_cause(exc: BaseException) -> str | None:
    """The socket-level reason behind a requests/urllib3 error, in words an operator can act on.

    requests wraps the OSError that matters several layers deep (ConnectionError -> MaxRetryError ->
    NewConnectionError -> ConnectionRefusedError); its own message is mostly pool internals.
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, socket.gaierror):
            return "cannot resolve the host name"
        if isinstance(current, ResolveTimeout):
            return "cannot resolve the host name in time"
        if isinstance(current, ConnectionRefusedError):
            return "connection refused"
        if isinstance(current, ConnectionResetError):
            return "connection reset by peer"
        if isinstance(current, TimeoutError | socket.timeout):
            return "no answer in time"
        if isinstance(current, OSError) and current.strerror:
            return current.strerror.lower()
        nested = [a for a in current.args if isinstance(a, BaseException)]
        reason = getattr(current, "reason", None)
        if isinstance(reason, BaseException):
            nested.append(reason)
        nested += [e for e in (current.__cause__, current.__context__) if e is not None]
        pending.extend(nested)
    return None


def error_for_status(
    method: str, path: str, status_code: int, body: bytes, *, secrets: Sequence[str] = ()
) -> ConductorError | None:
    """The error an HTTP status means (``None`` for 2xx), with a redacted body excerpt."""
    if 200 <= status_code < 300:
        return None
    excerpt = excerpt_of(body, secrets)
    kinds: list[tuple[bool, type[ConductorError], str]] = [
        (status_code == 404, ConductorNotFound, "not found"),
        (status_code in (401, 403), ConductorAuthError, "not authorized"),
        (status_code >= 500 and _says_not_retryable(body), ConductorRejected, "server error, not retryable"),
        (status_code >= 500, ConductorUnavailable, "server error"),
        (300 <= status_code < 400, ConductorRejected, "unexpected redirect (is the server URL right?)"),
    ]
    error_type, what = next(((t, w) for hit, t, w in kinds if hit), (ConductorRejected, "rejected"))
    return error_type(
        f"{method} {path} -> HTTP {status_code} {what}: {excerpt}"
        if excerpt
        else f"{method} {path} -> HTTP {status_code} {what}",
        method=method,
        path=path,
        status_code=status_code,
        body_excerpt=excerpt,
    )


def _says_not_retryable(body: bytes) -> bool:
    """True for Conductor's error body with ``"retryable": false`` (CONDUCTOR_PROTOCOL.md §9).

    Conductor answers 500 for a malformed request too (missing status, unknown enum value, bad JSON),
    and marks those ``retryable: false``; an outage (``TransientException``) says ``true``. A 5xx without
    a JSON body saying so (a proxy's 502, a bare 503) stays retryable.
    """
    if len(body) > 64 * 1024 or not body.lstrip().startswith(b"{"):
        return False
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("retryable") is False


def excerpt_of(body: bytes, secrets: Sequence[str] = ()) -> str:
    """At most 200 characters of ``body``, whitespace collapsed, every secret replaced by ``***``."""
    text = body[: 16 * EXCERPT_CHARS].decode("utf-8", errors="replace")
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return _short(text)


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


@dataclass(frozen=True, eq=False)
class Reply:
    """A completed HTTP exchange: status and body, read in full within the attempt's deadline."""

    method: str
    path: str
    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON; a 2xx body that is not JSON is a :class:`ConductorProtocolError`."""
        body = self.body
        try:
            if body[:1] == b"{" and body[1:2] != b"\0":  # what json.loads makes of it, without its
                return _decode(body.decode("utf-8", "surrogatepass"))  # guess at the encoding
            return json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nested too deep: not a ValueError
            raise ConductorProtocolError(
                f"{self.method} {self.path}: answer is not JSON",
                method=self.method,
                path=self.path,
                status_code=self.status_code,
                body_excerpt=excerpt_of(self.body),
            ) from exc


def path_segment(value: str) -> str:
    """One URL path segment; task ids and types are data, never URL syntax."""
    return quote(value, safe="")


def protocol_error(reply: Reply, what: str) -> NoReturn:
    """Raise: a 2xx ``reply`` whose body does not have the shape the protocol promises."""
    raise ConductorProtocolError(
        f"{reply.method} {reply.path}: {what}",
        method=reply.method,
        path=reply.path,
        status_code=reply.status_code,
        body_excerpt=excerpt_of(reply.body),
    )


TOKEN_ERRORS = frozenset({"EXPIRED_TOKEN", "INVALID_TOKEN"})


def is_token_rejection(reply: Reply) -> bool:
    """401, or 403 naming an expired/invalid token: worth one refresh-and-retry (§8)."""
    if reply.status_code == 401:
        return True
    if reply.status_code != 403:
        return False
    try:
        data = json.loads(reply.body)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("error") in TOKEN_ERRORS
