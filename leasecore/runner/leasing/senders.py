"""The lease engine's senders: the queue of requests waiting for one, and who carries them out.

Owns ``SendQueue`` (heartbeats first, the most overdue first, then ownership checks in arrival order;
checks in flight capped at half the executor's capacity and started no faster than the runner's
``CheckBudget``) and the two executors behind ``SenderExecutor``: ``ThreadedSenders``, the product's
pool (``senders`` threads at start, growing to ``max_senders`` while every one is busy, so that one
hanging request never delays the other leases), and ``InlineSenders``, which carries the requests out
in the caller's thread when the engine's ``run_due`` asks (tests on a ``FakeClock``: no threads).

Must not touch: leases, the port or the server. What a request does and what its outcome means is
the engine's (``SendSource.take`` hands a sender the call to make); this module only decides who makes
it and when. The queue is not thread-safe: every use holds the engine's lock (``SendSource.lock``).

Threads: ``ThreadedSenders`` runs the ``lease-sender-N`` threads; they wait on a condition of the
engine's lock and call ``take`` under it, then the call outside it. ``InlineSenders`` runs none.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from leasecore.checkbudget import CheckBudget
from leasecore.lease import CheckOwnership, SendHeartbeat

__all__ = [
    "InlineSenders", "Job", "SendQueue", "SendSource", "SenderExecutor", "SenderLoad", "ThreadedSenders",
]


@dataclass(frozen=True)
class Job:
    """One request waiting for a sender: a lease's ``SendHeartbeat`` or ``CheckOwnership``."""

    task_id: str
    workflow_id: str
    action: SendHeartbeat | CheckOwnership
    min_attempt_seconds: float
    queued_at: float  # monotonic seconds
    task_type: str = ""  # the metrics' label


class SendQueue:
    """Requests waiting for a sender. Not thread-safe: the engine's lock."""

    def __init__(self, max_checks_calling: int, budget: CheckBudget) -> None:
        self._beats: list[tuple[float, int, Job]] = []  # heap by (due time, arrival)
        self._checks: deque[Job] = deque()
        self._arrival = itertools.count()
        self._max_checks_calling = max_checks_calling
        self._checks_calling = 0
        self._budget = budget

    def __len__(self) -> int:
        return len(self._beats) + len(self._checks)

    def push(self, job: Job) -> bool:
        """Queue ``job``. False for a check beyond the cap: it waits for a check in flight to end, so
        there is no sender to wake or add for it."""
        if isinstance(job.action, SendHeartbeat):
            heapq.heappush(self._beats, (job.action.due_at, next(self._arrival), job))
            return True
        self._checks.append(job)
        return len(self._checks) <= self._max_checks_calling - self._checks_calling

    def runnable(self, now: float) -> int:
        """How many queued requests a free sender may take now (checks beyond the cap or the budget
        wait)."""
        free_check_slots = max(0, self._max_checks_calling - self._checks_calling)
        if self._checks and free_check_slots:
            free_check_slots = min(free_check_slots, self._budget.available(now))
        return len(self._beats) + min(len(self._checks), free_check_slots)

    def budget_wait_seconds(self, now: float) -> float | None:
        """How long until the budget lets the first queued check go, when only the budget holds it
        back (None: it does not)."""
        if not self._checks or self._checks_calling >= self._max_checks_calling:
            return None
        wait = self._budget.wait_seconds(now)
        return wait if wait > 0 else None

    def pop(self) -> Job:
        """The next request (only while ``runnable``): the most overdue heartbeat, else the oldest check."""
        return heapq.heappop(self._beats)[2] if self._beats else self._checks.popleft()

    def check_started(self, now: float) -> None:
        """A popped check goes out: it counts against the cap and takes the budget's token."""
        self._checks_calling += 1
        self._budget.take(now)

    def check_done(self) -> bool:
        """A check in flight ended; True when a check held back by the cap may go now."""
        self._checks_calling -= 1
        return bool(self._checks)

    def withdraw_beats(self, task_id: str) -> bool:
        """Drop ``task_id``'s queued heartbeats (its final update begins); True when there were any."""
        queued = len(self._beats)
        self._beats = [b for b in self._beats if b[2].task_id != task_id]
        if len(self._beats) == queued:
            return False
        heapq.heapify(self._beats)
        return True

    def clear(self) -> None:
        """Drop everything queued (the engine stops)."""
        self._beats.clear()
        self._checks.clear()

    def queued_times(self) -> Iterator[float]:
        """When the waiting requests were queued (checks: only the oldest, they wait in order)."""
        yield from (job.queued_at for _, _, job in self._beats)
        if self._checks:
            yield self._checks[0].queued_at


@dataclass(frozen=True)
class SendSource:
    """The engine's side of its senders. ``runnable``, ``budget_wait_seconds`` and ``take`` are called
    with ``lock`` held; ``take`` pops one request and returns the call that carries it out (to make
    without the lock), or None when the request is void (its task was forgotten meanwhile)."""

    lock: threading.Lock
    runnable: Callable[[], int]
    budget_wait_seconds: Callable[[], float | None]
    take: Callable[[], Callable[[], None] | None]


@dataclass(frozen=True)
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
