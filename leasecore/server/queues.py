"""The delay queue behind each task queue of the embedded server (poll order: available time, then FIFO).

Threads: the store's request threads, always under the store's lock; its condition is made on that
lock, so a long poll waits on the queue it polls while the lock is released.
"""

from __future__ import annotations

import heapq
import itertools
import threading


class DelayQueue:
    """A delay queue of task ids: a heap of (available_at, seq, id) with lazy deletion."""

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self._heap: list[tuple[float, int, str]] = []
        self._live: dict[str, int] = {}
        self._seq = itertools.count()
        self.pollers = 0  # polls waiting on ``cond`` right now
        self.ever_pushed = False  # False: only polls made it (a task type nothing was scheduled for)

    @property
    def disposable(self) -> bool:
        """Nothing waits on it and nothing was ever queued in it: forgetting it loses nothing."""
        return self.pollers == 0 and not self.ever_pushed

    def push(self, task_id: str, available_at: float) -> None:
        self.ever_pushed = True
        seq = next(self._seq)
        self._live[task_id] = seq
        heapq.heappush(self._heap, (available_at, seq, task_id))

    def remove(self, task_id: str) -> None:
        self._live.pop(task_id, None)

    def _purge(self) -> None:
        while self._heap and self._live.get(self._heap[0][2]) != self._heap[0][1]:
            heapq.heappop(self._heap)

    def pop_ready(self, now: float, count: int) -> list[str]:
        out: list[str] = []
        while len(out) < count:
            self._purge()
            if not self._heap or self._heap[0][0] > now:
                break
            _, _, task_id = heapq.heappop(self._heap)
            del self._live[task_id]
            out.append(task_id)
        return out

    def next_available(self) -> float | None:
        self._purge()
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._live)
