"""Status snapshot files: the atomic publisher, the reader and its staleness, the ``status`` document.

Owns: ``<state_dir>/runner-<pid>.json``. A runner writes its own through :class:`StatePublisher`
(atomically: a temp file renamed; coalesced and refreshed at least once a second; I/O errors logged
once, never raised); ``conductor-run status`` lists them with :func:`read_snapshots`, which marks a
snapshot stale when its runner's process is gone (or its pid was reused: :func:`probe_process`) or it
has not been refreshed for :data:`STALE_AFTER_SECONDS`; :func:`prune_stale` and
:func:`forget_runners` delete those of dead runners. Given a :class:`StateDir` (``state.directory``),
each uses the directory as it is; given a bare path, it checks it first. The schema (pure values) is
``leasecore.snapshot``; rendering is ``cli/render.py``.

Must not: print, or let a credential in (the server URL is redacted). Threads: the publisher on the
runner's main thread (a lock guards it); readers on the caller's thread, another process's.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConfigError
from leasecore.snapshot import (
    SCHEMA_VERSION,
    LeaseHealth,
    OutputTail,
    RunnerInfo,
    RunnerSnapshot,
    ServerHealth,
    TaskSnapshot,
    TaskState,
    iso_time,
    lease_health,
    redact_url,
    wall_time,
)
from leasecore.state.directory import (
    StateDir,
    check_state_dir,
    default_state_dir,
    ensure_state_dir,
    state_dir_missing,
)

__all__ = [
    "STALE_AFTER_SECONDS",
    "LeaseHealth",
    "OutputTail",
    "ProcessState",
    "RunnerInfo",
    "RunnerSnapshot",
    "ServerHealth",
    "SnapshotRecord",
    "StateDir",
    "StatePublisher",
    "TaskSnapshot",
    "TaskState",
    "check_state_dir",
    "default_state_dir",
    "ensure_state_dir",
    "find_tasks",
    "forget_runners",
    "probe_process",
    "process_start_ticks",
    "prune_stale",
    "read_snapshots",
    "runner_info_for_this_process",
    "status_document",
    "wall_time",
]

STALE_AFTER_SECONDS = 10.0  # a live runner refreshes at least once a second
_MAX_FILE_BYTES = 4 * 1024 * 1024
_FILE_RE = re.compile(r"^runner-(\d{1,10})\.json$")
_MAX_PID = 2**22  # Linux's pid_max ceiling (PID_MAX_LIMIT)
_TMP_RE = re.compile(r"^\.runner-(\d+)\..*\.tmp$")
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC

_log = logging.getLogger(__name__)


class ProcessState(StrEnum):
    """What a pid recorded in a snapshot refers to now."""

    ALIVE = "alive"
    GONE = "gone"  # no such process, or a zombie
    REUSED = "reused"  # the pid now belongs to a different process


# --- publishing ----------------------------------------------------------------------------------


class StatePublisher:
    """Writes one runner's snapshot to ``<state_dir>/runner-<pid>.json``, atomically and cheaply.

    ``publish`` is meant to be called from the runner's loop on every event and at least once a
    second. It writes at once when anything but output changed, coalesces output-only changes to
    one write per ``output_interval_seconds``, refreshes an unchanged snapshot once per
    ``refresh_seconds`` (so readers can tell a live runner from a silent one), and never raises for
    I/O errors: the first failure is logged, later ones are not until a write succeeds again.

        publisher = StatePublisher.for_this_process(state, worker_id=..., server_url=...)
        publisher.publish(tasks, server=ServerHealth(last_ok_at=...))
        ...
        publisher.remove()   # on a clean exit
    """

    def __init__(
        self,
        state_dir: StateDir | Path,
        runner_info: RunnerInfo,
        *,
        clock: Clock | None = None,
        refresh_seconds: float = 1.0,
        output_interval_seconds: float = 0.25,
    ) -> None:
        # A StateDir was made and checked by its owner; a bare path is made and checked here.
        self._dir = state_dir.path if isinstance(state_dir, StateDir) else ensure_state_dir(state_dir)
        self._runner = replace(runner_info, server_url=redact_url(runner_info.server_url))
        self._clock = clock or SystemClock()
        self._refresh_seconds = refresh_seconds
        self._output_interval_seconds = output_interval_seconds
        self._lock = threading.Lock()
        self._last_full: tuple[ServerHealth, tuple[TaskSnapshot, ...], tuple[Any, ...]] | None = None
        self._last_shape: tuple[ServerHealth, tuple[TaskSnapshot, ...], tuple[Any, ...]] | None = None
        self._last_write_at: float | None = None
        self._failing = False
        self.path = self._dir / f"runner-{runner_info.pid}.json"
        self._tmp = str(self._dir / f".runner-{runner_info.pid}.w.tmp")  # (_TMP_RE: swept if left)

    @classmethod
    def for_this_process(
        cls, state: StateDir, *, worker_id: str, server_url: str, task_types: Iterable[str] = (),
        cgroup: str = "", clock: Clock | None = None,
    ) -> StatePublisher:
        """The publisher of the calling process (:func:`runner_info_for_this_process`) in ``state``."""
        info = runner_info_for_this_process(worker_id=worker_id, server_url=server_url,
                                            task_types=task_types, clock=clock, cgroup=cgroup)
        return cls(state, info, clock=clock)

    @property
    def runner_info(self) -> RunnerInfo:
        """Who publishes (its server URL redacted), as every snapshot says."""
        return self._runner

    def publish(self, tasks: Sequence[TaskSnapshot], *, server: ServerHealth, paused: Sequence[str] = (),
                stopping: bool = False) -> bool:
        """Publish the current state; returns whether the file was (re)written. Never raises OSError."""
        control = (tuple(paused), stopping)
        full = (server, tuple(tasks), control)
        shape = (server, tuple(replace(t, recent_output=()) for t in full[1]), control)
        with self._lock:
            now_mono = self._clock.monotonic()
            since_seconds = None if self._last_write_at is None else now_mono - self._last_write_at
            if since_seconds is not None and shape == self._last_shape:
                output_only = full != self._last_full
                interval_seconds = self._output_interval_seconds if output_only else self._refresh_seconds
                if since_seconds < interval_seconds:
                    return False
            snapshot = RunnerSnapshot(self._runner, server, full[1], updated_at=self._clock.now(),
                                      paused=control[0], stopping=stopping)
            # A failed write counts as a write for pacing: it is retried on the next change or
            # refresh, not on every call of a busy loop.
            self._last_write_at = now_mono
            self._last_full, self._last_shape = full, shape
            return self._write(json.dumps(snapshot.to_json_dict(), separators=(",", ":")))

    def _write(self, text: str) -> bool:
        # One temporary name per runner (its writes are serialised by the lock), made new each time
        # (O_TRUNC; never through a link), then renamed over the snapshot: readers see the old file or
        # the new one, never half of one. (mkstemp's random name and a text file's set-up were
        # ~45 % of a write's CPU, five writes a second in a busy run.)
        tmp = self._tmp
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o600)
            try:
                data = memoryview(text.encode("utf-8"))
                while data:
                    data = data[os.write(fd, data):]
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
        except OSError as exc:
            # The status view is a convenience: a full disk must not take the runner (and its
            # leases) down with it.
            _unlink_quietly(Path(tmp))
            if not self._failing:
                _log.warning("cannot write the status snapshot %s: %s", self.path, exc)
            self._failing = True
            return False
        if self._failing:
            _log.info("status snapshot %s is written again", self.path)
        self._failing = False
        return True

    def remove(self) -> None:
        """Delete this runner's snapshot (a clean exit); never raises."""
        with self._lock:
            _unlink_quietly(self.path)


def _unlink_quietly(path: Path) -> bool:
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        _log.warning("cannot remove %s: %s", path, exc)
        return False
    return True


# --- reading -------------------------------------------------------------------------------------


def _proc_stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    # Field 2 (comm) may hold spaces and parentheses: everything after the last ')' is fields 3...
    return raw.rpartition(")")[2].split()


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None where unknown."""
    fields = _proc_stat_fields(pid)
    try:
        return None if fields is None else int(fields[19])  # field 22 of proc(5)
    except (IndexError, ValueError):
        return None


def probe_process(pid: int, start_ticks: int | None) -> ProcessState:
    """Is ``pid`` still the process that wrote the snapshot?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ProcessState.GONE
    except PermissionError:
        pass  # the pid exists but belongs to someone else: the start time below decides
    fields = _proc_stat_fields(pid)
    if fields is None:
        # Where /proc exists, a missing entry means the process exited after the kill(0) above;
        # elsewhere (macOS) kill(0) is all we can know.
        return ProcessState.GONE if Path("/proc/self/stat").exists() else ProcessState.ALIVE
    if fields and fields[0] in ("Z", "X"):
        return ProcessState.GONE  # killed, waiting for its parent to reap it
    if start_ticks is not None and process_start_ticks(pid) != start_ticks:
        return ProcessState.REUSED
    return ProcessState.ALIVE


def runner_info_for_this_process(
    *, worker_id: str, server_url: str, task_types: Iterable[str] = (), clock: Clock | None = None,
    cgroup: str = "",
) -> RunnerInfo:
    """Describe the calling process (pid, start ticks, start time), with a redacted server URL."""
    pid = os.getpid()
    return RunnerInfo(
        pid=pid,
        worker_id=worker_id,
        server_url=redact_url(server_url),
        started_at=(clock or SystemClock()).now(),
        process_start_ticks=process_start_ticks(pid),
        task_types=tuple(task_types),
        cgroup=cgroup,
    )


@dataclass(frozen=True, slots=True, eq=False)
class SnapshotRecord:
    """One snapshot file as read at ``now``: its content (or why it is unreadable) and its staleness."""

    path: Path
    pid: int
    snapshot: RunnerSnapshot | None
    stale_reason: str | None  # None: the runner is live
    process_gone: bool  # the runner's process no longer exists (safe to prune)
    error: str | None = None  # why the file could not be read

    @property
    def is_stale(self) -> bool:
        return self.stale_reason is not None


ProcessProbe = Callable[[int, int | None], ProcessState]


def _load(path: Path) -> RunnerSnapshot:
    # O_NOFOLLOW and the S_ISREG check: only a runner's own regular file is read, never what a
    # symlink, a FIFO or a device in the directory points at.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not a snapshot file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ValueError("a directory, not a snapshot file" if stat.S_ISDIR(mode) else "not a regular file")
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_MAX_FILE_BYTES + 1)
    if len(raw) > _MAX_FILE_BYTES:
        raise ValueError(f"file larger than {_MAX_FILE_BYTES} bytes")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return RunnerSnapshot.from_json_dict(data)


def _read_one(
    path: Path, pid: int, now: datetime, stale_after_seconds: float, probe: ProcessProbe
) -> SnapshotRecord | None:
    snapshot: RunnerSnapshot | None = None
    error: str | None = None
    try:
        snapshot = _load(path)
    except FileNotFoundError:
        return None  # removed (pruned, or its runner exited cleanly) since the listing
    except OSError as exc:
        error = f"unreadable snapshot: {exc.strerror or exc}"
    except ValueError as exc:
        error = f"unreadable snapshot: {exc}"
    ticks = snapshot.runner.process_start_ticks if snapshot else None
    state = probe(pid, ticks)
    reason: str | None = None
    if state is ProcessState.GONE:
        reason = "runner process is gone"
    elif state is ProcessState.REUSED:
        reason = f"pid {pid} now belongs to another process"
    elif snapshot is not None:
        age = (now - snapshot.updated_at).total_seconds()
        if age > stale_after_seconds:
            reason = f"no update for {age:.1f}s"
    elif error is not None:
        reason = error
    return SnapshotRecord(path, pid, snapshot, reason, state is not ProcessState.ALIVE, error)


def read_snapshots(
    state: StateDir | Path,
    now: datetime,
    *,
    stale_after_seconds: float = STALE_AFTER_SECONDS,
    probe: ProcessProbe = probe_process,
) -> list[SnapshotRecord]:
    """Read every runner snapshot in ``state``, live ones first. A ``StateDir`` is read as it is (its
    owner checked it); a bare path is checked first, and holds none when it does not exist."""
    if isinstance(state, StateDir):
        return _read_dir(state.path, now, stale_after_seconds, probe)
    if state_dir_missing(state):
        return []
    check_state_dir(state)
    return _read_dir(state, now, stale_after_seconds, probe)


def _read_dir(
    state_dir: Path, now: datetime, stale_after_seconds: float, probe: ProcessProbe
) -> list[SnapshotRecord]:
    try:
        paths = list(state_dir.iterdir())
    except OSError as exc:
        msg = f"cannot list state directory {state_dir}: {exc.strerror}"
        raise ConfigError(msg, key="state_dir") from exc
    records = []
    for path in paths:
        match = _FILE_RE.match(path.name)
        if match is None or not 0 < int(match.group(1)) <= _MAX_PID:
            continue  # not a runner's snapshot (no process can have that pid)
        record = _read_one(path, int(match.group(1)), now, stale_after_seconds, probe)
        if record is not None:
            records.append(record)
    records.sort(key=lambda r: (r.is_stale, r.pid))
    return records


def prune_stale(
    state: StateDir | Path, records: Iterable[SnapshotRecord], *, probe: ProcessProbe = probe_process
) -> list[Path]:
    """Delete snapshots (and leftover temp files) of runners whose process is gone.

    A runner that is alive but silent is kept: it is exactly what an operator needs to see.
    """
    state_dir = state.path if isinstance(state, StateDir) else state
    removed = [r.path for r in records if r.process_gone and _unlink_quietly(r.path)]
    if state_dir.exists():
        for path in state_dir.iterdir():
            match = _TMP_RE.match(path.name)
            pid = int(match.group(1)) if match else 0
            if 0 < pid <= _MAX_PID and probe(pid, None) is not ProcessState.ALIVE and _unlink_quietly(path):
                removed.append(path)
    return removed


def forget_runners(
    state: StateDir, runner_pids: Iterable[int], now: datetime, *, probe: ProcessProbe = probe_process
) -> list[Path]:
    """Delete the snapshots of the dead runners ``runner_pids`` (those whose trees a start-up sweep
    took over: they would go on showing their tasks as running under a dead pid)."""
    pids = set(runner_pids)
    if not pids:
        return []
    records = _read_dir(state.path, now, STALE_AFTER_SECONDS, probe)
    return prune_stale(state.path, [r for r in records if r.pid in pids], probe=probe)


def find_tasks(records: Iterable[SnapshotRecord], task_id: str) -> list[tuple[SnapshotRecord, TaskSnapshot]]:
    """Tasks whose id is ``task_id`` or starts with it; an exact match wins over prefixes."""
    found = [(r, t) for r in records if r.snapshot for t in r.snapshot.tasks if t.task_id.startswith(task_id)]
    exact = [(r, t) for r, t in found if t.task_id == task_id]
    return exact or found


# --- the ``status --json`` document --------------------------------------------------------------


def _task_document(record: SnapshotRecord, task: TaskSnapshot, now: datetime) -> dict[str, Any]:
    doc = task.to_json_dict()
    doc["health"] = str(lease_health(task, now, runner_stale=record.is_stale))
    return doc


def _runner_document(record: SnapshotRecord, now: datetime) -> dict[str, Any]:
    snap = record.snapshot
    return {
        "file": str(record.path),
        "pid": record.pid,
        "stale": record.is_stale,
        "stale_reason": record.stale_reason,
        "error": record.error,
        "updated_at": iso_time(snap.updated_at) if snap else None,
        "paused": list(snap.paused) if snap else [],
        "stopping": snap.stopping if snap else False,
        "runner": snap.runner.to_json_dict() if snap else None,
        "server": snap.server.to_json_dict() if snap else None,
        "tasks": [_task_document(record, t, now) for t in snap.tasks] if snap else [],
    }


def status_document(
    records: Sequence[SnapshotRecord], now: datetime, *, state_dir: Path, task_id: str | None = None
) -> dict[str, Any]:
    """The ``conductor-run status --json`` document (schema version :data:`SCHEMA_VERSION`)."""
    doc: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "now": iso_time(now),
        "state_dir": str(state_dir),
    }
    if task_id is None:
        doc["runners"] = [_runner_document(r, now) for r in records]
    else:
        doc["tasks"] = [
            {**_task_document(r, t, now), "runner_pid": r.pid, "runner_stale": r.is_stale}
            for r, t in find_tasks(records, task_id)
        ]
    return doc
