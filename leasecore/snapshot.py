"""The status snapshot schema: frozen values, their JSON form, and lease health; pure, stdlib only.

A runner publishes a :class:`RunnerSnapshot` through ``leasecore.state.statefile.StatePublisher``;
``conductor-run status`` reads it back and judges each lease with :func:`lease_health`. Nothing here
touches files or processes.

Times are wall-clock UTC, because monotonic values mean nothing in another process. A runner
converts its monotonic deadlines with :func:`wall_time` just before publishing. In JSON, times are
ISO 8601 UTC strings with milliseconds and a ``Z``; the reader also accepts epoch milliseconds.

JSON layout (schema version 1), one file per runner, ``<state_dir>/runner-<pid>.json``::

    {"schema_version": 1, "updated_at": "...Z", "paused": [task types not polled now], "stopping": bool,
     "runner": {"pid", "process_start_ticks", "worker_id", "server_url", "started_at",
                "task_types", "version", "cgroup"},
     "server": {"last_ok_at", "consecutive_failures", "backoff_seconds", "last_error"},
     "tasks": [{"task_id", "workflow_id", "task_type", "state", "child_pid", "started_at",
                "last_ack_at", "next_heartbeat_at", "lease_deadline_at", "lease_timeout_seconds",
                "hard_deadline_at", "consecutive_failures", "fence_reason", "last_output_line",
                "recent_output", "memory_bytes"}]}

Threads: any (frozen values); the runner's main thread builds them.
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from leasecore import __version__
from leasecore.clock import Clock

__all__ = [
    "HEARTBEAT_OVERDUE_SECONDS",
    "MAX_LINE_CHARS",
    "MAX_OUTPUT_LINES",
    "SCHEMA_VERSION",
    "LeaseHealth",
    "OutputTail",
    "RunnerInfo",
    "RunnerSnapshot",
    "ServerHealth",
    "TaskSnapshot",
    "TaskState",
    "iso_time",
    "lease_health",
    "redact_url",
    "wall_time",
]

SCHEMA_VERSION = 1
MAX_OUTPUT_LINES = 20  # recent output lines kept per task
MAX_LINE_CHARS = 500  # each cut to this many characters
HEARTBEAT_OVERDUE_SECONDS = 1.0  # a heartbeat this late turns the lease yellow
_FAR_SECONDS = 100 * 365 * 24 * 3600.0  # wall_time clamps to this distance from now
_USERINFO_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]+@")


class TaskState(StrEnum):
    """Where a task is in its life on this runner."""

    WAITING = "waiting"  # polled, lease held; the command starts once a previous holder must have stopped
    RUNNING = "running"  # the child runs; heartbeats keep the lease
    TERMINATING = "terminating"  # the tree is being fenced (TERM, then KILL)
    REPORTING = "reporting"  # the child is gone; the final update is being sent
    UNDELIVERED = "undelivered"  # the final update could not be sent; kept on disk for later


class LeaseHealth(StrEnum):
    """One word for how much a task's lease can be trusted, derived from a snapshot and ``now``."""

    HEALTHY = "healthy"
    AT_RISK = "at_risk"  # a heartbeat failed or is overdue, or an unextended lease is half gone
    FENCING = "fencing"  # terminating, fenced, or the lease deadline has passed
    STALE = "stale"  # the runner is gone or silent: nothing in the snapshot is current
    NO_LEASE = "no_lease"  # nothing to keep alive (undelivered result, or no deadline known)


def iso_time(value: datetime | None) -> str | None:
    """``2026-01-01T00:00:00.000Z``, or None."""
    if value is None:
        return None
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _parse_time(value: Any) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):  # epoch milliseconds
        return datetime.fromtimestamp(value / 1000.0, UTC)
    parsed = datetime.fromisoformat(str(value))
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _required_time(value: Any, name: str) -> datetime:
    parsed = _parse_time(value)
    if parsed is None:
        raise ValueError(f"missing {name}")
    return parsed


def redact_url(url: str) -> str:
    """Drop user:password@, the query and the fragment from a URL: a snapshot never holds secrets."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return _USERINFO_IN_TEXT.sub(r"\1", url)
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _redact_text(text: str | None) -> str | None:
    return None if text is None else _USERINFO_IN_TEXT.sub(r"\1", text)[:MAX_LINE_CHARS]


def _bounded_lines(lines: Iterable[str]) -> tuple[str, ...]:
    kept = tuple(lines)[-MAX_OUTPUT_LINES:]
    return tuple(line[:MAX_LINE_CHARS] for line in kept)


def wall_time(monotonic_seconds: float | None, clock: Clock) -> datetime | None:
    """Convert a monotonic instant of ``clock`` to UTC wall time: ``now() + (t - monotonic())``."""
    if monotonic_seconds is None or math.isnan(monotonic_seconds):
        return None
    # A deadline centuries away (an "infinite" timeout) is shown as far away, not as an overflow.
    delta = max(-_FAR_SECONDS, min(_FAR_SECONDS, monotonic_seconds - clock.monotonic()))
    return clock.now() + timedelta(seconds=delta)


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What does not change while a runner lives."""

    pid: int
    worker_id: str
    server_url: str
    started_at: datetime
    process_start_ticks: int | None = None  # /proc/<pid>/stat field 22: tells a reused pid apart
    task_types: tuple[str, ...] = ()
    version: str = __version__
    cgroup: str = ""  # the cgroup mechanism in force, and why not a better one (cgroups.describe)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "cgroup": self.cgroup,
            "pid": self.pid,
            "process_start_ticks": self.process_start_ticks,
            "worker_id": self.worker_id,
            "server_url": redact_url(self.server_url),
            "started_at": iso_time(self.started_at),
            "task_types": list(self.task_types),
            "version": self.version,
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> RunnerInfo:
        ticks = data.get("process_start_ticks")
        return cls(
            pid=int(data["pid"]),
            worker_id=str(data.get("worker_id", "")),
            server_url=redact_url(str(data.get("server_url", ""))),
            started_at=_required_time(data.get("started_at"), "runner.started_at"),
            process_start_ticks=None if ticks is None else int(ticks),
            task_types=tuple(str(t) for t in data.get("task_types") or ()),
            version=str(data.get("version", "")),
            cgroup=str(data.get("cgroup") or ""),
        )


@dataclass(frozen=True, slots=True)
class ServerHealth:
    """How the runner's recent calls to the Conductor server went."""

    last_ok_at: datetime | None = None
    consecutive_failures: int = 0
    backoff_seconds: float = 0.0  # the current wait before the next poll, 0 when none
    last_error: str | None = None  # a short message; URLs in it lose their userinfo

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "last_ok_at": iso_time(self.last_ok_at),
            "consecutive_failures": self.consecutive_failures,
            "backoff_seconds": self.backoff_seconds,
            "last_error": _redact_text(self.last_error),
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> ServerHealth:
        return cls(
            last_ok_at=_parse_time(data.get("last_ok_at")),
            consecutive_failures=int(data.get("consecutive_failures") or 0),
            backoff_seconds=float(data.get("backoff_seconds") or 0.0),
            last_error=_redact_text(data.get("last_error")),
        )


@dataclass(frozen=True, slots=True)
class TaskSnapshot:
    """One in-flight task as the runner sees it; every time is wall-clock UTC."""

    task_id: str
    workflow_id: str
    task_type: str
    state: TaskState
    started_at: datetime
    child_pid: int | None = None
    last_ack_at: datetime | None = None  # send time of the last acknowledged heartbeat (or the poll)
    next_heartbeat_at: datetime | None = None
    lease_deadline_at: datetime | None = None
    lease_timeout_seconds: float | None = None  # the heartbeat timeout the deadline was computed with
    hard_deadline_at: datetime | None = None
    consecutive_failures: int = 0  # failed heartbeats since the last acknowledged one
    fence_reason: str | None = None
    # Who ended a fenced tree: "runner", or "switch" (the fork server's dead-man's switch: the runner
    # was stalled past the lease's TERM point); None while it runs or when it ended on its own.
    fenced_by: str | None = None
    recent_output: tuple[str, ...] = ()  # oldest first; bounded when serialised
    memory_bytes: int | None = None  # the tree's memory now (its cgroup), else the child's RSS
    progress: float | None = None  # 0..1: its checkpoint's "progress" (leasecore.process.checkpoint)

    @property
    def last_output_line(self) -> str | None:
        return self.recent_output[-1] if self.recent_output else None

    def to_json_dict(self) -> dict[str, Any]:
        output = _bounded_lines(self.recent_output)
        return {
            "task_id": self.task_id,
            "workflow_id": self.workflow_id,
            "task_type": self.task_type,
            "state": str(self.state),
            "child_pid": self.child_pid,
            "started_at": iso_time(self.started_at),
            "last_ack_at": iso_time(self.last_ack_at),
            "next_heartbeat_at": iso_time(self.next_heartbeat_at),
            "lease_deadline_at": iso_time(self.lease_deadline_at),
            "lease_timeout_seconds": self.lease_timeout_seconds,
            "hard_deadline_at": iso_time(self.hard_deadline_at),
            "consecutive_failures": self.consecutive_failures,
            "fence_reason": self.fence_reason,
            "fenced_by": self.fenced_by,
            "last_output_line": output[-1] if output else None,
            "recent_output": list(output),
            "memory_bytes": self.memory_bytes,
            "progress": self.progress,
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> TaskSnapshot:
        pid = data.get("child_pid")
        timeout = data.get("lease_timeout_seconds")
        fence = data.get("fence_reason")
        return cls(
            task_id=str(data["task_id"]),
            workflow_id=str(data.get("workflow_id", "")),
            task_type=str(data.get("task_type", "")),
            state=TaskState(data["state"]),
            started_at=_required_time(data.get("started_at"), "task.started_at"),
            child_pid=None if pid is None else int(pid),
            last_ack_at=_parse_time(data.get("last_ack_at")),
            next_heartbeat_at=_parse_time(data.get("next_heartbeat_at")),
            lease_deadline_at=_parse_time(data.get("lease_deadline_at")),
            lease_timeout_seconds=None if timeout is None else float(timeout),
            hard_deadline_at=_parse_time(data.get("hard_deadline_at")),
            consecutive_failures=int(data.get("consecutive_failures") or 0),
            fence_reason=None if fence is None else str(fence),
            fenced_by=None if data.get("fenced_by") is None else str(data["fenced_by"]),
            recent_output=_bounded_lines(str(line) for line in data.get("recent_output") or ()),
            memory_bytes=None if data.get("memory_bytes") is None else int(data["memory_bytes"]),
            progress=_progress(data.get("progress")),
        )


def _progress(value: Any) -> float | None:
    """A snapshot's ``progress``: a number from 0 to 1 (anything else, e.g. an older file's: None)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        return None
    return float(value)


@dataclass(frozen=True, slots=True)
class RunnerSnapshot:
    """Everything one runner publishes at one moment."""

    runner: RunnerInfo
    server: ServerHealth
    tasks: tuple[TaskSnapshot, ...]
    updated_at: datetime
    schema_version: int = SCHEMA_VERSION
    paused: tuple[str, ...] = ()  # task types paused now (config, conductor-run pause, reload)
    stopping: bool = False  # a stop (or a drain) has begun: nothing is polled any more

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "updated_at": iso_time(self.updated_at),
            "paused": list(self.paused),
            "stopping": self.stopping,
            "runner": self.runner.to_json_dict(),
            "server": self.server.to_json_dict(),
            "tasks": [task.to_json_dict() for task in self.tasks],
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> RunnerSnapshot:
        """Parse a snapshot; raises ValueError, saying what is wrong, for anything malformed."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"schema version {version!r} (this conductor-run reads {SCHEMA_VERSION})")
        try:
            return cls(
                runner=RunnerInfo.from_json_dict(data["runner"]),
                server=ServerHealth.from_json_dict(data.get("server") or {}),
                tasks=tuple(TaskSnapshot.from_json_dict(t) for t in data.get("tasks") or ()),
                updated_at=_required_time(data.get("updated_at"), "updated_at"),
                paused=tuple(str(t) for t in data.get("paused") or ()),
                stopping=bool(data.get("stopping", False)),
            )
        except KeyError as exc:
            raise ValueError(f"missing field {exc.args[0]!r}") from None
        except (TypeError, AttributeError, OverflowError, OSError) as exc:
            # A field of the wrong type or a time out of range: any file in the directory is
            # untrusted input, and one bad file must not take `status` down.
            raise ValueError(f"malformed snapshot ({type(exc).__name__}: {exc})") from None


class OutputTail:
    """The last :data:`MAX_OUTPUT_LINES` lines of a child's output, each cut short.

    Safe to feed from the child's reader threads while the runner reads it, without a lock (the core
    does not import ``threading``): ``deque.append`` with a ``maxlen`` is one atomic C call, and
    ``tuple(deque)`` copies inside C without releasing the GIL, so it never sees a half-made append.
    """

    def __init__(self, max_lines: int = MAX_OUTPUT_LINES, max_chars: int = MAX_LINE_CHARS) -> None:
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._max_chars = max_chars

    def append(self, line: str) -> None:
        self._lines.append(line.rstrip("\r\n")[: self._max_chars])

    def lines(self) -> tuple[str, ...]:
        return tuple(self._lines)


def lease_health(task: TaskSnapshot, now: datetime, *, runner_stale: bool = False) -> LeaseHealth:
    """Classify a task's lease at ``now``; pure."""
    if runner_stale:
        return LeaseHealth.STALE
    if task.state is TaskState.UNDELIVERED:  # its child is long gone, fenced or not: nothing to keep
        return LeaseHealth.NO_LEASE
    if task.state is TaskState.TERMINATING or task.fence_reason is not None:
        return LeaseHealth.FENCING
    if task.lease_deadline_at is None:
        return LeaseHealth.NO_LEASE
    left = (task.lease_deadline_at - now).total_seconds()
    if left <= 0:
        return LeaseHealth.FENCING
    if task.consecutive_failures > 0:
        return LeaseHealth.AT_RISK
    if task.next_heartbeat_at is not None:
        # A heartbeat normally goes out with ~20 % of the lease left, so "under half left" is
        # routine while beating; lateness is the signal that the lease is eroding.
        if (now - task.next_heartbeat_at).total_seconds() > HEARTBEAT_OVERDUE_SECONDS:
            return LeaseHealth.AT_RISK
    elif task.lease_timeout_seconds and left < 0.5 * task.lease_timeout_seconds:
        return LeaseHealth.AT_RISK  # nothing extends this lease: it simply runs out
    return LeaseHealth.HEALTHY
