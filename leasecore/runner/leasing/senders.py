"""The lease engine's senders: who carries its requests out.

Owns the two executors behind ``SenderExecutor``: ``ThreadedSenders``, the product's pool (``senders``
threads at start, growing to ``max_senders`` while every one is busy, so that one hanging request
never delays the other leases), and ``InlineSenders``, which carries the requests out in the caller's
thread when the engine's ``run_due`` asks (tests on a ``FakeClock``: no threads). The queue they take
from (``SendQueue``, ``Job``: heartbeats first, checks capped and budgeted) is the engine core's, in
``schedule``; re-exported here.

Must not touch: leases, the port or the server. What a request does and what its outcome means is
the engine's (``SendSource.take`` hands a sender the call to make); this module only decides who makes
it and when. Every use of the queue holds the engine's lock (``SendSource.lock``).

Threads: ``ThreadedSenders`` runs the ``lease-sender-N`` threads; they wait on a condition of the
engine's lock and call ``take`` under it, then the call outside it. ``InlineSenders`` runs none.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from leasecore.runner.leasing.schedule import Job, SendQueue

__all__ = [
    "InlineSenders", "Job", "SendQueue", "SendSource", "SenderExecutor", "SenderLoad", "ThreadedSenders",
]


@dataclass(frozen=True, eq=False)
class SendSource:
    """The engine's side of its senders. ``runnable``, ``budget_wait_seconds`` and ``take`` are called
    with ``lock`` held; ``take`` pops one request and returns the call that carries it out (to make
    without the lock), or None when the request is void (its task was forgotten meanwhile)."""

    lock: threading.Lock
    runnable: Callable[[], int]
    budget_wait_seconds: Callable[[], float | None]
    take: Callable[[], Callable[[], None] | None]


@dataclass(frozen=True, eq=False)
class SenderLoad:
    """How busy the senders are, for ``EngineMetrics``."""

    senders: int
    busy: int
    saturated_waits: int  # requests that had to queue with every sender busy and the pool at max


class SenderExecutor(Protocol):
    """Who carries the engine's requests out. ``*_locked`` methods are called with the lock held."""

    @property
    def capacity(self) -> int:
        """The most requests carried out at once (ownership checks get at most half, at least one)."""
        ...

    def bind(self, source: SendSource) -> None:
        """Take requests from ``source`` from now on (the engine calls it once, in its constructor)."""
        ...

    def start_locked(self) -> None:
        """The engine starts: start carrying requests out on its own (if it does that at all)."""
        ...

    def work_queued_locked(self, runnable: int) -> None:
        """A request was queued; ``runnable`` of them may go now."""
        ...

    def notify_locked(self) -> None:
        """A request held back by the checks' cap may go now."""
        ...

    def run_ready(self) -> None:
        """Called by ``run_due`` without the lock: carry out in this thread what may go now, if this
        executor works in its caller's thread."""
        ...

    def stop_locked(self) -> list[threading.Thread]:
        """Stop taking requests; the threads to join (each finishes its current call)."""
        ...

    def load_locked(self) -> SenderLoad:
        """Senders, busy ones, saturated waits."""
        ...


class ThreadedSenders:
    """A pool of sender threads: ``senders`` at start, one more whenever a request finds every sender
    busy, up to ``max_senders``; an idle sender waits for work (one of them, timed, for the budget's
    next token)."""

    def __init__(self, senders: int = 8, max_senders: int = 64) -> None:
        if not 1 <= senders <= max_senders:
            raise ValueError(f"need 1 <= senders ({senders}) <= max_senders ({max_senders})")
        self._initial, self._max = senders, max_senders
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._started = self._stopping = False
        self._budget_waiter = False  # an idle sender sleeps until the budget's next token
        self._saturated_waits = 0
        self._source: SendSource | None = None
        self._work_cv: threading.Condition | None = None

    @property
    def capacity(self) -> int:
        return self._max

    def bind(self, source: SendSource) -> None:
        self._source = source
        self._work_cv = threading.Condition(source.lock)

    def start_locked(self) -> None:
        self._started = True
        for _ in range(self._initial):
            self._spawn_locked()

    def work_queued_locked(self, runnable: int) -> None:
        if runnable <= self._idle:
            self._cv().notify()
        elif self._started and not self._stopping and len(self._threads) < self._max:
            self._spawn_locked()
        elif self._started:
            self._saturated_waits += 1

    def notify_locked(self) -> None:
        self._cv().notify()

    def run_ready(self) -> None:
        """Nothing: the pool's own threads carry everything out."""

    def stop_locked(self) -> list[threading.Thread]:
        self._stopping = True
        self._cv().notify_all()
        return list(self._threads)

    def load_locked(self) -> SenderLoad:
        return SenderLoad(len(self._threads), len(self._threads) - self._idle, self._saturated_waits)

    def _cv(self) -> threading.Condition:
        if self._work_cv is None:
            raise RuntimeError("ThreadedSenders used before bind()")
        return self._work_cv

    def _spawn_locked(self) -> None:
        if self._source is None:
            raise RuntimeError("ThreadedSenders used before bind()")
        # lease-sender-1 ...: the engine's timer thread was number 0 when they shared one list.
        name = f"lease-sender-{len(self._threads) + 1}"
        thread = threading.Thread(target=self._loop, args=(self._source, self._cv()), name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _loop(self, source: SendSource, work_cv: threading.Condition) -> None:
        while True:
            with source.lock:
                while not source.runnable() and not self._stopping:
                    timeout = None if self._budget_waiter else source.budget_wait_seconds()
                    self._budget_waiter = self._budget_waiter or timeout is not None
                    self._idle += 1
                    work_cv.wait(timeout)
                    self._idle -= 1
                    if timeout is not None:
                        self._budget_waiter = False
                if self._stopping:
                    return
                call = source.take()
            if call is not None:
                call()


class InlineSenders:
    """Carries the requests out in the caller's thread, only when asked: the engine's ``run_due`` runs
    every request that may go (unless ``hold``), ``run_next`` one. No threads, so a test on a
    ``FakeClock`` decides when everything happens; ``hold`` stands for a pool busy elsewhere (requests
    wait in the queue, visible in the metrics, until ``run_next``). ``capacity``: as a pool's size
    (checks in flight: half of it)."""

    def __init__(self, capacity: int = 2, *, hold: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"need capacity >= 1, got {capacity}")
        self._capacity = capacity
        self.hold = hold
        self._source: SendSource | None = None

    @property
    def capacity(self) -> int:
        return self._capacity

    def bind(self, source: SendSource) -> None:
        self._source = source

    def start_locked(self) -> None:
        """Refused: nothing here runs on its own, so an engine on it is stepped (``run_due``), never
        started (its timer thread would fire leases whose requests nobody carries out)."""
        raise RuntimeError("InlineSenders carry requests out only in run_due / run_next: step the "
                           "engine on them, do not start it")  # fmt: skip

    def work_queued_locked(self, runnable: int) -> None:
        """Nothing: the request waits for ``run_due`` / ``run_next``."""

    def notify_locked(self) -> None:
        """Nothing (see ``work_queued_locked``)."""

    def run_ready(self) -> None:
        if not self.hold:
            while self.run_next():
                pass

    def run_next(self) -> bool:
        """Carry out the next request that may go now, in this thread; False when there is none."""
        if self._source is None:
            raise RuntimeError("InlineSenders used before bind()")
        while True:
            with self._source.lock:
                if not self._source.runnable():
                    return False
                call = self._source.take()
            if call is not None:
                call()
                return True

    def stop_locked(self) -> list[threading.Thread]:
        return []

    def load_locked(self) -> SenderLoad:
        return SenderLoad(0, 0, 0)
