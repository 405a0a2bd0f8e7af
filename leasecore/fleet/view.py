"""The fleet view: per task type and domain, the queue depth and the workers polling it (pure).

Built from two answers of the server alone (``leasecore.fleet.source`` fetches them):

- ``GET /api/tasks/queue/all``: ``{queueName: size}``, where a queue name is ``taskType`` or
  ``domain:taskType``; names starting with ``_`` are the server's own (``_deciderQueue``);
- ``GET /api/tasks/queue/polldata/all``: ``[{queueName, domain?, workerId?, lastPollTime}]``, where
  ``queueName`` is the task type and ``lastPollTime`` is server epoch milliseconds.

The server keeps one poll record per task type and domain, the last poller's (docs/real-server-notes.md
"Queues and poll data"): N workers polling one type show as the one that polled last.

A row is *stalled* when work is queued and nobody polled it within :data:`ACTIVE_POLL_SECONDS`.
Stalled rows come first (deepest queue first), then the rest by task type and domain.

Threads: any (pure).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

ACTIVE_POLL_SECONDS = 10.0
"""A worker counts as polling when its last poll is at most this old: Conductor's own notion of an
active worker (``conductor.app.activeWorkerLastPollTimeout``, default 10 s), which decides whether a
domain gets tasks. A runner polls about once a second while it has a free slot."""

INTERNAL_QUEUE_PREFIX = "_"  # _deciderQueue and the like: not task types


@dataclass(frozen=True)
class WorkerPoll:
    """One worker's last poll of a task type and domain."""

    worker_id: str | None  # None: polled without a workerid parameter
    last_poll_age_seconds: float


@dataclass(frozen=True)
class FleetRow:
    """One task type in one domain (``domain`` None: the default queue)."""

    task_type: str
    domain: str | None
    queue_depth: int
    workers: tuple[WorkerPoll, ...]
    active_seconds: float = ACTIVE_POLL_SECONDS

    @property
    def recently_polled(self) -> bool:
        return any(w.last_poll_age_seconds <= self.active_seconds for w in self.workers)

    @property
    def stalled(self) -> bool:
        """Work is queued and no worker polled it recently."""
        return self.queue_depth > 0 and not self.recently_polled

    @property
    def state(self) -> str:
        """``stalled``, ``active`` (a recent poll) or ``idle`` (nothing queued, no recent poll)."""
        if self.stalled:
            return "stalled"
        return "active" if self.recently_polled else "idle"


def split_queue_name(name: str) -> tuple[str, str | None]:
    """``domain:taskType`` -> (taskType, domain); ``taskType`` -> (taskType, None)."""
    domain, sep, task_type = name.partition(":")
    return (task_type, domain) if sep else (name, None)


def fleet_rows(
    queue_sizes: Mapping[str, int],
    poll_data: Iterable[Mapping[str, Any]],
    *,
    now_ms: int,
    task_types: Sequence[str] = (),
    active_seconds: float = ACTIVE_POLL_SECONDS,
) -> list[FleetRow]:
    """Join the two answers into sorted rows; ``task_types`` (when given) keeps only those types and
    adds a row for each one the server knows nothing about (depth 0, no workers).

    ``now_ms`` is this host's clock: ages assume it agrees with the server's (they are clamped at 0).
    """
    wanted = set(task_types)
    depths: dict[tuple[str, str | None], int] = {}
    for name, size in queue_sizes.items():
        if name.startswith(INTERNAL_QUEUE_PREFIX):
            continue
        key = split_queue_name(name)
        depths[key] = depths.get(key, 0) + size
    workers: dict[tuple[str, str | None], list[WorkerPoll]] = {}
    for entry in poll_data:
        domain = entry.get("domain")
        worker = entry.get("workerId")
        key = (str(entry["queueName"]), domain if isinstance(domain, str) else None)
        age = max(0.0, (now_ms - int(entry["lastPollTime"])) / 1000.0)
        workers.setdefault(key, []).append(
            WorkerPoll(worker if isinstance(worker, str) else None, round(age, 3))
        )
    keys = set(depths) | set(workers)
    if wanted:
        keys = {key for key in keys if key[0] in wanted}
        keys |= {(t, None) for t in wanted if not any(key[0] == t for key in keys)}
    rows = [
        FleetRow(
            task_type=key[0],
            domain=key[1],
            queue_depth=depths.get(key, 0),
            workers=tuple(sorted(workers.get(key, ()), key=_youngest_first)),
            active_seconds=active_seconds,
        )
        for key in keys
    ]
    return sorted(rows, key=_order)


def _youngest_first(poll: WorkerPoll) -> tuple[float, str]:
    return (poll.last_poll_age_seconds, poll.worker_id or "")


def _order(row: FleetRow) -> tuple[bool, int, str, str, bool]:
    return (not row.stalled, -row.queue_depth if row.stalled else 0, row.task_type, row.domain or "",
            row.domain is not None)


def fleet_document(
    server_url: str, rows: Sequence[FleetRow], *, active_seconds: float = ACTIVE_POLL_SECONDS
) -> dict[str, Any]:
    """The ``fleet --json`` document (docs/deployment.md "The fleet view")."""
    return {
        "server": server_url,
        "activePollSeconds": active_seconds,
        "taskTypes": [
            {
                "taskType": row.task_type,
                "domain": row.domain,
                "queueDepth": row.queue_depth,
                "state": row.state,
                "stalled": row.stalled,
                "workers": [
                    {"workerId": w.worker_id, "lastPollAgeSeconds": w.last_poll_age_seconds}
                    for w in row.workers
                ],
            }
            for row in rows
        ],
    }
