"""A task's checkpoint: the JSON value a child keeps in ``CONDUCTOR_CHECKPOINT_FILE`` to resume from.

Owns what the checkpoint file may hold and how it is read (``read_checkpoint_file``: bounded by
``CHECKPOINT_LIMIT_BYTES``, never following a symbolic link or blocking on a FIFO), the value the
file starts with (``seed_of``: from a polled task's ``outputData.checkpoint``, or a retried attempt's),
the marked task-log line that carries a checkpoint to a later attempt when no update could
(``log_line`` / ``from_log``), a checkpoint's ``progress`` (``progress_of``), and ``CheckpointWatch``:
one task's file, looked at now and then, saying what changed.

Must not touch: anything but the one file it is given; no HTTP (the runner sends the lines), no
clock (the caller decides when to look). Threads: any; a ``CheckpointWatch`` belongs to one thread.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from leasecore.process.payload import deeper_than

CHECKPOINT_FILE_NAME = "checkpoint.json"
# A checkpoint rides on every update and, when it changes, on one task-log line: it must stay small
# (point to big state elsewhere). The log streamer cuts lines at 16 KiB (runner.upstream.logsink.LogBuffer),
# and a cut checkpoint could not be read back: the limit keeps the marked line whole.
CHECKPOINT_LIMIT_BYTES = 16000
CHECKPOINT_MAX_DEPTH = 64
LOG_MARKER = "conductor-run checkpoint: "  # the task-log line a later attempt resumes from
NAME = "CONDUCTOR_CHECKPOINT_FILE"


@dataclass(frozen=True, eq=False)
class CheckpointRead:
    """What the file held: ``text`` (compact JSON) and ``value``, or ``error`` saying why not, or
    neither (empty: no checkpoint)."""

    text: str | None = None
    value: Any = None
    error: str | None = None


EMPTY = CheckpointRead()


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def parse_checkpoint(data: bytes | str) -> CheckpointRead:
    """Check one JSON value (a JSON ``null`` or blank counts as no checkpoint)."""
    if len(data) > CHECKPOINT_LIMIT_BYTES:
        return CheckpointRead(error=f"{NAME} is too large (over {CHECKPOINT_LIMIT_BYTES} bytes): not used")
    if not data.strip():
        return EMPTY
    try:
        value = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        return CheckpointRead(error=f"{NAME} is not valid JSON ({why}): not used")
    if deeper_than(value, CHECKPOINT_MAX_DEPTH):
        return CheckpointRead(error=f"{NAME} nests over {CHECKPOINT_MAX_DEPTH} levels: not used")
    if value is None:
        return EMPTY
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if len(text.encode()) > CHECKPOINT_LIMIT_BYTES:
        return CheckpointRead(error=f"{NAME} is too large (over {CHECKPOINT_LIMIT_BYTES} bytes): not used")
    return CheckpointRead(text, value)


def read_checkpoint_file(path: str) -> CheckpointRead:
    """Read ``path`` as the child left it (a missing file: no checkpoint)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return EMPTY
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW: the child could point it at any file of ours
            return CheckpointRead(error=f"{NAME} is a symbolic link (not followed): not used")
        return CheckpointRead(error=f"{NAME} could not be read: {exc.strerror}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return CheckpointRead(error=f"{NAME} is not a regular file: not used")
        chunks: list[bytes] = []
        size = 0
        while size <= CHECKPOINT_LIMIT_BYTES:
            chunk = os.read(fd, CHECKPOINT_LIMIT_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        return CheckpointRead(error=f"{NAME} could not be read: {exc.strerror}")
    finally:
        os.close(fd)
    return parse_checkpoint(b"".join(chunks))


def file_key(path: str) -> tuple[int, int, int] | None:
    """What changes when the file is rewritten (in place or by rename): inode, size, mtime."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def seed_of(value: Any) -> bytes:
    """The bytes a checkpoint file starts with for ``value`` (None: empty)."""
    if value is None:
        return b""
    read = parse_checkpoint(json.dumps(value, ensure_ascii=False))
    return read.text.encode() if read.text is not None else b""


def from_output(output: Any) -> Any:
    """``outputData.checkpoint`` of a task as the server has it (None: none)."""
    return output.get("checkpoint") if isinstance(output, Mapping) else None


def log_line(text: str) -> str:
    """The marked task-log line that carries checkpoint ``text``."""
    return LOG_MARKER + text


def from_log(entries: Iterable[Any]) -> Any:
    """The last valid checkpoint in a task's log (``GET /tasks/{id}/log`` entries); None: none."""
    found = None
    for entry in entries:
        text = entry.get("log") if isinstance(entry, Mapping) else None
        if not isinstance(text, str) or LOG_MARKER not in text:
            continue
        for line in text.splitlines():  # the streamer sends lines in batches: one entry, many lines
            if line.startswith(LOG_MARKER):
                read = parse_checkpoint(line[len(LOG_MARKER):])
                if read.text is not None:
                    found = read.value
    return found


def progress_of(value: Any) -> float | None:
    """A checkpoint's top-level ``progress`` when it is a number from 0 to 1 (else None)."""
    if not isinstance(value, Mapping):
        return None
    progress = value.get("progress")
    if isinstance(progress, bool) or not isinstance(progress, int | float):
        return None
    if not math.isfinite(progress) or not 0 <= progress <= 1:
        return None
    return float(progress)


class CheckpointWatch:
    """One task's checkpoint file as last seen: ``look()`` reads it again only when it changed and
    says what to log (at most one line per call: the caller's cadence bounds the lines)."""

    def __init__(self, path: str, seed: bytes = b"") -> None:
        self.path = path
        self._key: tuple[int, int, int] | None = None
        seeded = parse_checkpoint(seed)
        self.text: str | None = seeded.text  # the latest valid checkpoint (the seed until one is seen)
        self.value: Any = seeded.value
        self._logged: str | None = seeded.text  # what the task log has already (the seed came from it)
        self._error: str | None = None

    @property
    def progress(self) -> float | None:
        return progress_of(self.value)

    def look(self) -> str | None:
        """The line to log now, if any: the new checkpoint (marked), or why the file is not used."""
        key = file_key(self.path)
        if key is None or key == self._key:
            return None
        self._key = key
        read = read_checkpoint_file(self.path)
        return self.take(read)

    def take(self, read: CheckpointRead) -> str | None:
        """Record ``read`` (from ``look``, or the final read at the child's exit)."""
        if read.error is not None:
            if read.error == self._error:
                return None
            self._error = read.error
            return f"conductor-run: {read.error} (the last valid checkpoint stands)"
        self._error = None
        if read.text is None or (read.text == self.text and read.text == self._logged):
            return None
        self.text, self.value = read.text, read.value
        self._logged = read.text
        return log_line(read.text)
