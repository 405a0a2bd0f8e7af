"""The embedded server's socket layer: HTTP/1.1 keep-alive in front of
:class:`~leasecore.server.http.api.Api`.

Owns: :class:`ApiHTTPServer` (a ``ThreadingHTTPServer``: one daemon thread per connection, the open
connections tracked so that a stopped server cuts them) and its request handler: ``TCP_NODELAY``,
each response (status line, headers and body) in ONE write, so loopback clients are not stalled ~40
ms by Nagle + delayed ACKs; request bodies framed by the shared strict rules of
:mod:`leasecore.http_framing` (a refused one is answered, then the connection drained for a moment
and closed, since where the next request starts is unknown); ``100 Continue`` only for a body it will
read; connections that vanish (a client giving up on a long poll) dropped silently.

Must not: route or answer by itself (``server.api`` does), hold task state. Threads: the accept loop
(``serve_forever``, on a thread ``server.embedded`` starts) and one handler thread per connection.
"""

from __future__ import annotations

import contextlib
import io
import socket
import sys
import threading
import time
from collections.abc import Callable
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from leasecore.http_framing import CHUNKED, FramingError, body_length, read_chunked
from leasecore.server.http.api import Api, Response

__all__ = ["MAX_BODY_BYTES", "Api", "ApiHTTPServer", "Response"]

MAX_BODY_BYTES = 64 * 1024 * 1024

LINGER_SECONDS = 1.0
LINGER_MAX_BYTES = 1024 * 1024


def _framing(headers: Message) -> int:
    """The body length the headers announce, or ``CHUNKED``: the rules in :mod:`leasecore.http_framing`
    (shared with the client); raises :class:`FramingError` (answered, then the connection closes)."""
    length = body_length(
        [str(v) for v in headers.get_all("Transfer-Encoding") or []],
        [str(v) for v in headers.get_all("Content-Length") or []],
        MAX_BODY_BYTES,
        what="Request body",
    )
    return 0 if length is None else length


def _read_chunked(rfile: io.BufferedIOBase) -> bytes:
    """A ``Transfer-Encoding: chunked`` body, read through its last CRLF (trailers discarded)."""
    return read_chunked(
        lambda limit: rfile.readline(limit + 1), rfile.read, MAX_BODY_BYTES, what="Request body"
    )


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "conductor-run-embedded"
    server: ApiHTTPServer

    def setup(self) -> None:
        super().setup()
        with contextlib.suppress(OSError):
            self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet by default: request lines go to the server's ``log`` callback, if any."""

    def handle_expect_100(self) -> bool:
        """Send ``100 Continue`` only for a body we will read; a refused one gets its error at once."""
        try:
            _framing(self.headers)
        except FramingError:
            return True  # no 100: _dispatch answers with the error and closes the connection
        return super().handle_expect_100()

    def _read_body(self) -> bytes:
        """The request body, read to its exact end so nothing is left on a kept-alive connection.

        Raises :class:`FramingError` when the body cannot be delimited or is too large; the caller then
        answers and closes the connection, since where the next request starts is unknown.
        """
        length = _framing(self.headers)
        if length == CHUNKED:
            return _read_chunked(self.rfile)
        body = self.rfile.read(length) if length else b""
        if len(body) != length:
            raise FramingError(400, "The request body ended before its Content-Length")
        return body

    def _dispatch(self) -> None:
        started = time.perf_counter()
        refused = False
        try:
            body = self._read_body()
        except FramingError as exc:
            self.close_connection = refused = True
            response = self.server.api.error(exc.status, exc.message)
        else:
            headers = {k.lower(): v for k, v in self.headers.items()}
            response = self.server.api.handle(self.command, self.path, headers, body)
        self._send(response)
        if refused:
            self._linger()
        log = self.server.log
        if log is not None:
            elapsed_ms = (time.perf_counter() - started) * 1000.0
            log(f"{self.command} {self.path} {response.status} {elapsed_ms:.2f}ms")

    def _linger(self) -> None:
        """Close gently: end our side, then discard what the client still sends (bounded).

        Closing a socket with unread input makes the kernel send a RST, which can destroy the response
        before the client reads it; draining first lets an error answer to a refused body arrive.
        """
        sock: socket.socket = self.request
        deadline = time.monotonic() + LINGER_SECONDS
        drained = 0
        with contextlib.suppress(OSError):
            self.wfile.flush()
            sock.shutdown(socket.SHUT_WR)
            while drained < LINGER_MAX_BYTES:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                sock.settimeout(remaining)
                chunk = sock.recv(64 * 1024)
                if not chunk:
                    break
                drained += len(chunk)

    def _send(self, response: Response) -> None:
        try:
            phrase = HTTPStatus(response.status).phrase
        except ValueError:
            phrase = ""
        lines = [f"HTTP/1.1 {response.status} {phrase}"]
        if response.status != 204:
            if response.content_type:
                lines.append(f"Content-Type: {response.content_type}")
            lines.append(f"Content-Length: {len(response.body)}")
        if self.close_connection:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.wfile.write(head + (response.body if response.status != 204 else b""))

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch


class ApiHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        api: Api,
        log: Callable[[str], None] | None,
        family: socket.AddressFamily,
    ) -> None:
        self.address_family = family
        self.api = api
        self.log = log
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    @property
    def open_connections(self) -> int:
        with self._connections_lock:
            return len(self._connections)

    def close_connections(self) -> None:
        """Cut every open keep-alive connection, so a stopped server really stops answering."""
        with self._connections_lock:
            conns = list(self._connections)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError | ValueError):
            return  # a client went away mid-request, or sent garbage: nothing worth a traceback
        if self.log is not None:
            self.log(f"error while serving {client_address}: {type(exc).__name__}: {exc}")
