"""The metrics endpoint: ``/metrics`` (Prometheus text format), ``/healthz`` and ``/readyz``.

A small ``ThreadingHTTPServer`` on its own thread ("metrics-http"); each connection is served on a
short-lived thread, at most ``MAX_CONNECTIONS`` at once (more are closed at once), each read bounded
by ``REQUEST_TIMEOUT_SECONDS``. ``/metrics`` is prometheus-client's own exposition of the registry
(``generate_latest``); the probes answer 200 or 503 with a one-line reason.

``start()`` binds before anything else of the run happens, so a port in use, a port the user may
not bind, or an address not on this host is a ``ConfigError`` naming the key and where it came from
(exit 3), whether or not the Conductor server is up.
"""

from __future__ import annotations

import errno
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from leasecore.errors import ConfigError

log = logging.getLogger("conductor_run.metrics")

MAX_CONNECTIONS = 16
REQUEST_TIMEOUT_SECONDS = 10.0

Probe = Callable[[], tuple[bool, str]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # a restart may bind at once (TIME_WAIT), never a port in use (LISTEN)

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, app: MetricsEndpoint) -> None:
        self.address_family = family
        self.app = app
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own looks the address up (getfqdn: a reverse DNS query, slow or hanging where
        # there is no DNS); the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # bounded: a flood of connections is cut, not queued
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_SECONDS
    protocol_version = "HTTP/1.1"
    server_version = "conductor-run-metrics"

    def do_GET(self) -> None:
        app = self.server.app
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, content_type = app.exposition()
            except Exception as exc:  # a collector's bug: say so, keep serving
                log.exception("metrics: building /metrics failed")
                self._reply(500, f"error: {type(exc).__name__}\n".encode(), "text/plain; charset=utf-8")
                return
            self._reply(200, body, content_type)
        elif path in ("/healthz", "/readyz"):
            probe = app.liveness if path == "/healthz" else app.readiness
            try:
                ok, why = probe()
            except Exception as exc:
                log.exception("metrics: %s failed", path)
                ok, why = False, f"error: {type(exc).__name__}"
            self._reply(200 if ok else 503, f"{'ok' if ok else 'unavailable'}: {why}\n".encode(),
                        "text/plain; charset=utf-8")
        else:
            self._reply(404, b"not found: /metrics, /healthz, /readyz\n", "text/plain; charset=utf-8")

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds is not worth a log line


class MetricsEndpoint:
    """Serves ``exposition()`` and the two probes on ``host:port`` until ``close()``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        exposition: Callable[[], tuple[bytes, str]],
        liveness: Probe,
        readiness: Probe,
        sources: tuple[str, str] = ("default", "default"),
    ) -> None:
        """``sources``: where ``metrics_host`` and ``metrics_port`` came from, for the error message."""
        self.host, self.port = host, port
        self.exposition, self.liveness, self.readiness = exposition, liveness, readiness
        self._sources = sources
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        """Bind and serve; ``ConfigError`` when the address cannot be listened on."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self._server = _Server((self.host, self.port), family, self)
        except OSError as exc:
            raise self._bind_error(exc) from None
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    def _bind_error(self, exc: OSError) -> ConfigError:
        host_source, port_source = self._sources
        why = exc.strerror or str(exc)
        if exc.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            return ConfigError(f"invalid metrics_host = {self.host!r} (from {host_source}): cannot listen "
                               f"there: {why} (an address of this host, such as 127.0.0.1 or 0.0.0.0)",
                               key="metrics_host", source=host_source)
        hint = " (another process listens there: pick another port)" if exc.errno == errno.EADDRINUSE else ""
        if exc.errno == errno.EACCES:
            hint = " (ports below 1024 need privileges: pick one from 1024 to 65535)"
        return ConfigError(f"invalid metrics_port = {self.port} (from {port_source}): cannot listen on "
                           f"{self.url}: {why}{hint}", key="metrics_port", source=port_source)

    def close(self) -> None:
        """Stop serving and release the port (a request being answered finishes on its own thread)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
