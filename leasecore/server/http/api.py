"""The embedded server's API: routes, token auth and Conductor-shaped errors, over a ``Store``.

Owns: :class:`Api`, which maps ``(method, target, headers, body)`` to a :class:`Response` and never
raises: every failure becomes a Conductor-shaped JSON error (``{status, message, instance,
retryable, validationErrors?}``), never a traceback; the routes of CONDUCTOR_PROTOCOL.md §2-§9, the
query parameters' conversions as the real server does them (its 500s included), and the tokens of
§8 (issued, expired, compared in constant time).

Must not: touch sockets or framing (``server.httpd``), keep task state (``server.store`` does).
Threads: any of the HTTP server's request threads at once; the tokens under their own lock, the rest
under the store's.
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from leasecore.server.store import ApiError, Store

JSON_TYPE = "application/json"
TEXT_TYPE = "text/plain;charset=UTF-8"
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
                return self.error(405, f"Request method '{method}' is not supported")
            return self.error(404, f"No static resource {path.lstrip('/')}.")
        except ApiError as exc:
            return self.error(exc.status, exc.message, exc.retryable, exc.validation_errors)
        except Exception as exc:  # a bug: still a Conductor-shaped 500, never a traceback on the wire
            return self.error(500, f"Internal error: {type(exc).__name__}", retryable=False)

    def error(
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
