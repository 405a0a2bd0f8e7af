"""Secret values out of everything the runner writes: ``Masker`` (whole texts and JSON values) and
``StreamMasker`` (a byte stream read in pieces, as a child's pipe is).

Every occurrence of a known secret value becomes ``MASK``. Occurrences that overlap or touch (two
secrets sharing characters, a value repeated back to back) are masked as one run, so no character
of either shows. A value shorter than ``MIN_MASKED_CHARS`` is not masked: replacing every "ab" in a
log would both wreck it and tell the reader where the value is not; the runner says so by name when
such a value is seen (never by value).

What this cannot catch: a value the child transforms before writing it (base64, hex, URL or JSON
escapes, reversed, split by other text, one character per line through a line-based tool), and
a short value below the minimum. It masks exact bytes (UTF-8 for text).

Bounds: the ``StreamMasker`` holds back at most the longest value minus one byte between reads (the
bytes that may be the start of a value), whatever the stream's length; the values themselves are
bounded by what the server sends with a task.

Must not: do I/O or keep the values anywhere but its own memory (no repr shows them). Pure.
Threads: a ``Masker`` is immutable and shared freely; a ``StreamMasker`` belongs to one reader.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from leasecore.models import TaskLog, TaskResult

MASK = "***"
MIN_MASKED_CHARS = 4


def _pattern(values: Iterable[bytes]) -> re.Pattern[bytes] | None:
    # Longest first: at a given position the alternation then takes the longest value starting there.
    ordered = sorted(set(values), key=lambda v: (-len(v), v))
    if not ordered:
        return None
    return re.compile(b"|".join(re.escape(v) for v in ordered), re.DOTALL)


def _runs(pattern: re.Pattern[Any], data: Any) -> list[tuple[int, int]]:
    """Every occurrence of every value in ``data`` (overlapping ones too), merged into disjoint runs
    ``(start, end)`` in order; touching runs become one."""
    runs: list[tuple[int, int]] = []
    pos = 0
    search = pattern.search
    while (m := search(data, pos)) is not None:
        start, end = m.span()
        if runs and start <= runs[-1][1]:
            if end > runs[-1][1]:
                runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
        pos = start + 1  # the next occurrence may start inside this one (overlapping values)
    return runs


# Up to this many values, occurrences are found with one ``find`` per value (memchr-fast, ~1 GB/s);
# beyond, with one regular expression over all of them (~70 MB/s, but one pass whatever their number).
_FIND_VALUES = 16


def _found_runs(values: tuple[Any, ...], data: Any) -> list[tuple[int, int]]:
    """``_runs`` by ``find``: every occurrence of each value, sorted and merged."""
    spans = []
    for value in values:
        find, size = data.find, len(value)
        pos = find(value)
        while pos != -1:
            spans.append((pos, pos + size))
            pos = find(value, pos + 1)
    if not spans:
        return []
    spans.sort()
    runs = [spans[0]]
    for start, end in spans[1:]:
        if start <= runs[-1][1]:
            if end > runs[-1][1]:
                runs[-1] = (runs[-1][0], end)
        else:
            runs.append((start, end))
    return runs


class Masker:
    """A set of secret values, and what masks them. Build with ``Masker.of(values)``."""

    __slots__ = ("_byte_list", "_longest", "_pattern", "_text_list", "_text_pattern", "_values")

    def __init__(self, values: frozenset[bytes]) -> None:
        self._values = values
        self._pattern = _pattern(values)
        texts = set()
        for value in values:
            try:
                texts.add(value.decode("utf-8", "surrogatepass"))
            except UnicodeDecodeError:  # not text: it can only be met in a byte stream
                continue
        ordered = sorted(texts, key=lambda v: (-len(v), v))
        self._text_pattern = re.compile("|".join(map(re.escape, ordered)), re.DOTALL) if ordered else None
        self._byte_list = tuple(values)
        self._text_list = tuple(ordered)
        self._longest = max(map(len, values), default=0)

    @classmethod
    def of(cls, values: Iterable[str | bytes]) -> Masker:
        """The values of at least ``MIN_MASKED_CHARS`` characters among ``values`` (others are left:
        ``too_short`` names them for a warning)."""
        kept = set()
        for value in values:
            if isinstance(value, str):
                data = value.encode("utf-8", "surrogatepass")
                chars = len(value)
            else:
                data, chars = value, len(value.decode("utf-8", "replace"))
            if chars >= MIN_MASKED_CHARS:
                kept.add(data)
        return cls(frozenset(kept))

    def __repr__(self) -> str:  # never the values
        return f"Masker({len(self._values)} values)"

    def __bool__(self) -> bool:
        return bool(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Masker) and other._values == self._values

    def __hash__(self) -> int:
        return hash(self._values)

    def with_values(self, values: Iterable[str | bytes]) -> Masker:
        """This masker's values plus ``values`` (the same object when nothing is added)."""
        extra = Masker.of(values)._values - self._values
        return self if not extra else Masker(self._values | extra)

    @property
    def longest_bytes(self) -> int:
        return self._longest

    def mask(self, text: str) -> str:
        """``text`` with every secret value (and every overlapping run of them) replaced by ``MASK``."""
        pattern = self._text_pattern
        if pattern is None or not text:
            return text
        runs = self._text_runs(text)
        if not runs:
            return text
        out = []
        pos = 0
        for start, end in runs:
            out.append(text[pos:start])
            out.append(MASK)
            pos = end
        out.append(text[pos:])
        return "".join(out)

    def mask_bytes(self, data: bytes) -> bytes:
        if self._pattern is None or not data:
            return data
        runs = self._byte_runs(data)
        return _masked(data, runs) if runs else data

    def mask_value(self, value: Any) -> Any:
        """A JSON value (objects, arrays, strings, numbers...) with every string in it masked, keys
        included; iterative (any depth). Objects come back as new dicts, the rest as is."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self.mask(value)
        if not isinstance(value, (dict, list)):
            return value
        root: list[Any] = [None]
        stack: list[tuple[Any, Any, Any]] = [(value, root, 0)]  # (source, destination, slot)
        while stack:
            source, dest, slot = stack.pop()
            if isinstance(source, str):
                dest[slot] = self.mask(source)
            elif isinstance(source, dict):
                copy: dict[Any, Any] = {}
                dest[slot] = copy
                for key, item in source.items():
                    name = self.mask(key) if isinstance(key, str) else key
                    copy[name] = None
                    stack.append((item, copy, name))
            elif isinstance(source, list):
                items: list[Any] = [None] * len(source)
                dest[slot] = items
                stack.extend((item, items, i) for i, item in enumerate(source))
            else:
                dest[slot] = source
        return root[0]

    def _byte_runs(self, data: bytes) -> list[tuple[int, int]]:
        if len(self._byte_list) <= _FIND_VALUES:
            return _found_runs(self._byte_list, data)
        assert self._pattern is not None
        return _runs(self._pattern, data)

    def _text_runs(self, text: str) -> list[tuple[int, int]]:
        if len(self._text_list) <= _FIND_VALUES:
            return _found_runs(self._text_list, text)
        assert self._text_pattern is not None
        return _runs(self._text_pattern, text)

    def stream(self) -> StreamMasker:
        return StreamMasker(self)

    def _hold_from(self, data: bytes, start: int) -> int:
        """The first position at or after ``start`` from which the rest of ``data`` is the beginning
        (not the whole) of some value: what must wait for the next read (``len(data)``: none)."""
        size = len(data)
        best = size
        for value in self._values:  # only where the value's first byte is: no work per byte in Python
            first = value[:1]
            pos = data.find(first, max(start, size - len(value) + 1))
            while pos != -1 and pos < best:
                if data.startswith(value[: size - pos], pos):
                    best = pos
                    break
                pos = data.find(first, pos + 1)
        return best


def _masked(data: bytes, runs: list[tuple[int, int]], first_is_continued: bool = False) -> bytes:
    out = []
    pos = 0
    mask = MASK.encode()
    for i, (start, end) in enumerate(runs):
        out.append(data[pos:start])
        if not (i == 0 and first_is_continued):
            out.append(mask)
        pos = end
    out.append(data[pos:])
    return b"".join(out)


class StreamMasker:
    """Masks a byte stream fed in arbitrary pieces: a value split across two reads is masked as if
    it came in one. ``feed`` returns what can be passed on now; ``flush`` the rest at the stream's end.

    Between reads it keeps the bytes that may start a value (at most the longest value minus one),
    and remembers when those bytes continue a run already masked (so that a value overlapping the
    end of a masked one shows no character either)."""

    __slots__ = ("_continued", "_held", "_joined", "_masker")

    def __init__(self, masker: Masker) -> None:
        self._masker = masker
        self._held = b""
        self._continued = 0  # the first bytes of _held that belong to a run already sent as MASK
        self._joined = False  # the last bytes sent were a MASK: a run starting at _held[0] joins it

    @property
    def held_bytes(self) -> int:
        return len(self._held)

    def _runs(self, buf: bytes) -> tuple[list[tuple[int, int]], bool]:
        """The runs of ``buf`` (held bytes first), and whether the first continues one already sent."""
        runs = self._masker._byte_runs(buf)
        continued = self._continued
        if continued:
            if runs and runs[0][0] <= continued:
                runs[0] = (0, max(continued, runs[0][1]))
            else:
                runs.insert(0, (0, continued))
        return runs, bool(runs) and runs[0][0] == 0 and (continued > 0 or self._joined)

    def feed(self, data: bytes) -> bytes:
        masker = self._masker
        if masker._pattern is None:
            return data
        buf = self._held + data if self._held else data
        runs, first_continued = self._runs(buf)
        hold = masker._hold_from(buf, 0)
        if hold == 0:  # all of it may start a value: nothing goes out yet
            self._held = buf
            self._continued = runs[0][1] if first_continued else 0
            return b""
        # A run that crosses the hold point is sent as MASK now; its part beyond the point is
        # remembered as continued, so that the next read's runs join it instead of showing it.
        sent = [run for run in runs if run[0] < hold]
        self._continued = 0
        if sent and sent[-1][1] > hold:
            self._continued = sent[-1][1] - hold
            sent[-1] = (sent[-1][0], hold)
        self._joined = bool(sent) and sent[-1][1] == hold
        self._held = buf[hold:]
        head = buf[:hold]
        return _masked(head, sent, first_is_continued=first_continued) if sent else head

    def flush(self) -> bytes:
        """The bytes held back, masked: call once, at the end of the stream."""
        held = self._held
        if not held or self._masker._pattern is None:
            self._held, self._continued, self._joined = b"", 0, False
            return held
        runs, first_continued = self._runs(held)
        self._held, self._continued, self._joined = b"", 0, False
        return _masked(held, runs, first_is_continued=first_continued) if runs else held


def mask_result(masker: Masker, result: TaskResult) -> TaskResult:
    """``result`` with every string of its output (keys included), its reason and its log lines
    masked; the same object when nothing changes."""
    if not masker:
        return result
    output = masker.mask_value(dict(result.output_data))
    reason = masker.mask(result.reason_for_incompletion) if result.reason_for_incompletion else None
    logs = tuple(TaskLog(masker.mask(line.log), line.created_time_ms) for line in result.logs)
    if output == result.output_data and reason == result.reason_for_incompletion and logs == result.logs:
        return result
    return dataclasses.replace(result, output_data=output, reason_for_incompletion=reason, logs=logs)


def masked_names(values: Mapping[str, str]) -> list[str]:
    """The names among ``values`` whose value is too short to be masked (for a warning by name)."""
    return sorted(name for name, value in values.items() if 0 < len(value) < MIN_MASKED_CHARS)
