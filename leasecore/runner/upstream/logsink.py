"""Stream a child's output lines to the task's execution log (``POST /api/tasks/{id}/log``).

``LogBuffer`` is the pure part: a bounded buffer per task that drops the oldest lines when full and
cuts batches by line count and bytes. ``LogStreamer`` is the adapter: the child's reader threads only
append under a short lock (never blocked by the network); one flusher thread cuts batches every
``flush_interval_seconds`` (or at once when ``batch_lines`` are waiting) and a small pool sends them,
at most one request in flight per task so lines stay in order. Logs are best effort: a failed batch
is dropped and counted, and the next batch says so.

Must not: block a reader thread on the network, or reorder a task's lines. Its server call is
``runner.ports.LogPort``. Threads: the child's reader threads (``append``), one ``log-flusher``
thread, a small ``log-sender`` pool; ``close`` from the main thread.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorError
from leasecore.runner.ports import LogPort

log = logging.getLogger("conductor_run.logs")


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "replace"))


def _cut(text: str, max_bytes: int) -> str:
    if len(text) * 4 <= max_bytes:  # a character is at most 4 bytes of UTF-8: it fits, no encoding
        return text
    raw = text.encode("utf-8", "replace")
    if len(raw) <= max_bytes:
        return text
    return raw[: max(0, max_bytes - 20)].decode("utf-8", "ignore") + " [line truncated]"


ENTRY_STREAM = "entry"  # on_lines(ENTRY_STREAM, items): each item is one log entry of its own


class WholeEntry(str):
    """A log item sent as one entry of its own, never joined with others in a batch (the stdio
    protocol's ``logs``: conductor-cli sends each item as one entry of the task's log)."""

    __slots__ = ()


def _cut_kept(line: str, max_bytes: int) -> str:
    """``_cut``, keeping a ``WholeEntry`` one."""
    cut = _cut(line, max_bytes)
    return WholeEntry(cut) if isinstance(line, WholeEntry) and not isinstance(cut, WholeEntry) else cut


class LogBuffer:
    """Lines of one task waiting to be sent; bounded, oldest dropped first."""

    def __init__(self, max_lines: int = 1000, max_line_bytes: int = 16 * 1024) -> None:
        self._lines: deque[str] = deque()
        self._max_lines = max_lines
        self._max_line_bytes = max_line_bytes
        self.dropped = 0  # lines dropped since the last batch (overflow or failed sends)
        self.chars = 0  # characters held: what the streamer's budget over all tasks counts

    def __len__(self) -> int:
        return len(self._lines)

    @property
    def max_lines(self) -> int:
        return self._max_lines

    def append(self, line: str) -> None:
        if len(self._lines) >= self._max_lines:
            self.chars -= len(self._lines.popleft())
            self.dropped += 1
        line = _cut_kept(line, self._max_line_bytes)
        self._lines.append(line)
        self.chars += len(line)

    def extend(self, lines: list[str], skipped: int = 0) -> None:
        """Append ``lines`` (the newest last); ``skipped`` lines before them were never buffered."""
        self.dropped += skipped
        if len(lines) > self._max_lines:
            self.dropped += len(lines) - self._max_lines
            lines = lines[-self._max_lines :]
        over = len(self._lines) + len(lines) - self._max_lines
        for _ in range(max(0, over)):
            self.chars -= len(self._lines.popleft())
        self.dropped += max(0, over)
        limit = self._max_line_bytes
        cut = [_cut_kept(line, limit) for line in lines]
        self._lines.extend(cut)
        self.chars += sum(map(len, cut))

    def shed(self, excess: int) -> int:
        """Drop the oldest lines (never the newest one) until ``excess`` characters are freed, or
        only one line is left; returns how many characters were freed."""
        freed = 0
        while freed < excess and len(self._lines) > 1:
            freed += len(self._lines.popleft())
            self.dropped += 1
        self.chars -= freed
        return freed

    def take_batch(self, max_lines: int, max_bytes: int) -> str | None:
        """The next batch as one text ("\\n"-joined), or None when nothing is waiting. A
        ``WholeEntry`` is a batch of its own."""
        if not self._lines and not self.dropped:
            return None
        parts: list[str] = []
        size = 0
        if self.dropped:
            note = f"[conductor-run: {self.dropped} output lines dropped]"
            parts.append(note)
            size = _utf8_len(note) + 1
            self.dropped = 0
        while self._lines and len(parts) < max_lines:
            whole = isinstance(self._lines[0], WholeEntry)
            if parts and (whole or isinstance(parts[-1], WholeEntry)):
                break
            line_size = _utf8_len(self._lines[0]) + 1
            if parts and size + line_size > max_bytes:
                break
            line = self._lines.popleft()
            self.chars -= len(line)
            parts.append(line)
            size += line_size
        return parts[0] if len(parts) == 1 else "\n".join(parts)  # a WholeEntry stays one


class _TaskLog:
    def __init__(self, buffer: LogBuffer, opened_at: float) -> None:
        self.buffer = buffer
        self.last_flush_at = opened_at
        self.in_flight = False
        self.closed = False


class LogStreamer:
    """Batches output lines per task and sends them with ``append_log``, never blocking the readers.

    Usage::

        streamer = LogStreamer(client); streamer.start()
        on_line = streamer.open(task.task_id)      # pass to Supervisor.spawn(on_line=...), or
        on_lines = streamer.open_lines(task.task_id)  # ... spawn(on_lines=...): a list per read
        ...
        streamer.close(task.task_id)               # child exited: send what is left, then forget
        streamer.stop(timeout_seconds=5)
    """

    def __init__(
        self,
        port: LogPort,
        *,
        clock: Clock | None = None,
        flush_interval_seconds: float = 1.0,
        batch_lines: int = 50,
        batch_bytes: int = 64 * 1024,
        buffer_lines: int = 1000,
        max_buffered_chars: int = 32 * 1024 * 1024,
        senders: int = 2,
        request_timeout_seconds: float = 5.0,
        new_buffer: Callable[[], LogBuffer] | None = None,
    ) -> None:
        self._port = port
        self._clock = clock or SystemClock()
        self._interval = flush_interval_seconds
        self._batch_lines = batch_lines
        self._batch_bytes = batch_bytes
        self._new_buffer = new_buffer or (lambda: LogBuffer(max_lines=buffer_lines))
        # Over every task: a buffer holds up to 1000 lines of 16 KiB, and with the server stalled and
        # hundreds of chatty tasks that alone could be gigabytes. Past this budget, the task adding
        # lines drops its own oldest ones (with the usual "N output lines dropped" note).
        self._max_chars = max_buffered_chars
        self._chars = 0
        self._timeout = request_timeout_seconds
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._tasks: dict[str, _TaskLog] = {}
        self._pool = ThreadPoolExecutor(max_workers=senders, thread_name_prefix="log-sender")
        self._thread = threading.Thread(target=self._run, name="log-flusher", daemon=True)
        self._failing = False
        self.sent_batches = 0
        self.failed_batches = 0

    def start(self) -> None:
        self._thread.start()

    def open(self, task_id: str) -> Callable[[str, str], None]:
        """Start buffering for ``task_id``; returns the ``on_line(stream, line)`` callback."""
        with self._lock:
            self._replace(task_id, _TaskLog(self._new_buffer(), self._clock.monotonic()))

        def on_line(stream: str, line: str) -> None:
            text = line if stream == "stdout" else f"[{stream}] {line}"
            with self._lock:
                entry = self._tasks.get(task_id)
                if entry is None or entry.closed:
                    return
                before = entry.buffer.chars
                entry.buffer.append(text)
                self._account(entry.buffer, before)
                full = len(entry.buffer) >= self._batch_lines
            if full:
                self._wake.set()

        return on_line

    def open_lines(self, task_id: str) -> Callable[[str, list[str]], None]:
        """Start buffering for ``task_id``; returns ``on_lines(stream, lines)``, which takes every
        line of one read at once. Only the newest lines a buffer can hold are kept (and prefixed):
        a child printing millions of lines costs the streamer O(buffer) per read, not O(lines)."""
        with self._lock:
            buffer = self._new_buffer()
            self._replace(task_id, _TaskLog(buffer, self._clock.monotonic()))
        keep = buffer.max_lines

        def on_lines(stream: str, lines: list[str]) -> None:
            skipped = max(0, len(lines) - keep)
            if skipped:
                lines = lines[skipped:]
            if stream == ENTRY_STREAM:
                lines = [WholeEntry(line) for line in lines]
            elif stream != "stdout":
                lines = [f"[{stream}] {line}" for line in lines]
            with self._lock:
                entry = self._tasks.get(task_id)
                if entry is None or entry.closed:
                    return
                before = entry.buffer.chars
                entry.buffer.extend(lines, skipped)
                self._account(entry.buffer, before)
                full = len(entry.buffer) >= self._batch_lines
            if full:
                self._wake.set()

        return on_lines

    def close(self, task_id: str) -> None:
        """No more lines will come for ``task_id``: send the rest soon, then forget the task."""
        with self._lock:
            entry = self._tasks.get(task_id)
            if entry is None:
                return
            if not entry.in_flight and not len(entry.buffer) and not entry.buffer.dropped:
                # Nothing left to send (a quiet task, or all sent): forget it here. Waking the
                # flusher for it was one more thread switch per task for nothing.
                del self._tasks[task_id]
                return
            entry.closed = True
        self._wake.set()

    def _replace(self, task_id: str, entry: _TaskLog) -> None:
        """Under the lock: a task opened again (an IN_PROGRESS yield polled back) drops what its last
        run left unsent, and the budget forgets it too."""
        old = self._tasks.get(task_id)
        if old is not None:
            self._chars -= old.buffer.chars
        self._tasks[task_id] = entry

    def _account(self, buffer: LogBuffer, before: int) -> None:
        """Under the lock: count what ``buffer`` gained since ``before``; shed it past the budget."""
        self._chars += buffer.chars - before
        if self._chars > self._max_chars:
            self._chars -= buffer.shed(self._chars - self._max_chars)

    @property
    def buffered_chars(self) -> int:
        """Characters waiting in every task's buffer."""
        with self._lock:
            return self._chars

    def pending(self) -> int:
        """Lines buffered or batches in flight, over all tasks."""
        with self._lock:
            return sum(len(e.buffer) + (1 if e.in_flight else 0) for e in self._tasks.values())

    def stop(self, timeout_seconds: float = 5.0) -> None:
        """Close every task, send what is left within ``timeout_seconds``, stop the threads."""
        with self._lock:
            for entry in self._tasks.values():
                entry.closed = True
        self._wake.set()
        deadline = self._clock.monotonic() + timeout_seconds
        while self.pending() and self._clock.monotonic() < deadline:
            self._wake.set()
            threading.Event().wait(0.02)
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.1, deadline - self._clock.monotonic()))
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(timeout=self._interval / 4)
            self._wake.clear()
            try:
                self._flush_due()
            except Exception:  # a thread's top level: log, keep streaming
                log.exception("log streamer failed; continuing")

    def _flush_due(self) -> None:
        now = self._clock.monotonic()
        batches: list[tuple[str, str]] = []
        with self._lock:
            for task_id, entry in list(self._tasks.items()):
                if entry.in_flight:
                    continue
                due = (
                    entry.closed
                    or len(entry.buffer) >= self._batch_lines
                    or now - entry.last_flush_at >= self._interval
                )
                before = entry.buffer.chars
                batch = entry.buffer.take_batch(self._batch_lines, self._batch_bytes) if due else None
                self._chars += entry.buffer.chars - before
                if batch is not None:
                    entry.in_flight = True
                    entry.last_flush_at = now
                    batches.append((task_id, batch))
                elif entry.closed and not len(entry.buffer):
                    del self._tasks[task_id]
        for task_id, batch in batches:
            try:
                self._pool.submit(self._send, task_id, batch)
            except RuntimeError:  # pool shut down while stopping: drop
                return

    def _send(self, task_id: str, text: str) -> None:
        ok = True
        try:
            self._port.append_log(task_id, text, timeout_seconds=self._timeout)
        except ConductorError as exc:
            ok = False
            if not self._failing:
                log.warning("could not send task output to the server's task log: %s", exc)
        with self._lock:
            entry = self._tasks.get(task_id)
            if entry is not None:
                entry.in_flight = False
                if not ok and not entry.closed:
                    entry.buffer.dropped += 1 if isinstance(text, WholeEntry) else text.count("\n") + 1
            if ok:
                self.sent_batches += 1
                if self._failing:
                    log.info("task output reaches the server's task log again")
            else:
                self.failed_batches += 1
            self._failing = not ok
        self._wake.set()
