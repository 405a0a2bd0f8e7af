"""The requests side of the Conductor client: the pooled session and requests' error classes.

Imported only when a client needs requests: ``https://``, a proxy from the environment, or an
injected session (:class:`~leasecore.conductor.ConductorClient`). Plain ``http://`` without a proxy
goes through :mod:`leasecore.conductor_lean`, and a runner on it never loads requests, urllib3,
charset_normalizer, idna or certifi (about 10 MB of its idle RSS, #23). Once this module is loaded,
:func:`leasecore.conductor_http.translate_errors` consults :data:`ERRORS` before the standard
library's errors.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref

import requests
import requests.adapters
import requests.exceptions as rexc
import requests.utils
import urllib3
import urllib3.connection
import urllib3.exceptions

from leasecore.errors import ConductorError, ConductorProtocolError, ConductorRejected, ConductorUnavailable

__all__ = ["ERRORS", "Connections", "environ_proxies", "new_session"]

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
    """The live connections of one requests session (#24): ``cut()`` shuts down their sockets, so a
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
