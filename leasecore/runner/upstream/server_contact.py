"""Server contact as ``conductor-run status`` shows it: the outcome of every call, not only of polls.

With every slot busy the pollers do not poll, yet the heartbeats, ownership checks, log posts and
final updates keep talking to the server; counting only polls made a healthy runner look silent
("last call 13 s ago"). ``ServerContact`` keeps the newest answer (a monotonic instant) and the
failures since it; ``RecordedCalls`` (the runner's port) and ``RecordedLeaseCalls`` (the lease
engine's port) wrap the client so that each call records how it went. On success that is one
``monotonic()`` call and two attribute stores: nothing more on the heartbeat path.

A 404 is an answer (the server is there; the task is gone). Every other ``ConductorError`` is a
failed call, as for polls. The counters are for display: they are written without a lock on the
success path, so a failure racing a success may be counted or reset a moment early.

Must not: retry, translate or swallow an error (each call raises what the client raised).
The wrapped ports are ``runner.ports.ConductorPort`` and ``LeasePort``.
Threads: any: the pollers, the reporter's and log senders, the engine's senders, the main loop.
"""

from __future__ import annotations

import threading

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorError, ConductorNotFound
from leasecore.models import Task, TaskOwnership, TaskResult
from leasecore.runner.ports import ConductorPort, LeasePort


class ServerContact:
    """The newest answer from the server and the failed calls since; written by any thread."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._monotonic = (clock or SystemClock()).monotonic
        self._lock = threading.Lock()  # failures only: the success path takes no lock
        self.last_ok_at: float | None = None  # monotonic instant of the newest answer
        self.consecutive_failures = 0  # failed calls since that answer
        self.last_error: str | None = None  # the newest failure's message

    def answered(self) -> None:
        """A call got an answer (a 404 included)."""
        self.last_ok_at = self._monotonic()
        self.consecutive_failures = 0

    def failed(self, error: ConductorError) -> None:
        """A call failed: unreachable, timed out, 5xx, refused credentials, another 4xx."""
        with self._lock:
            self.consecutive_failures += 1
            self.last_error = str(error)


class RecordedCalls:
    """The runner's calls (poll, update, append_log) on ``inner``, each recorded in ``server_contact``."""

    def __init__(self, inner: ConductorPort, contact: ServerContact) -> None:
        self._inner = inner
        self._contact = contact

    def poll(
        self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[Task]:
        try:
            tasks = self._inner.poll(task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id,
                                     domain=domain)
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()
        return tasks

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        try:
            self._inner.update(result, timeout_seconds=timeout_seconds)
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        """The inner port's update-v2 (only called when it has one: ``leasecore.runner.chain``)."""
        try:
            claimed: Task | None = self._inner.update_v2(result, timeout_seconds=timeout_seconds)  # type: ignore[attr-defined]
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()
        return claimed

    def append_log(self, task_id: str, text: str, *, timeout_seconds: float | None = None) -> None:
        try:
            self._inner.append_log(task_id, text, timeout_seconds=timeout_seconds)
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()


class RecordedLeaseCalls:
    """The lease engine's calls (heartbeats, ownership checks) on ``inner``, recorded in
    ``server_contact``."""

    def __init__(self, inner: LeasePort, contact: ServerContact) -> None:
        self._inner = inner
        self._contact = contact

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        try:
            self._inner.extend_lease(task_id, workflow_id, timeout_seconds=timeout_seconds)
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        try:
            owner = self._inner.get_task_ownership(task_id, timeout_seconds=timeout_seconds)
        except ConductorError as exc:
            _record_failure(self._contact, exc)
            raise
        self._contact.answered()
        return owner


def _record_failure(contact: ServerContact, exc: ConductorError) -> None:
    if isinstance(exc, ConductorNotFound):
        contact.answered()  # the server answered: the task is gone, which the caller handles
    else:
        contact.failed(exc)
