"""The lease engine's timer thread: it sleeps until the core's earliest lease wake-up.

Owns ``Timer``, the ``lease-timer`` thread: it runs what is due (``LeaseEngine.run_due``'s work) and
sleeps on a condition until the core's earliest time (``core.EngineCore.timer_due``, the times kept
in ``schedule.TimerHeap``, re-exported here); a step that makes an earlier time wakes it
(``poke_locked``). No polling loop.

Must not touch: leases, queues, the port. What a wake-up does is the step's business; ``now`` comes
from the injected clock.

Threads: ``lease-timer`` (``Timer.start_locked``); ``*_locked`` methods are called with the engine's
lock held, from that thread, the senders and the runner's loop. A test steps the engine itself
(``run_due`` on a ``FakeClock``) and never starts the thread.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from leasecore.clock import Clock
from leasecore.runner.leasing.schedule import TimerHeap

__all__ = ["Timer", "TimerHeap"]  # (TimerHeap: schedule's, re-exported)


class Timer:
    """The thread that wakes the engine when the core's earliest lease wake-up comes, under its ``lock``."""

    def __init__(self, lock: threading.Lock, clock: Clock, times: TimerHeap) -> None:
        """``times``: the core's wake-up times (``EngineCore.timer_heap``), read with the lock held."""
        self._lock, self._clock = lock, clock
        self._times = times
        self._cv = threading.Condition(lock)
        self._target = -math.inf  # what the thread sleeps until (-inf: it is awake)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def poke_locked(self) -> None:
        """The core stepped: wake the thread if a time before the thread's sleep was scheduled since it
        went to sleep (the only way the earliest time moves earlier: nothing else adds one)."""
        if self._times.scheduled_low < self._target:  # (False while awake: -inf; it looks again)
            self._cv.notify()

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
                    wake = self._times.rearm()
                    self._target = math.inf if wake is None else wake
                    wait = self._target - self._clock.monotonic()
                    self._cv.wait(None if wait == math.inf else max(0.0, wait))
                    continue
            hand_out()  # (it took time: look again before sleeping)
