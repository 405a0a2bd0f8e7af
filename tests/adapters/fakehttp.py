"""A scripted HTTP/1.1 server on 127.0.0.1:0 for the client tests: a function answers every request.

    def answer(req: Seen) -> Answer:
        return Answer(200, b"[]")

    with ScriptedServer(answer) as srv:
        ConductorClient(srv.url + "/api").poll(...)
        srv.seen  # every request, in arrival order

Keep-alive is on (HTTP/1.1 with Content-Length), so pooled connections are really reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Seen:
    method: str
    path: str  # without the query
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-cased names
    body: bytes


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


Responder = Callable[[Seen], Answer]


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the default 5 overflows when 16 client threads connect at once


class ScriptedServer:
    """Threaded HTTP server whose answers come from ``responder``; records what it saw."""

    def __init__(self, responder: Responder) -> None:
        self.responder = responder
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                parts = urlsplit(self.path)
                seen = Seen(
                    method=self.command,
                    path=parts.path,
                    query=parse_qs(parts.query),
                    headers={k.lower(): v for k, v in self.headers.items()},
                    body=body,
                )
                with outer._lock:
                    outer.seen.append(seen)
                answer = outer.responder(seen)
                self.send_response(answer.status)
                if answer.status not in (204, 304):
                    self.send_header("Content-Type", answer.content_type)
                    self.send_header("Content-Length", str(len(answer.body)))
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if answer.status not in (204, 304):
                    self.wfile.write(answer.body)

            do_GET = do_POST = do_PUT = do_DELETE = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def requests_to(self, path: str) -> list[Seen]:
        with self._lock:
            return [s for s in self.seen if s.path == path]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> ScriptedServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
