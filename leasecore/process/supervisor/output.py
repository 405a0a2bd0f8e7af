"""Bounded capture of one output stream: split into lines, keep a tail, hand lines to a sink.

Owns ``StreamCapture``: bytes in, lines out. The reader thread (``reader.py``) feeds it whatever
``os.read`` returned; each chunk is split with one ``bytes.split`` and decoded with one ``decode``
(no Python work per line on the common path), and the lines go to ``emit`` one by one or to
``emit_lines`` as one list per chunk. Memory stays bounded whatever the child writes: a partial
line is never longer than ``max_line_bytes`` (a longer run without a newline is cut into pieces of
that size) and the tail keeps at most ``tail_lines`` lines and ``tail_bytes`` bytes.

Must not touch: file descriptors, threads, the child: it is pure (no I/O of its own); what the sink
does with a line is the sink's business (the Child wraps it so a failing sink is only logged).

Threads: one capture per stream per child, used only by the Supervisor's reader thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from leasecore.masking import StreamMasker

MAX_LINE_BYTES = 64 * 1024
TAIL_LINES = 200
TAIL_BYTES = 64 * 1024


class StreamCapture:
    """Line splitter and tail ring for one stream.

    ``emit`` receives each complete line as text; ``emit_lines`` (if given, instead) receives the
    lines of each chunk as one list: a chatty child then costs a few C-level operations per chunk
    (one ``split``, one ``decode``), not Python work per line.
    """

    def __init__(
        self,
        emit: Callable[[str], None] | None = None,
        *,
        emit_lines: Callable[[list[str]], None] | None = None,
        max_line_bytes: int = MAX_LINE_BYTES,
        tail_lines: int = TAIL_LINES,
        tail_bytes: int = TAIL_BYTES,
        mask: StreamMasker | None = None,
    ) -> None:
        """``mask``: secret values are masked in the bytes before anything else sees them (lines,
        tail): a value split across two reads, or longer than a line piece, is masked all the same."""
        self._mask = mask
        self._emit = emit
        self._emit_lines = emit_lines
        self._max_line_bytes = max_line_bytes
        self._tail_bytes = tail_bytes
        self._tail: deque[bytes] = deque(maxlen=tail_lines)
        self._partial = b""
        self.total_bytes = 0

    def feed(self, data: bytes) -> None:
        """Take the next chunk of the stream."""
        self.total_bytes += len(data)
        if self._mask is not None:
            data = self._mask.feed(data)
            if not data:
                return
        if self._partial:
            data = self._partial + data  # the partial line is shorter than max_line_bytes
        end = data.rfind(b"\n") + 1
        lines = data[: end - 1].split(b"\n") if end else []
        rest = data[end:]
        limit = self._max_line_bytes
        if lines and max(map(len, lines)) > limit:
            lines = [piece for line in lines for piece in _pieces(line, limit)]
            cut = True
        else:
            cut = False
        if len(rest) >= limit:  # a run without a newline: hand it on in pieces of max_line_bytes
            whole = len(rest) - len(rest) % limit
            lines += _pieces(rest[:whole], limit)
            rest = rest[whole:]
            cut = True
        self._partial = rest
        if lines:
            self._lines(lines, None if cut else data[: end - 1] if end else None)

    def close(self) -> None:
        """End of stream: a last line without a newline still counts."""
        if self._mask is not None:
            rest = self._mask.flush()
            if rest:
                total, self._mask = self.total_bytes, None
                self.feed(rest)
                self.total_bytes = total
        if self._partial:
            line, self._partial = self._partial, b""
            self._lines([line], None)

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

    def _lines(self, lines: list[bytes], block: bytes | None) -> None:
        """Record ``lines`` (complete, newline-free); ``block``: the same lines joined by newlines,
        when they are exactly that (decoded in one go: a newline never splits a UTF-8 sequence)."""
        has_cr = b"\r" in block if block is not None else any(line.endswith(b"\r") for line in lines)
        if has_cr:
            lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        self._tail.extend(lines[-(self._tail.maxlen or 1) :])
        size = sum(map(len, self._tail))
        while size > self._tail_bytes and len(self._tail) > 1:
            size -= len(self._tail.popleft())
        if self._emit is None and self._emit_lines is None:
            return
        if block is not None:
            texts = block.decode("utf-8", "replace").split("\n")
            if has_cr:
                texts = [text[:-1] if text.endswith("\r") else text for text in texts]
        else:
            texts = [line.decode("utf-8", "replace") for line in lines]
        if self._emit_lines is not None:
            self._emit_lines(texts)
        elif self._emit is not None:
            for text in texts:
                self._emit(text)


def _pieces(line: bytes, limit: int) -> list[bytes]:
    """``line`` cut into pieces of at most ``limit`` bytes (one piece, maybe empty, if it fits)."""
    if len(line) <= limit:
        return [line]
    return [line[i : i + limit] for i in range(0, len(line), limit)]
