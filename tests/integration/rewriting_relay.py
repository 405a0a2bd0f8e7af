"""An HTTP relay on 127.0.0.1 (port 0) in front of a Conductor server that answers chosen requests itself.

Where ``tests/faultproxy.py`` breaks the transport, this relay breaks single calls: ``rule(method,
path, body)`` returns a status to answer instead of forwarding (``None``: forward), e.g. a 500 to
every extendLease and nothing else. Every request is recorded as a ``Call`` so a test can say what
the runner sent and when (``kind``: ``lease`` for an extendLease, ``update`` for another
``POST /api/tasks``, else ``other``).

    with RewritingRelay(server.url) as relay:
        relay.rule = lambda method, path, body: 500 if is_lease(body) else None
        ... run the worker against relay.url ...
        relay.calls("lease")
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any

import requests

Rule = Callable[[str, str, Any], "int | None"]
_HOP_BY_HOP = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding"})


@dataclass(frozen=True)
class Call:
    at: float  # monotonic time the relay answered
    method: str
    path: str
    kind: str  # lease | update | other
    status: int


def is_lease(body: Any) -> bool:
    """An extendLease heartbeat body."""
    return isinstance(body, dict) and body.get("extendLease") is True


def kind_of(method: str, path: str, body: Any) -> str:
    if method == "POST" and path.split("?")[0].rstrip("/").endswith("/api/tasks"):
        return "lease" if is_lease(body) else "update"
    return "other"


class RewritingRelay:
    """Forward to ``target_url`` (``http://host:port/api``) unless ``rule`` answers first."""

    def __init__(self, target_url: str) -> None:
        self.target = target_url.rstrip("/").removesuffix("/api")
        self.rule: Rule = lambda _method, _path, _body: None
        self._calls: list[Call] = []
        self._lock = threading.Lock()
        self._session = requests.Session()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="relay", daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/api"

    def calls(self, kind: str | None = None, *, since: float = 0.0) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if (kind is None or c.kind == kind) and c.at >= since]

    def _answer(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> tuple[int, bytes, str]:
        body: Any = None
        if raw and "json" in headers.get("content-type", ""):
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        status = self.rule(method, path, body)
        if status is not None:
            payload = json.dumps({"status": status, "message": "the relay refused it", "retryable": True})
            answer = (status, payload.encode(), "application/json")
        else:
            forward = {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}
            reply = self._session.request(method, self.target + path, data=raw or None, headers=forward,
                                          timeout=30)
            answer = (reply.status_code, reply.content, reply.headers.get("Content-Type", "text/plain"))
        with self._lock:
            self._calls.append(Call(time.monotonic(), method, path, kind_of(method, path, body), answer[0]))
        return answer

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                headers = {k.lower(): v for k, v in self.headers.items()}
                status, payload, ctype = relay._answer(self.command, self.path, headers, raw)
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_DELETE = _relay

        return Handler

    def __enter__(self) -> RewritingRelay:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)
        self._session.close()
