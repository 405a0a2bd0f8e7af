"""The Conductor HTTP client: the one place that speaks HTTP to the server (CONDUCTOR_PROTOCOL.md).

Owns: URLs, headers, per-attempt timeouts and token auth (through :mod:`leasecore.conductor.auth`). The bytes
go through one :class:`~leasecore.conductor.transport.Transport`, chosen once in
:func:`~leasecore.conductor.transport.open_transport`; every library error and HTTP status is
translated into the project's exception tree in one place, :mod:`leasecore.conductor.calls`. Does not
own: retries, sleeps, lease decisions (callers decide what a failure means), printing.

Must not touch: leases, children, state files. Threads: any; one client is shared by the pollers,
the lease engine's senders and the reporter (the transport pools connections per thread, auth's
token refresh is single-flight).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

from leasecore import __version__
from leasecore.clock import Clock, SystemClock
from leasecore.conductor.admin import ConductorAdmin
from leasecore.conductor.auth import DEFAULT_TOKEN_TTL_SECONDS, TokenManager
from leasecore.conductor.calls import (
    JSON,
    TEXT_OR_JSON,
    Reply,
    error_for_status,
    is_token_rejection,
    path_segment,
    protocol_error,
    translate_errors,
)
from leasecore.conductor.transport import Transport, open_transport
from leasecore.errors import (
    ConductorAuthError,
    ConductorError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
    ConfigError,
)
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus

if TYPE_CHECKING:  # requests is imported only when the lean transport does not serve
    import requests

__all__ = ["ConductorAdmin", "ConductorClient", "Reply", "error_for_status", "translate_errors"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 1024 * 1024  # a batch of large tasks fits; a runaway answer does not
POOL_MAXSIZE = 32  # >= the threads that share one client (poll loop, heartbeat senders, reporter)
ABORTED_CALL_SECONDS = 1.0  # the bound on a call made after abort() (a forced stop)


class ConductorClient:
    """Typed calls to a Conductor server; thread-safe, one instance shared by every thread.

    ``timeout_seconds`` (constructor default, or per call) bounds one attempt: connect, the answer and
    its body, and any token refresh the attempt needs. Every call raises only
    :class:`~leasecore.errors.ConductorError` subclasses.
    """

    def __init__(
        self,
        base_url: str = "http://localhost:8080/api",
        *,
        auth_key: str | None = None,
        auth_secret: str | None = None,
        auth_token: str | None = None,
        session: requests.Session | None = None,
        timeout_seconds: float = 10.0,
        clock: Clock | None = None,
        user_agent: str | None = None,
        token_ttl_seconds: float = DEFAULT_TOKEN_TTL_SECONDS,
        pool_maxsize: int = POOL_MAXSIZE,
        transport: Transport | None = None,
        ca_bundle: str | None = None,
    ) -> None:
        """``ca_bundle``: PEM file (or directory) of the CAs to trust for https:// (None: certifi's,
        or what REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE name, as requests does)."""
        self.base_url = _check_base_url(base_url)
        self.root_url = self.base_url.removesuffix("/api")  # /health lives at the root
        if not (timeout_seconds > 0 and math.isfinite(timeout_seconds)):
            raise ConfigError(f"timeout must be a positive number of seconds, not {timeout_seconds!r}")
        self._timeout_seconds = timeout_seconds
        self._clock: Clock = clock or SystemClock()
        self._user_agent = user_agent or f"conductor-run/{__version__}"
        # Metrics: (method, uri template, status code or "error", seconds) after each request.
        self.request_hook: Callable[[str, str, str, float], None] | None = None
        if transport is not None and session is not None:
            raise TypeError("give a session or a transport, not both")
        # The one choice of transport (lean socket for plain HTTP without a proxy; requests for https,
        # proxies and an injected session); ``transport=`` replaces it (tests, embedding callers).
        self._transport: Transport = transport or open_transport(
            self.base_url,
            session=session,
            verify=ca_bundle or True,
            pool_maxsize=pool_maxsize,
            max_body_bytes=MAX_BODY_BYTES,
            monotonic=self._clock.monotonic,
        )
        self._aborted = False  # abort() was called: calls are cut short (a forced stop)
        origin_length = len("{0.scheme}://{0.netloc}".format(urlsplit(self.base_url)))
        self._api_target = self.base_url[origin_length:]  # what follows host:port in a request line
        self._root_target = self.root_url[origin_length:]
        key, secret = (auth_key or "").strip(), (auth_secret or "").strip()
        if bool(key) != bool(secret):
            missing = "auth_secret" if key else "auth_key"
            raise ConfigError(
                f"{missing} is missing: give both the auth key and secret, or neither", key=missing
            )
        self._key_id = key
        self._key_secret = secret
        self._auth: TokenManager | None = None
        if key:
            self._auth = TokenManager(self._fetch_token, clock=self._clock, ttl_seconds=token_ttl_seconds)
        elif auth_token and auth_token.strip():  # conductor-cli's CONDUCTOR_AUTH_TOKEN: as given, always
            fixed = auth_token.strip()
            if any(char in fixed for char in "\r\n\0"):
                raise ConfigError("auth_token holds a line break: not a header value", key="auth_token")
            self._auth = TokenManager(
                lambda _timeout: fixed, clock=self._clock, ttl_seconds=token_ttl_seconds
            )

    def __repr__(self) -> str:
        return f"ConductorClient(base_url={self.base_url!r}, auth={'on' if self._auth else 'off'})"

    @property
    def auth(self) -> TokenManager | None:
        """The token manager, when credentials were given."""
        return self._auth

    @property
    def connections_opened(self) -> int | None:
        """Connections the lean transport opened so far (None: calls go through requests)."""
        return self._transport.connections_opened

    @property
    def transport(self) -> Transport:
        """The transport every call goes through (chosen by ``open_transport``, or given)."""
        return self._transport

    def abort(self) -> None:
        """A forced stop (the second signal): cut every call in flight now instead of letting it
        wait for its timeout (a silent server held the last result's report for 10 s); calls made
        from now on get at most ``ABORTED_CALL_SECONDS``, so a healthy server still takes the last
        reports while a silent one costs a second each. Thread-safe; idempotent."""
        self._aborted = True
        self._transport.abort()

    def close(self) -> None:
        """Release pooled connections (an injected session is left open: its owner closes it)."""
        self._transport.close()

    def __enter__(self) -> ConductorClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- worker calls -------------------------------------------------------------------------------

    def poll(
        self,
        task_type: str,
        *,
        count: int,
        timeout_ms: int,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[Task]:
        """Batch long poll; ``[]`` when nothing came within ``timeout_ms`` (200 ``[]`` or 204)."""
        params: dict[str, str | int] = {"count": count, "timeout": timeout_ms}
        if worker_id:
            params["workerid"] = worker_id
        if domain:  # an empty domain names another queue (§2): omit it
            params["domain"] = domain
        budget = max(0, timeout_ms) / 1000.0 + self._timeout_seconds  # the server holds the call
        reply = self.request(
            "GET",
            f"/tasks/poll/batch/{path_segment(task_type)}",
            params=params,
            timeout_seconds=budget,
            idempotent=False,  # a lost answer loses the tasks it claimed: never send a poll twice
            uri="/tasks/poll/batch/{taskType}",
        )
        if reply.status_code == 204 or not reply.body.strip():
            return []
        items = reply.json()
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            protocol_error(reply, "expected a JSON list of tasks")
        return [Task.from_json(item) for item in items]

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        """Report a result with v1 ``POST /api/tasks`` (claims nothing; see ``update_v2``)."""
        self.request(
            "POST",
            "/tasks",
            json_body=result.encoded(),
            accept=TEXT_OR_JSON,
            timeout_seconds=timeout_seconds,
            idempotent=True,  # Conductor ignores a second terminal update of a task
        )

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        """Report a result with ``POST /api/tasks/update-v2``, which also claims work: for a terminal
        result the server polls one more task of the same type and domain for ``result.worker_id``
        and returns it (200 + the task), else 204 (CONDUCTOR_PROTOCOL.md §3; on 3.32.1 a second
        terminal update of a task claims again). The caller runs the task it gets, or hands it back.

        Never resent by the transport (a lost answer loses the task it claimed, as with a poll). A
        server without the endpoint answers 404 or 405 (:class:`ConductorRejected`); so does one that
        no longer knows the task (404): the caller tells them apart (``leasecore.runner.chain``).
        """
        reply = self.request(
            "POST",
            "/tasks/update-v2",
            json_body=result.encoded(),
            timeout_seconds=timeout_seconds,
            idempotent=False,
        )
        if reply.status_code == 204 or not reply.body.strip():
            return None
        data = reply.json()
        if not isinstance(data, dict) or not data.get("taskId"):
            protocol_error(reply, "expected a JSON task or no content")
        return Task.from_json(data)

    def extend_lease(
        self,
        task_id: str,
        workflow_id: str,
        *,
        worker_id: str | None = None,
        timeout_seconds: float | None = None,
    ) -> None:
        """Heartbeat: reset the task's response-timeout window (``extendLease: true``, §3)."""
        body: dict[str, Any] = {
            "taskId": task_id,
            "workflowInstanceId": workflow_id,
            "status": TaskStatus.IN_PROGRESS.value,
            "extendLease": True,
        }
        if worker_id:
            body["workerId"] = worker_id
        self.request(
            "POST",
            "/tasks",
            json_body=body,
            accept=TEXT_OR_JSON,
            timeout_seconds=timeout_seconds,
            idempotent=True,
        )

    def get_task(self, task_id: str, *, timeout_seconds: float | None = None) -> dict[str, Any]:
        """The task as the server has it; :class:`ConductorNotFound` when it is gone."""
        reply = self.request("GET", f"/tasks/{path_segment(task_id)}", timeout_seconds=timeout_seconds,
                             uri="/tasks/{taskId}")
        data = reply.json()
        if not isinstance(data, dict):
            protocol_error(reply, "expected a JSON object")
        return data

    def get_task_status(self, task_id: str, *, timeout_seconds: float | None = None) -> TaskStatus | None:
        """The task's status on the server, or ``None`` when the server does not know the task."""
        ownership = self.get_task_ownership(task_id, timeout_seconds=timeout_seconds)
        return None if ownership is None else ownership.status

    def get_task_ownership(
        self, task_id: str, *, timeout_seconds: float | None = None
    ) -> TaskOwnership | None:
        """Status, pollCount and workerId of the task on the server; ``None`` when it is unknown (404)."""
        try:
            data = self.get_task(task_id, timeout_seconds=timeout_seconds)
        except ConductorNotFound:
            return None
        try:
            status = TaskStatus(str(data.get("status")))
        except ValueError:
            raise ConductorProtocolError(
                f"GET /tasks/{task_id}: unknown task status {str(data.get('status'))[:40]!r}",
                method="GET",
                path=f"/tasks/{task_id}",
            ) from None
        worker_id = data.get("workerId")
        return TaskOwnership(
            status=status,
            poll_count=_int_or_zero(data.get("pollCount")),
            worker_id=worker_id if isinstance(worker_id, str) and worker_id else None,
        )

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None:
        """Append one execution-log line (raw ``text/plain`` body, §6)."""
        self.request(
            "POST", f"/tasks/{path_segment(task_id)}/log", text_body=text, timeout_seconds=timeout_seconds,
            uri="/tasks/{taskId}/log",
        )

    def health(self, *, timeout_seconds: float | None = None) -> bool:
        """``GET /health``: True when healthy, False when the server answers but not healthily.

        Raises :class:`ConductorUnavailable` when the server cannot be reached at all, and
        :class:`ConductorAuthError` when it refuses the credentials.
        """
        try:
            reply = self.request("GET", "/health", root=True, timeout_seconds=timeout_seconds)
        except ConductorUnavailable as exc:
            if exc.status_code is None:
                raise
            return False
        except ConductorAuthError:
            raise  # refused credentials are not "unhealthy": the caller must say so
        except ConductorRejected:
            return False
        try:
            data = json.loads(reply.body) if reply.body.strip() else {}
        except (ValueError, RecursionError):
            return True
        return not (isinstance(data, dict) and data.get("healthy") is False)

    # -- transport ----------------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str | int] | None = None,
        json_body: Any = None,
        text_body: str | None = None,
        accept: str = JSON,
        timeout_seconds: float | None = None,
        root: bool = False,
        idempotent: bool | None = None,
        uri: str | None = None,
    ) -> Reply:
        """One call to ``{base_url}{path}`` (``root=True``: the server root), errors translated.

        ``uri``: the path's template for ``request_hook`` (default: the path itself). ``json_body``
        is encoded with ``json.dumps``, unless it is ``bytes``: JSON encoded already, sent as is.

        A 2xx comes back as a :class:`Reply`; anything else raises. With auth, a rejected token is
        refreshed and the request sent once more, within the same deadline. ``idempotent`` (default:
        GET, HEAD, PUT, DELETE) allows one resend on a fresh connection when a kept-alive one turns
        out dead under the request.
        """
        hook = self.request_hook
        if hook is None:
            return self._request(method, path, params, json_body, text_body, accept, timeout_seconds, root,
                                 idempotent)
        started = self._clock.monotonic()
        status = "error"
        try:
            reply = self._request(method, path, params, json_body, text_body, accept, timeout_seconds, root,
                                  idempotent)
            status = str(reply.status_code)
            return reply
        except ConductorError as exc:
            status = str(exc.status_code) if exc.status_code else "error"
            raise
        finally:
            hook(method, uri or path, status, self._clock.monotonic() - started)

    def _request(
        self,
        method: str,
        path: str,
        params: Mapping[str, str | int] | None,
        json_body: Any,
        text_body: str | None,
        accept: str,
        timeout_seconds: float | None,
        root: bool,
        idempotent: bool | None,
    ) -> Reply:
        if idempotent is None:
            idempotent = method in ("GET", "HEAD", "PUT", "DELETE")
        budget = self._timeout_seconds if timeout_seconds is None else timeout_seconds
        generation = self._transport.generation  # before the abort check: an abort after it cuts this call
        if self._aborted:
            budget = min(budget, ABORTED_CALL_SECONDS)
        deadline = self._clock.monotonic() + budget
        target = (self._root_target if root else self._api_target) + path
        if params:
            target += "?" + urlencode(params)
        headers = {"User-Agent": self._user_agent, "Accept": accept}
        data: bytes | None = None
        if json_body is not None:
            headers["Content-Type"] = JSON
            # bytes are JSON already encoded (a TaskResult's ``encoded()``): sent as they are
            data = json_body if isinstance(json_body, bytes) else json.dumps(json_body).encode("utf-8")
        elif text_body is not None:
            headers["Content-Type"] = "text/plain; charset=utf-8"
            data = text_body.encode("utf-8")
        token = self._auth.current(self._remaining(deadline, method, path)) if self._auth else None
        send = (method, path, target or "/", data)
        reply = self._send(
            *send, _with_token(headers, token), deadline, idempotent=idempotent, generation=generation
        )
        if token is not None and self._auth is not None and is_token_rejection(reply):
            token = self._auth.refresh_rejected(token, self._remaining(deadline, method, path))
            reply = self._send(
                *send, _with_token(headers, token), deadline, idempotent=idempotent, generation=generation
            )
        error = error_for_status(method, path, reply.status_code, reply.body, secrets=self._secrets())
        if error is not None:
            if isinstance(error, ConductorAuthError) and not self._auth:
                error.args = (f"{error} (the server wants credentials: set CONDUCTOR_AUTH_KEY/SECRET)",)
                error.without_credentials = True  # the message says what to set: callers add no hint
            raise error
        return reply

    def _send(
        self,
        method: str,
        path: str,
        target: str,
        data: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool = False,
        generation: int | None = None,
    ) -> Reply:
        self._remaining(deadline, method, path)
        with translate_errors(method, path):
            status, body = self._transport.send(
                method, target, data, headers, deadline, idempotent=idempotent, generation=generation
            )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s -> HTTP %d, %d bytes", method, target, status, len(body))
        return Reply(method=method, path=path, status_code=status, body=body)

    def _remaining(self, deadline: float, method: str, path: str) -> float:
        remaining = deadline - self._clock.monotonic()
        if remaining <= 0:
            raise ConductorUnavailable(
                f"{method} {path}: no time left for the attempt", method=method, path=path
            )
        return remaining

    def _secrets(self) -> tuple[str, ...]:
        known = self._auth.known_tokens() if self._auth else ()
        return (*known, self._key_secret) if self._key_secret else known

    def _fetch_token(self, timeout_seconds: float) -> str | None:
        """``POST {base}/token`` -> the token; ``None`` when the server has no such endpoint (OSS)."""
        method, path = "POST", "/token"
        deadline = self._clock.monotonic() + timeout_seconds
        body = json.dumps({"keyId": self._key_id, "keySecret": self._key_secret}).encode("utf-8")
        headers = {"User-Agent": self._user_agent, "Accept": JSON, "Content-Type": JSON}
        reply = self._send(method, path, self._api_target + path, body, headers, deadline)
        if reply.status_code in (404, 405):
            return None
        error = error_for_status(method, path, reply.status_code, reply.body, secrets=self._secrets())
        if isinstance(error, ConductorRejected) and reply.status_code in (400, 401, 403):
            raise ConductorAuthError(
                f"the server refused the auth key and secret (HTTP {reply.status_code})",
                method=method,
                path=path,
                status_code=reply.status_code,
                body_excerpt=error.body_excerpt,
            )
        if error is not None:
            raise error
        try:
            token = json.loads(reply.body).get("token")
        except (ValueError, AttributeError, RecursionError):
            token = None
        if not isinstance(token, str) or not token:
            raise ConductorProtocolError(
                "POST /token: answer has no token", method=method, path=path, status_code=reply.status_code
            )
        return token


def _int_or_zero(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _with_token(headers: Mapping[str, str], token: str | None) -> dict[str, str]:
    return {**headers, "X-Authorization": token} if token else dict(headers)


def _check_base_url(base_url: str) -> str:
    parts = urlsplit(base_url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"server URL must look like http://host:8080/api, not {base_url!r}", key="server.url"
        )
    return base_url.strip().rstrip("/")
