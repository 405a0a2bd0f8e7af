"""The lease engine's timer: one wake-up time per task, and the thread that sleeps until the earliest.

Owns ``TimerHeap`` (a heap of ``(when, arrival, key)`` entries with at most one live time per key:
scheduling a key again supersedes its older entry, skipped when it surfaces and dropped by an
occasional compaction, so the heap stays within a few times the live keys; plain data, no threads)
and ``Timer``, which keeps the heap under the engine's lock and runs the ``lease-timer`` thread: it
runs what is due (``LeaseEngine.run_due``'s work) and sleeps on a condition until the earliest time;
scheduling an earlier one wakes it. No polling loop.

Must not touch: leases, queues, the port. What a wake-up does is the step's business; ``now`` comes
from the injected clock.

Threads: ``lease-timer`` (``Timer.start_locked``); ``*_locked`` methods are called with the engine's
lock held, from that thread, the senders and the runner's loop. A test steps the engine itself
(``run_due`` on a ``FakeClock``) and never starts the thread.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from collections.abc import Callable

from leasecore.clock import Clock

__all__ = ["Timer", "TimerHeap"]

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

    @property
    def entries(self) -> int:
        """Entries held, superseded ones included (what ``compact`` bounds)."""
        return len(self._heap)

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


class Timer:
    """Wake-up times by task id under the engine's ``lock``, and the thread that acts on them."""

    def __init__(self, lock: threading.Lock, clock: Clock) -> None:
        self._heap = TimerHeap()
        self._lock, self._clock = lock, clock
        self._cv = threading.Condition(lock)
        self._target = -math.inf  # what the thread sleeps until (-inf: it is awake)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def schedule_locked(self, key: str, when: float | None) -> None:
        """Set ``key``'s wake-up time (None: none); wakes the thread if that is earlier than its sleep."""
        if self._heap.schedule(key, when) and when is not None and when < self._target:
            self._cv.notify()

    def discard_locked(self, key: str) -> None:
        """Forget ``key``'s wake-up time."""
        self._heap.discard(key)

    def pop_due_locked(self, now: float) -> str | None:
        """The next key due at ``now`` (its time cleared), or None."""
        return self._heap.pop_due(now)

    def compact_locked(self) -> None:
        """Bound the heap (see ``TimerHeap.compact``)."""
        self._heap.compact()

    def earliest_locked(self) -> float | None:
        """The earliest wake-up time (None: nothing scheduled)."""
        return self._heap.earliest()

    def start_locked(self, fire_locked: Callable[[], Callable[[], None] | None]) -> None:
        """Start the thread. Each time it wakes it calls ``fire_locked`` with the lock held (the engine
        runs what is due), then, without the lock, the hand-out that returns (None: nothing to hand
        out: it sleeps until the earliest time, in the same locked step, so no wake-up is lost)."""
        self._thread = threading.Thread(target=self._loop, args=(fire_locked,), name="lease-timer",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def stop_locked(self) -> list[threading.Thread]:
        """Ask the thread to end; it (to join), if it was started."""
        self._stopping = True
        self._cv.notify_all()
        return [self._thread] if self._thread is not None else []

    def alive(self) -> bool:
        """The thread runs (False before ``start_locked``, after it ended, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self, fire_locked: Callable[[], Callable[[], None] | None]) -> None:
        while True:
            with self._lock:
                self._target = -math.inf
                hand_out = fire_locked()
                if hand_out is None:
                    if self._stopping:
                        return
                    wake = self._heap.earliest()
                    self._target = math.inf if wake is None else wake
                    wait = self._target - self._clock.monotonic()
                    self._cv.wait(None if wait == math.inf else max(0.0, wait))
                    continue
            hand_out()  # (it took time: look again before sleeping)
