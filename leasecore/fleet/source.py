"""The two server calls behind ``conductor-run fleet``, their answers' shapes checked.

Shapes: docs/real-server-notes.md "Queues and poll data".

``GET /api/tasks/queue/all`` and ``GET /api/tasks/queue/polldata/all``: two requests per refresh,
however many task types and workers there are. Errors are the client's (``ConductorError`` subclasses);
an answer of the wrong shape is :class:`~leasecore.errors.ConductorProtocolError`.

Must not: render or judge (that is ``fleet.view``, pure). Threads: the caller's (``cli/fleet.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from leasecore.conductor.calls import protocol_error
from leasecore.conductor.client import ConductorClient


@dataclass(frozen=True)
class FleetAnswers:
    """What the server said: queue sizes by queue name, and its poll records."""

    queue_sizes: dict[str, int]
    poll_data: list[dict[str, Any]]


def read_fleet(client: ConductorClient, *, timeout_seconds: float | None = None) -> FleetAnswers:
    """Ask the server for every queue's size and every poll record."""
    reply = client.request("GET", "/tasks/queue/all", timeout_seconds=timeout_seconds)
    sizes = reply.json()
    if not isinstance(sizes, dict) or not all(
        isinstance(name, str) and isinstance(size, int) and not isinstance(size, bool)
        for name, size in sizes.items()
    ):
        protocol_error(reply, "expected a JSON object of queue name -> size")
    reply = client.request("GET", "/tasks/queue/polldata/all", timeout_seconds=timeout_seconds)
    polls = reply.json()
    if not isinstance(polls, list) or not all(_is_poll_record(item) for item in polls):
        protocol_error(reply, "expected a JSON list of {queueName, lastPollTime, ...} poll records")
    return FleetAnswers(dict(sizes), list(polls))


def _is_poll_record(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    last = item.get("lastPollTime")
    return (
        isinstance(item.get("queueName"), str)
        and isinstance(last, int)
        and not isinstance(last, bool)
        and isinstance(item.get("domain", ""), str | None)
        and isinstance(item.get("workerId", ""), str | None)
    )
