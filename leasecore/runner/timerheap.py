"""The lease engine's wake-up times: one per task, the earliest first.

Owns a heap of ``(when, arrival, key)`` entries with at most one live time per key: scheduling a key
again supersedes its older entry (left in the heap, skipped when it surfaces, and dropped by an
occasional compaction, so the heap stays within a few times the live keys). The engine keys it by
task id and stores each lease's ``next_wakeup()`` in it.

Must not touch: leases, locks, threads or a clock: ``now`` is handed in. Waiting until the earliest
time (the timer thread, or a test stepping a ``FakeClock``) is the engine's.

Threads: none of its own, and not thread-safe: the engine calls it only under its lock, from its
timer thread, its senders and the runner's loop.
"""

from __future__ import annotations

import heapq
import itertools

__all__ = ["TimerHeap"]

_COMPACT_SLACK = 64  # superseded entries tolerated beyond 4 per live key before a compaction


class TimerHeap:
    """Wake-up times by key; ``pop_due(now)`` hands out the due keys, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, float] = {}
        self._arrival = itertools.count()

    def __len__(self) -> int:
        """Keys with a wake-up time."""
        return len(self._live)

    def schedule(self, key: str, when: float | None) -> bool:
        """Set ``key``'s wake-up time (None: none); True when it was not already that time."""
        if self._live.get(key) == when:
            return False
        if when is None:
            del self._live[key]
            return True
        self._live[key] = when
        heapq.heappush(self._heap, (when, next(self._arrival), key))
        return True

    def discard(self, key: str) -> None:
        """Forget ``key``'s wake-up time, if it has one."""
        self._live.pop(key, None)

    def earliest(self) -> float | None:
        """The earliest live wake-up time (None: nothing scheduled)."""
        self._drop_superseded()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> str | None:
        """The key whose time is earliest and at or before ``now`` (its time cleared), or None."""
        self._drop_superseded()
        if not self._heap or self._heap[0][0] > now:
            return None
        _, _, key = heapq.heappop(self._heap)
        del self._live[key]
        return key

    def compact(self) -> None:
        """Drop superseded entries once they outnumber the live ones by far (bounds the heap)."""
        if len(self._heap) > 4 * len(self._live) + _COMPACT_SLACK:
            self._heap = [(when, next(self._arrival), key) for key, when in self._live.items()]
            heapq.heapify(self._heap)

    def _drop_superseded(self) -> None:
        while self._heap and self._live.get(self._heap[0][2]) != self._heap[0][0]:
            heapq.heappop(self._heap)
