"""A recording HTTP relay in front of a real Conductor server (the bench's real-jar rows).

The real server keeps no record of when each ``extendLease`` landed, so the workers talk to this
relay (on 127.0.0.1, a port the OS picks), which forwards every request unchanged over a keep-alive
connection per thread and records, on ``time.monotonic()`` at the moment the server's answer came
back:

- ``claims[task_id]``: each task a poll answer handed out (a 200 with a JSON list, or update-v2's
  next task);
- ``leases[task_id]``: each update with ``"extendLease": true`` answered 2xx (v1 or update-v2);
- ``finals[task_id]``: each other update answered 2xx, with its status.

The relay adds a loopback hop (well under a millisecond against the ~48 ms of a heartbeat's planned
slack at R = 2 s); the times are the answer's, a little after the server applied the call.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


class RecordingRelay:
    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.host, self.port_up = parts.hostname or "127.0.0.1", parts.port or 80
        self.lock = threading.Lock()
        self.claims: dict[str, list[float]] = {}
        self.leases: dict[str, list[float]] = {}
        self.finals: dict[str, list[tuple[float, str]]] = {}
        relay = self
        local = threading.local()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _upstream(self) -> http.client.HTTPConnection:
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection(relay.host, relay.port_up, timeout=60)
                return conn

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
                for attempt in (0, 1):
                    conn = self._upstream()
                    try:
                        conn.request(self.command, self.path, body=body, headers=headers)
                        answer = conn.getresponse()
                        data = answer.read()
                        break
                    except (OSError, http.client.HTTPException):
                        conn.close()
                        local.conn = None
                        if attempt:
                            self.send_error(502)
                            return
                at = time.monotonic()
                relay.record(self.command, self.path, body, answer.status, data, at)
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in _HOP_HEADERS and k.lower() != "content-length":
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                with contextlib.suppress(OSError):  # the worker hung up (it is being stopped)
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = _relay

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a worker that hangs up mid-request (stopped): nothing to report

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/api"
        self._thread = threading.Thread(target=self.server.serve_forever, name="relay", daemon=True)
        self._thread.start()

    def record(self, method: str, path: str, body: bytes | None, status: int, data: bytes, at: float) -> None:
        if not 200 <= status < 300:
            return
        route = path.split("?", 1)[0]
        handed: list[Any] = []
        if method == "GET" and route.startswith("/api/tasks/poll"):
            try:
                got = json.loads(data) if data else []
            except ValueError:
                got = []
            handed = got if isinstance(got, list) else [got]
        elif method == "POST" and route in ("/api/tasks", "/api/tasks/update-v2") and body:
            try:
                update = json.loads(body)
            except ValueError:
                return
            task_id = str(update.get("taskId"))
            with self.lock:
                if update.get("extendLease") is True:
                    self.leases.setdefault(task_id, []).append(at)
                else:
                    self.finals.setdefault(task_id, []).append((at, str(update.get("status"))))
            if route.endswith("update-v2") and data:
                try:
                    nxt = json.loads(data)
                except ValueError:
                    nxt = None
                handed = [nxt] if isinstance(nxt, dict) else []
        with self.lock:
            for task in handed:
                if isinstance(task, dict) and task.get("taskId"):
                    self.claims.setdefault(str(task["taskId"]), []).append(at)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
