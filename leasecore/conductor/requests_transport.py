"""The requests side of the Conductor client: its transport, the pooled session, requests' errors.

Owns: :class:`RequestsTransport` (a ``Transport`` on a ``requests`` session: TLS with the configured
CA bundle, proxies from the environment, an injected session and its adapters), the session it makes
(pool classes whose connections register in :class:`Connections`, so ``abort`` can cut them), the
proxy lookup, and :data:`ERRORS`, which ``conductor.calls.translate_errors`` consults before the
standard library's errors once this module is loaded. The same framing refusals as the lean
transport (``http_framing.body_length`` on the header fields http.client parsed).

Must not: be imported for plain ``http://`` without a proxy or session (``conductor.transport``
imports it only then: a runner on the lean path never loads requests, urllib3 or certifi: ~10 MB less);
retry or resend. Threads: any; one session shared by every thread of a client.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any, cast

import requests
import requests.adapters
import requests.exceptions as rexc
import requests.utils
import urllib3
import urllib3.connection
import urllib3.exceptions
from urllib3.util import Timeout as Urllib3Timeout

from leasecore.errors import ConductorError, ConductorProtocolError, ConductorRejected, ConductorUnavailable
from leasecore.http_framing import BodyTooLarge, FramingError, body_length

__all__ = ["ERRORS", "Connections", "RequestsTransport", "environ_proxies", "new_session"]

_READ_CHUNK = 64 * 1024

# requests' exception classes, most specific first, with what each means for a caller.
ERRORS: tuple[tuple[type[BaseException], type[ConductorError], str], ...] = (
    (rexc.JSONDecodeError, ConductorProtocolError, "unparseable JSON"),
    (rexc.InvalidJSONError, ConductorRejected, "request body is not valid JSON"),
    (rexc.InvalidURL, ConductorRejected, "invalid URL"),
    (rexc.MissingSchema, ConductorRejected, "invalid URL"),
    (rexc.InvalidSchema, ConductorRejected, "invalid URL"),
    (rexc.URLRequired, ConductorRejected, "invalid URL"),
    (rexc.InvalidHeader, ConductorRejected, "invalid header"),
    (rexc.TooManyRedirects, ConductorProtocolError, "too many redirects"),
    (rexc.Timeout, ConductorUnavailable, "timed out"),
    (rexc.ConnectionError, ConductorUnavailable, "connection failed"),
    (rexc.ChunkedEncodingError, ConductorUnavailable, "connection broke mid-answer"),
    (rexc.ContentDecodingError, ConductorUnavailable, "connection broke mid-answer"),
    (rexc.RetryError, ConductorUnavailable, "connection failed"),
    # Anything else requests raises (or warns, under -W error) is a failed attempt: retryable, and the
    # lease deadline bounds how long a caller keeps trying.
    (rexc.RequestException, ConductorUnavailable, "request failed"),
    (rexc.RequestsWarning, ConductorUnavailable, "request failed"),
    (urllib3.exceptions.HTTPError, ConductorUnavailable, "request failed"),
)


def environ_proxies(url: str) -> dict[str, str]:
    """The proxies requests would use for ``url`` (the environment, ``no_proxy`` applied)."""
    return dict(requests.utils.get_environ_proxies(url))


def new_session(pool_maxsize: int, tracker: Connections | None = None) -> requests.Session:
    """A session with one keep-alive pool per host, sized for ``pool_maxsize`` threads, no retries.
    ``tracker``: records the session's connections, so that ``tracker.cut()`` can end calls in flight."""
    session = requests.Session()
    # One pool per host, big enough that every thread sharing the client can hold a connection
    # (a pool too small makes urllib3 warn "Connection pool is full" and drop connections).
    # max_retries=0: retrying is the caller's decision.
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=pool_maxsize, max_retries=0)
    if tracker is not None:
        adapter.poolmanager.pool_classes_by_scheme = tracker.pool_classes()
    session.mount("http://", adapter)
    session.mount("https://", adapter)
    return session


class Connections:
    """The live connections of one requests session: ``cut()`` shuts down their sockets, so a
    call blocked on one (a silent server) fails at once instead of at its timeout (a forced stop).

    urllib3 keeps no reference to a connection in use; the pools made here use connection classes
    that register themselves once connected and leave at close."""

    def __init__(self) -> None:
        self._live: weakref.WeakSet[urllib3.connection.HTTPConnection] = weakref.WeakSet()
        self._lock = threading.Lock()

    def pool_classes(self) -> dict[str, type[urllib3.HTTPConnectionPool]]:
        live, lock = self._live, self._lock

        class Plain(urllib3.connection.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                with lock:
                    live.add(self)

        class Tls(urllib3.connection.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                with lock:
                    live.add(self)

        class PlainPool(urllib3.HTTPConnectionPool):
            ConnectionCls = Plain

        class TlsPool(urllib3.HTTPSConnectionPool):
            ConnectionCls = Tls

        return {"http": PlainPool, "https": TlsPool}

    def cut(self) -> int:
        """Shut down every live connection's socket; returns how many."""
        with self._lock:
            connections = list(self._live)
        cut = 0
        for connection in connections:
            sock = getattr(connection, "sock", None)
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)  # not SSLSocket's: it drops its state
                    cut += 1
        return cut


class RequestsTransport:
    """A :class:`Transport` on a ``requests`` session: TLS, proxies, injected sessions and adapters."""

    def __init__(
        self,
        origin: str,
        *,
        session: requests.Session | None = None,
        verify: bool | str = True,
        pool_maxsize: int,
        max_body_bytes: int,
        monotonic: Callable[[], float],
    ) -> None:
        self._origin = origin
        self._owns_session = session is None
        self._connections = Connections()  # the owned session's live connections (abort cuts them)
        self._session = session or new_session(pool_maxsize, self._connections)
        # Per request, not session.verify: requests lets REQUESTS_CA_BUNDLE override a session's
        # setting, never a request's. An injected session keeps its own (None: the session decides).
        self._verify: bool | str | None = verify if session is None else None
        self._max_body_bytes = max_body_bytes
        self._monotonic = monotonic

    @property
    def connections_opened(self) -> int | None:
        return None  # urllib3's pool does not say

    @property
    def generation(self) -> int:
        return 0  # abort() cuts the connections themselves: no call needs to know its generation

    @property
    def session(self) -> requests.Session:
        return self._session

    @property
    def verify(self) -> bool | str | None:
        """What each request is told to verify TLS against (``None``: the injected session's own)."""
        return self._verify

    def abort(self) -> None:
        """Shut down the sockets of the session's live connections (a forced stop), only of a session this
        transport created: an injected session's connections are its owner's."""
        if self._owns_session:
            self._connections.cut()

    def close(self) -> None:
        """Close the session's pools, only of a session this transport created."""
        if self._owns_session:
            self._session.close()

    def send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool,
        generation: int | None = None,
    ) -> tuple[int, bytes]:
        remaining = deadline - self._monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out")
        # urllib3's total timeout bounds connect + waiting for the answer together; the body is read
        # below against the same deadline, so no attempt outlives it by more than one socket read.
        timeout = cast(Any, Urllib3Timeout(total=remaining))
        response = self._session.request(
            method,
            self._origin + target,
            data=body,
            headers=dict(headers),
            timeout=timeout,
            stream=True,
            allow_redirects=False,
            verify=self._verify,
        )
        try:
            return response.status_code, self._read_body(response, method, deadline)
        except FramingError as exc:
            exc.answer_status = response.status_code
            raise
        finally:
            response.close()

    def _read_body(self, response: requests.Response, method: str, deadline: float) -> bytes:
        if method == "HEAD" or response.status_code in (204, 304):
            return b""
        # The framing rules of the lean transport and the server, on the fields http.client parsed
        # (it would read "gzip, chunked" to the end undecoded, and let chunked win over Content-Length).
        coding, length = response.headers.get("Transfer-Encoding"), response.headers.get("Content-Length")
        body_length(
            () if coding is None else (coding,),
            () if length is None else (length,),
            self._max_body_bytes,
            what="answer",
        )
        chunks: list[bytes] = []
        size = 0
        for chunk in response.iter_content(chunk_size=_READ_CHUNK):
            chunks.append(chunk)
            size += len(chunk)
            if size > self._max_body_bytes:
                raise BodyTooLarge(self._max_body_bytes, "answer")
            if self._monotonic() > deadline:
                raise TimeoutError("timed out reading the answer")
        return b"".join(chunks)
