"""HTTP side of the embedded server: routing, auth, Conductor-shaped errors, and a fast socket layer.

:class:`Api` maps ``(method, target, headers, body)`` to a :class:`Response` and never raises: every
failure becomes a Conductor-shaped JSON error (``{status, message, instance, retryable,
validationErrors?}``), never a traceback. :class:`_Handler` is a thin ``BaseHTTPRequestHandler``:
HTTP/1.1 keep-alive, ``TCP_NODELAY``, and each response (status line, headers and body) leaves in ONE
write, so loopback clients are not stalled ~40 ms by Nagle + delayed ACKs. Connections that vanish (a
client giving up on a long poll) are dropped silently.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from leasecore.http_framing import CHUNKED, FramingError, body_length, read_chunked
from leasecore.server.store import ApiError, Store

JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain;charset=UTF-8"
MAX_BODY_BYTES = 64 * 1024 * 1024
HEALTHY: dict[str, Any] = {"healthResults": [], "suppressedHealthResults": [], "healthy": True}
# Reachable without a token: the token exchange, and health checks (load balancers carry no credentials).
OPEN_PATHS = frozenset({"/api/token", "/api/health"})

Query = dict[str, list[str]]


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str | None = None


def _json(value: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(value, separators=(",", ":")).encode(), JSON_TYPE)


def _text(value: str, status: int = 200) -> Response:
    return Response(status, value.encode(), TEXT_TYPE)


_OK_EMPTY = Response(200)
_NO_CONTENT = Response(204)


def _first(query: Query, name: str) -> str | None:
    values = query.get(name)
    return values[0] if values else None


def _task_type_param(query: Query) -> str:
    """The required ``taskType`` parameter; missing, the real server answers 500 (Spring's own error)."""
    task_type = _first(query, "taskType")
    if task_type is None:
        raise ApiError(
            500, "Required request parameter 'taskType' for method parameter type String is not present"
        )
    return task_type


def _int_param(query: Query, name: str, default: int | None) -> int | None:
    raw = _first(query, name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ApiError(
            500,
            f"Failed to convert value of type 'java.lang.String' to required type 'int'; "
            f'For input string: "{raw}" ({name})',
        ) from None


def _bool_param(query: Query, name: str, default: bool) -> bool:
    raw = _first(query, name)
    if raw is None or raw == "":
        return default
    return raw.lower() == "true"


def _parse_json(body: bytes, *, empty: Any = None) -> Any:
    if not body.strip():
        if empty is not None:
            return empty
        raise ApiError(500, "Required request body is missing")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(500, f"JSON parse error: {exc}") from None
    except RecursionError:
        raise ApiError(500, "JSON parse error: nested too deeply") from None


Handler = Callable[[dict[str, str], Query, bytes], Response]


class Api:
    """The routes of CONDUCTOR_PROTOCOL.md §2-§9 over a :class:`Store`, with optional token auth (§8)."""

    def __init__(
        self,
        store: Store,
        *,
        auth_key: str | None = None,
        auth_secret: str | None = None,
        token_ttl_seconds: float = 3600.0,
        instance: str | None = None,
    ) -> None:
        if (auth_key is None) != (auth_secret is None):
            raise ValueError("auth_key and auth_secret go together: give both or neither")
        self.store = store
        self._auth_key = auth_key
        self._auth_secret = auth_secret
        self.token_ttl_seconds = float(token_ttl_seconds)
        self._tokens: dict[str, float] = {}
        self._tokens_lock = threading.Lock()
        self.instance = instance or socket.gethostname()
        self._routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self._build_routes()

    @property
    def auth_enabled(self) -> bool:
        return self._auth_key is not None

    # ------------------------------------------------------------------------------------ auth

    def issue_token(self) -> str:
        token = secrets.token_urlsafe(32)
        with self._tokens_lock:
            self._tokens[token] = self.store.clock.monotonic() + self.token_ttl_seconds
        return token

    def expire_tokens(self) -> None:
        """Make every token issued so far expired (tests of the client's refresh path)."""
        with self._tokens_lock:
            for token in self._tokens:
                self._tokens[token] = -1.0

    def _auth_error(self, headers: dict[str, str]) -> Response | None:
        token = headers.get("x-authorization")
        with self._tokens_lock:
            expiry = self._tokens.get(token) if token else None
        if expiry is None:
            return _json({"error": "INVALID_TOKEN", "message": "Invalid or missing token"}, 401)
        if self.store.clock.monotonic() >= expiry:
            return _json({"error": "EXPIRED_TOKEN", "message": "Token has expired"}, 401)
        return None

    def _token(self, _h: dict[str, str], _q: Query, body: bytes) -> Response:
        data = _parse_json(body)
        if not isinstance(data, dict):
            raise ApiError(500, "Cannot deserialize the token request: expected a JSON object")
        key_ok = secrets.compare_digest(str(data.get("keyId", "")), self._auth_key or "")
        secret_ok = secrets.compare_digest(str(data.get("keySecret", "")), self._auth_secret or "")
        if not (key_ok and secret_ok):
            return _json({"error": "INVALID_CREDENTIALS", "message": "Invalid keyId or keySecret"}, 401)
        return _json({"token": self.issue_token()})

    # ------------------------------------------------------------------------------------ dispatch

    def handle(self, method: str, target: str, headers: dict[str, str], body: bytes) -> Response:
        """Answer one request; never raises."""
        try:
            parts = urlsplit(target)
            path = parts.path.rstrip("/") or "/"
            query = parse_qs(parts.query, keep_blank_values=True)
            if self.auth_enabled and path.startswith("/api/") and path not in OPEN_PATHS:
                denied = self._auth_error(headers)
                if denied is not None:
                    return denied
            path_matched = False
            for route_method, pattern, handler in self._routes:
                m = pattern.fullmatch(path)
                if m is None:
                    continue
                path_matched = True
                if route_method != method:
                    continue
                params = {k: unquote(v) for k, v in m.groupdict().items()}
                return handler(params, query, body)
            if path_matched:
                return self._error(405, f"Request method '{method}' is not supported")
            return self._error(404, f"No static resource {path.lstrip('/')}.")
        except ApiError as exc:
            return self._error(exc.status, exc.message, exc.retryable, exc.validation_errors)
        except Exception as exc:  # a bug: still a Conductor-shaped 500, never a traceback on the wire
            return self._error(500, f"Internal error: {type(exc).__name__}", retryable=False)

    def _error(
        self,
        status: int,
        message: str,
        retryable: bool = False,
        validation_errors: list[dict[str, Any]] | None = None,
    ) -> Response:
        body: dict[str, Any] = {
            "status": status,
            "message": message,
            "instance": self.instance,
            "retryable": retryable,
        }
        if validation_errors is not None:
            body["validationErrors"] = validation_errors
        return _json(body, status)

    def _route(self, method: str, pattern: str, handler: Handler) -> None:
        regex = re.sub(r"\{(\w+)\}", r"(?P<\1>[^/]+)", pattern)
        self._routes.append((method, re.compile(regex), handler))

    def _build_routes(self) -> None:
        s = self.store
        r = self._route
        r("GET", "/health", lambda p, q, b: _json(HEALTHY))
        r("GET", "/api/health", lambda p, q, b: _json(HEALTHY))
        if self.auth_enabled:
            r("POST", "/api/token", self._token)

        # metadata
        def register_task_defs(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.register_task_defs(_parse_json(b))
            return _OK_EMPTY

        def update_task_def(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.update_task_def(_parse_json(b))
            return _OK_EMPTY

        def delete_task_def(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.delete_task_def(p["name"])
            return _OK_EMPTY

        def register_workflow(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.register_workflow_def(_parse_json(b), overwrite=_bool_param(q, "overwrite", False))
            return _OK_EMPTY

        def update_workflows(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.update_workflow_defs(_parse_json(b))
            return _OK_EMPTY

        r("POST", "/api/metadata/taskdefs", register_task_defs)
        r("PUT", "/api/metadata/taskdefs", update_task_def)
        r("GET", "/api/metadata/taskdefs", lambda p, q, b: _json(s.list_task_defs()))
        r("GET", "/api/metadata/taskdefs/{name}", lambda p, q, b: _json(s.get_task_def(p["name"])))
        r("DELETE", "/api/metadata/taskdefs/{name}", delete_task_def)
        r("POST", "/api/metadata/workflow", register_workflow)
        r("PUT", "/api/metadata/workflow", update_workflows)
        r(
            "GET",
            "/api/metadata/workflow/{name}",
            lambda p, q, b: _json(s.get_workflow_def(p["name"], _int_param(q, "version", None))),
        )

        # workflows
        def start_request(p: dict[str, str], q: Query, b: bytes) -> Response:
            return _text(s.start_workflow_request(_parse_json(b)))

        def start_named(p: dict[str, str], q: Query, b: bytes) -> Response:
            return _text(
                s.start_workflow(
                    p["name"],
                    _parse_json(b, empty={}),
                    version=_int_param(q, "version", None),
                    correlation_id=_first(q, "correlationId"),
                    priority=_int_param(q, "priority", 0) or 0,
                )
            )

        def terminate(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.terminate_workflow(p["id"], _first(q, "reason"))
            return _OK_EMPTY

        def decide(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.decide(p["id"])
            return _OK_EMPTY

        r("POST", "/api/workflow", start_request)
        r("PUT", "/api/workflow/decide/{id}", decide)
        r("GET", "/api/workflow/{id}/status", lambda p, q, b: _json(s.get_workflow_status(p["id"])))
        r("POST", "/api/workflow/{name}", start_named)
        r(
            "GET",
            "/api/workflow/{id}",
            lambda p, q, b: _json(
                s.get_workflow(p["id"], include_tasks=_bool_param(q, "includeTasks", True))
            ),
        )
        r("DELETE", "/api/workflow/{id}", terminate)

        # tasks
        def poll_one(p: dict[str, str], q: Query, b: bytes) -> Response:
            got = s.poll(
                p["type"],
                count=1,
                timeout_ms=100,
                worker_id=_first(q, "workerid"),
                domain=_first(q, "domain"),
            )
            return _json(got[0]) if got else _NO_CONTENT

        def poll_batch(p: dict[str, str], q: Query, b: bytes) -> Response:
            got = s.poll(
                p["type"],
                count=_int_param(q, "count", 1) or 0,
                timeout_ms=_int_param(q, "timeout", 100) or 0,
                worker_id=_first(q, "workerid"),
                domain=_first(q, "domain"),
            )
            return _json(got)

        def update(p: dict[str, str], q: Query, b: bytes) -> Response:
            return _text(s.update_task(_parse_json(b)))

        def update_v2(p: dict[str, str], q: Query, b: bytes) -> Response:
            nxt = s.update_task_v2(_parse_json(b))
            return _json(nxt) if nxt is not None else _NO_CONTENT

        def add_log(p: dict[str, str], q: Query, b: bytes) -> Response:
            s.add_log(p["id"], b.decode("utf-8", errors="replace"))
            return _OK_EMPTY

        def get_logs(p: dict[str, str], q: Query, b: bytes) -> Response:
            logs = s.get_logs(p["id"])
            return _json(logs) if logs else _NO_CONTENT

        def poll_data(p: dict[str, str], q: Query, b: bytes) -> Response:
            task_type = _task_type_param(q)
            if not task_type:
                problem = {"path": "getPollData.arg0", "message": "TaskType cannot be null or empty.",
                           "invalidValue": ""}
                raise ApiError(400, "Validation failed, check below errors for detail.",
                               validation_errors=[problem])
            return _json(s.poll_data(task_type))

        def queue_size(p: dict[str, str], q: Query, b: bytes) -> Response:
            # An empty domain= is the default queue here (unlike a poll's), as on the real server.
            return _json(s.queue_size(_task_type_param(q), _first(q, "domain") or None))

        def queue_sizes(p: dict[str, str], q: Query, b: bytes) -> Response:
            if "taskType" not in q:  # the real server fails on its null list
                raise ApiError(
                    500, 'Cannot invoke "java.util.List.iterator()" because "taskDefNames" is null'
                )
            return _json({name: s.queue_size(name) for name in sorted(set(q["taskType"])) if name})

        r("GET", "/api/tasks/poll/batch/{type}", poll_batch)
        r("GET", "/api/tasks/poll/{type}", poll_one)
        r("POST", "/api/tasks", update)
        r("POST", "/api/tasks/update-v2", update_v2)
        r("GET", "/api/tasks/queue/polldata", poll_data)
        r("GET", "/api/tasks/queue/polldata/all", lambda p, q, b: _json(s.poll_data(None)))
        r("GET", "/api/tasks/queue/size", queue_size)
        r("GET", "/api/tasks/queue/sizes", queue_sizes)  # deprecated upstream, still served
        r("GET", "/api/tasks/queue/all", lambda p, q, b: _json(s.listed_queue_sizes()))
        r("POST", "/api/tasks/{id}/log", add_log)
        r("GET", "/api/tasks/{id}/log", get_logs)
        r("GET", "/api/tasks/{id}", lambda p, q, b: _json(s.get_task(p["id"])))


# ---------------------------------------------------------------------------------------------- sockets

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
    server: _HTTPServer

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
            response = self.server.api._error(exc.status, exc.message)
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


class _HTTPServer(ThreadingHTTPServer):
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
