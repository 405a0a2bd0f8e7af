"""The Conductor HTTP client: the server's calls as typed methods (CONDUCTOR_PROTOCOL.md).

Owns: what each call sends and what its answer means (poll, update, update-v2, extendLease, the
task's ownership, logs, health), as models and errors of the pure core. Every request goes through
one :class:`~leasecore.conductor.sender.RequestSender` (URLs, headers, deadlines, token auth, the
transport, error translation). Does not own: retries, sleeps, lease decisions (callers decide what a
failure means), printing.

Must not touch: leases, children, state files. Threads: any; one client is shared by the pollers,
the lease engine's senders and the reporter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from leasecore.clock import Clock
from leasecore.conductor.admin import ConductorAdmin
from leasecore.conductor.auth import DEFAULT_TOKEN_TTL_SECONDS, TokenManager
from leasecore.conductor.calls import (
    JSON,
    TEXT_OR_JSON,
    Reply,
    error_for_status,
    path_segment,
    protocol_error,
    translate_errors,
)
from leasecore.conductor.sender import ABORTED_CALL_SECONDS, MAX_BODY_BYTES, POOL_MAXSIZE, RequestSender
from leasecore.conductor.transport import Transport
from leasecore.errors import (
    ConductorAuthError,
    ConductorNotFound,
    ConductorProtocolError,
    ConductorRejected,
    ConductorUnavailable,
)
from leasecore.lease.finalfailure import transport_may_resend
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus

if TYPE_CHECKING:  # requests is imported only when the lean transport does not serve
    import requests

__all__ = [
    "ABORTED_CALL_SECONDS",
    "MAX_BODY_BYTES",
    "POOL_MAXSIZE",
    "ConductorAdmin",
    "ConductorClient",
    "Reply",
    "error_for_status",
    "translate_errors",
]


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
        self._sender = RequestSender(
            base_url,
            auth_key=auth_key,
            auth_secret=auth_secret,
            auth_token=auth_token,
            session=session,
            timeout_seconds=timeout_seconds,
            clock=clock,
            user_agent=user_agent,
            token_ttl_seconds=token_ttl_seconds,
            pool_maxsize=pool_maxsize,
            transport=transport,
            ca_bundle=ca_bundle,
        )
        self.base_url = self._sender.base_url
        self.root_url = self._sender.root_url

    def __repr__(self) -> str:
        return f"ConductorClient(base_url={self.base_url!r}, auth={'on' if self.auth else 'off'})"

    @property
    def auth(self) -> TokenManager | None:
        """The token manager, when credentials were given."""
        return self._sender.auth

    @property
    def request_hook(self) -> Callable[[str, str, str, float], None] | None:
        """Metrics: called with (method, uri template, status code or "error", seconds) after each
        request."""
        return self._sender.request_hook

    @request_hook.setter
    def request_hook(self, hook: Callable[[str, str, str, float], None] | None) -> None:
        self._sender.request_hook = hook

    @property
    def connections_opened(self) -> int | None:
        """Connections the lean transport opened so far (None: calls go through requests)."""
        return self._sender.transport.connections_opened

    @property
    def transport(self) -> Transport:
        """The transport every call goes through (chosen by ``open_transport``, or given)."""
        return self._sender.transport

    def abort(self) -> None:
        """A forced stop (the second signal): cut every call in flight now instead of letting it
        wait for its timeout (a silent server held the last result's report for 10 s); calls made
        from now on get at most ``ABORTED_CALL_SECONDS``, so a healthy server still takes the last
        reports while a silent one costs a second each. Thread-safe; idempotent."""
        self._sender.abort()

    def close(self) -> None:
        """Release pooled connections (an injected session is left open: its owner closes it)."""
        self._sender.transport.close()

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
        budget = max(0, timeout_ms) / 1000.0 + self._sender.timeout_seconds  # the server holds the call
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
        """Report a result with v1 ``POST /api/tasks`` (claims nothing; see ``update_v2``). Sent once
        more by the transport, on a kept-alive connection that died under it, only if it is terminal
        (``finalfailure.transport_may_resend``: a yield sent again could re-queue its next run)."""
        self.request(
            "POST",
            "/tasks",
            json_body=result.encoded(),
            accept=TEXT_OR_JSON,
            timeout_seconds=timeout_seconds,
            idempotent=transport_may_resend(result.status),
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
        """One call to ``{base_url}{path}`` (``root=True``: the server root), errors translated
        (:meth:`RequestSender.request <leasecore.conductor.sender.RequestSender.request>`)."""
        return self._sender.request(
            method, path, params=params, json_body=json_body, text_body=text_body, accept=accept,
            timeout_seconds=timeout_seconds, root=root, idempotent=idempotent, uri=uri,
        )  # fmt: skip


def _int_or_zero(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0
