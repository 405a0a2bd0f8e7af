"""Bounded capture of one output stream: split into lines, keep a tail, hand lines to a sink.

Pure (bytes in, lines out): the reader thread in ``supervisor.py`` feeds it whatever ``os.read``
returned. Memory stays bounded whatever the child writes: a partial line is never longer than
``max_line_bytes`` (a longer run without a newline is cut into pieces of that size) and the tail
keeps at most ``tail_lines`` lines and ``tail_bytes`` bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

MAX_LINE_BYTES = 64 * 1024
TAIL_LINES = 200
TAIL_BYTES = 64 * 1024


class StreamCapture:
    """Line splitter and tail ring for one stream; ``emit`` receives each complete line as text."""

    def __init__(
        self,
        emit: Callable[[str], None] | None = None,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        tail_lines: int = TAIL_LINES,
        tail_bytes: int = TAIL_BYTES,
    ) -> None:
        self._emit = emit
        self._max_line_bytes = max_line_bytes
        self._tail_bytes = tail_bytes
        self._tail: deque[bytes] = deque(maxlen=tail_lines)
        self._tail_size = 0
        self._partial = bytearray()
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        """Take the next chunk of the stream."""
        self.total_bytes += len(data)
        self._partial += data
        start = 0
        limit = self._max_line_bytes
        while True:
            # Look for a newline only within one line's length, so a flood without newlines costs
            # O(chunk), not O(buffer) per call.
            newline = self._partial.find(b"\n", start, start + limit + 1)
            if newline >= 0:
                self._line(bytes(self._partial[start:newline]))
                start = newline + 1
            elif len(self._partial) - start >= limit:
                self._line(bytes(self._partial[start : start + limit]))
                start += limit
            else:
                break
        del self._partial[:start]

    def close(self) -> None:
        """End of stream: a last line without a newline still counts."""
        if self._partial:
            self._line(bytes(self._partial))
            self._partial.clear()

    def tail(self) -> str:
        """The last lines, joined with newlines."""
        return "\n".join(line.decode("utf-8", "replace") for line in self._tail)

    def last_line(self) -> str:
        """The last non-blank line seen, stripped ('' if none is in the tail)."""
        for line in reversed(self._tail):
            text = line.decode("utf-8", "replace").strip()
            if text:
                return text
        return ""

    def _line(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if len(self._tail) == self._tail.maxlen:
            self._tail_size -= len(self._tail[0])
        self._tail.append(line)
        self._tail_size += len(line)
        while self._tail_size > self._tail_bytes and len(self._tail) > 1:
            self._tail_size -= len(self._tail.popleft())
        if self._emit is not None:
            self._emit(line.decode("utf-8", "replace"))
