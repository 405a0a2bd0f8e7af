"""A lean keep-alive HTTP/1.1 transport on ``http.client`` for the Conductor client's plain-HTTP calls.

Why: a ``requests`` call costs about 1 ms of CPU (session merging, hooks, urllib3's pool, header
objects); the runner makes four of them per task (poll, update, heartbeats, ownership checks), on
the same 2 cores as its children. This transport does the same exchange in a fraction of that.

What it keeps from the ``requests`` path (``ConductorClient`` decides which one a call takes):

* one deadline bounds the whole attempt: connecting, sending, the status line and headers, and every
  read of the body (the socket's timeout is set to what is left before each step);
* a bounded pool of idle keep-alive connections shared by every thread (LIFO: the warmest first);
  a connection the server closed while it sat idle is noticed before use (readable with nothing
  asked = EOF) and dropped;
* a reused connection that turns out dead (reset, closed before the status line) is replaced once by
  a fresh one, but only for a call the caller marks ``idempotent``: never for a poll, whose lost
  answer would lose claimed tasks;
* errors are raised as the library's own (``OSError``, ``http.client.HTTPException``): the caller
  translates them (``conductor_http.translate_errors``), so the mapping lives in one place.

Plain ``http://`` only, and only when no proxy applies to the host (``requests`` honours
``HTTP_PROXY``; this transport does not speak to proxies). Everything else stays on ``requests``.
"""

from __future__ import annotations

import http.client
import logging
import select
import threading
from collections.abc import Callable, Mapping

__all__ = ["AnswerTooLarge", "LeanTransport", "StaleConnection"]

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024


class StaleConnection(ConnectionError):
    """A reused keep-alive connection died before the server answered (and the call was not retried)."""


class AnswerTooLarge(ValueError):
    """The answer's body passed the size limit; the connection was dropped."""


class LeanTransport:
    """Keep-alive HTTP/1.1 to one ``host:port``; thread-safe; ``max_idle`` connections kept warm."""

    def __init__(self, host: str, port: int, *, max_idle: int, monotonic: Callable[[], float]) -> None:
        self._host, self._port = host, port
        self._max_idle = max_idle
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._idle: list[http.client.HTTPConnection] = []
        self._closed = False
        self.opened = 0  # connections made so far (diagnostics, tests)

    def close(self) -> None:
        """Close every idle connection; one in use is closed when its call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool,
        max_body_bytes: int,
    ) -> tuple[int, bytes]:
        """One exchange: (status, the whole body). Raises ``OSError``/``HTTPException`` (``TimeoutError``
        when the deadline passes), ``AnswerTooLarge`` for a body over ``max_body_bytes``."""
        conn, reused = self._take(deadline)
        try:
            return self._exchange(conn, method, target, body, headers, deadline, max_body_bytes)
        except (ConnectionError, http.client.RemoteDisconnected, http.client.BadStatusLine) as exc:
            conn.close()
            if not reused:
                raise
            if not idempotent:
                raise StaleConnection(f"a kept-alive connection died under the request ({exc!r})") from exc
        except BaseException:
            conn.close()
            raise
        # A dead keep-alive connection: once more on a fresh one (idempotent calls only).
        log.debug(
            "a kept-alive connection died under %s %s; sending it once more on a new one", method, target
        )
        conn = self._connect(deadline)
        try:
            return self._exchange(conn, method, target, body, headers, deadline, max_body_bytes)
        except BaseException:
            conn.close()
            raise

    # -- internals ----------------------------------------------------------------------------------

    def _take(self, deadline: float) -> tuple[http.client.HTTPConnection, bool]:
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return self._connect(deadline), False
            if _still_open(conn):
                return conn, True
            conn.close()

    def _connect(self, deadline: float) -> http.client.HTTPConnection:
        conn = http.client.HTTPConnection(self._host, self._port, timeout=_left(deadline, self._monotonic))
        conn.connect()  # TCP_NODELAY is set by http.client
        with self._lock:
            self.opened += 1
        return conn

    def _exchange(
        self,
        conn: http.client.HTTPConnection,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        max_body_bytes: int,
    ) -> tuple[int, bytes]:
        sock = conn.sock
        assert sock is not None  # connected by _take/_connect
        sock.settimeout(_left(deadline, self._monotonic))
        conn.request(method, target, body=body, headers=dict(headers))
        sock.settimeout(_left(deadline, self._monotonic))
        response = conn.getresponse()
        chunks: list[bytes] = []
        size = 0
        while True:
            sock.settimeout(_left(deadline, self._monotonic))
            chunk = response.read1(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_body_bytes:
                raise AnswerTooLarge(f"answer larger than {max_body_bytes} bytes")
            chunks.append(chunk)
        if response.length:  # EOF before the Content-Length was read: a cut answer, not a short one
            raise http.client.IncompleteRead(b"".join(chunks), response.length)
        response.close()  # read to its end: frees the connection for the next request (socket stays)
        if response.will_close:
            conn.close()
        else:
            self._give_back(conn)
        return response.status, b"".join(chunks)

    def _give_back(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()


def _left(deadline: float, monotonic: Callable[[], float]) -> float:
    left = deadline - monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _still_open(conn: http.client.HTTPConnection) -> bool:
    """An idle keep-alive socket that is readable has been closed (or spoken to) by the server."""
    sock = conn.sock
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return not poller.poll(0)
