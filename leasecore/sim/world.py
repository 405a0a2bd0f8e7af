"""The simulated world: one clock, one event heap, one random source, one trace.

Owns ``SimClock`` (a ``leasecore.clock.Clock`` that moves only when the scheduler pops an event),
``World`` (the heap of ``(time, seq, label, callback)``, the seed's single ``random.Random``, the
trace of every event and its sha256 digest) and ``Violation``. Everything that happens in a seed is
an event popped from this heap, one at a time, in (time, sequence) order: the same seed runs the same
events in the same order and gives the same trace, bit for bit.

Must not: read the wall clock, sleep, start threads, draw randomness from anywhere but ``rng``, or
iterate a set or a dict whose order depends on hashing (only insertion-ordered dicts and lists).

Threads: none. A world belongs to the one thread that runs it.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

__all__ = ["SimClock", "Violation", "World"]

_EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
_TAIL_LINES = 400  # trace lines kept for a violation report when the full trace is not kept


class SimClock:
    """The world's time; ``monotonic()`` is simulated seconds, ``now()`` a fixed epoch plus those."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self._start = start

    def monotonic(self) -> float:
        return self.t

    def now(self) -> datetime:
        return _EPOCH + timedelta(seconds=self.t - self._start)


@dataclass(frozen=True)
class Violation:
    """An invariant broken at ``at`` (simulated seconds): which one, and the facts behind it."""

    invariant: str
    at: float
    detail: str


class World:
    """The scheduler, the seed's random source and the trace."""

    def __init__(self, seed: int, *, keep_trace: bool = False) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.clock = SimClock()
        self._heap: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = 0
        self._digest = hashlib.sha256()
        self.keep_trace = keep_trace
        self.lines: list[str] = []  # every line (keep_trace) ...
        self.tail: deque[str] = deque(maxlen=_TAIL_LINES)  # ... or the last ones
        self.events = 0
        self.violations: list[Violation] = []

    @property
    def now(self) -> float:
        return self.clock.t

    def at(self, when: float, label: str, callback: Callable[[], None]) -> None:
        """Run ``callback`` at simulated time ``when`` (never in the past)."""
        self._seq += 1
        # Any float: the store computes a due time and tests it with the same sum (server.records.due_at),
        # so a timer event at ``next_due()`` always finds its check due. Float arithmetic is the same on
        # every run, so the same seed still gives the same times.
        when = max(when, self.clock.t)
        heapq.heappush(self._heap, (when, self._seq, label, callback))

    def after(self, delay: float, label: str, callback: Callable[[], None]) -> None:
        self.at(self.clock.t + delay, label, callback)

    def log(self, text: str) -> None:
        """One trace line, stamped with the simulated time; part of the digest."""
        line = f"{self.clock.t - 1000.0:11.3f} {text}"
        self._digest.update(line.encode())
        self._digest.update(b"\n")
        if self.keep_trace:
            self.lines.append(line)
        else:
            self.tail.append(line)

    def violate(self, invariant: str, detail: str) -> None:
        self.log(f"VIOLATION {invariant}: {detail}")
        self.violations.append(Violation(invariant, self.clock.t - 1000.0, detail))

    def digest(self) -> str:
        return self._digest.hexdigest()

    def run_until(self, end: float, *, stop: Callable[[], bool] = lambda: False) -> None:
        """Pop and run events in order until simulated time ``end`` (absolute), the heap is empty,
        a violation is found or ``stop()`` says so (asked after each event)."""
        heap = self._heap
        clock = self.clock
        while heap and heap[0][0] <= end and not self.violations:
            when, _, _label, callback = heapq.heappop(heap)
            clock.t = when
            self.events += 1
            callback()
            if stop():
                return
        if not self.violations and clock.t < end:
            clock.t = end
