"""``SenderPool``: at most N threads that run the jobs handed to them, in the order they came.

The reporter's pool. ``ThreadPoolExecutor`` did the same with what the reporter never used: a
``Future`` per job (a ``Condition`` made, notified and torn down), a lock around every ``submit`` and
an idle ``Semaphore`` round per job, about 10 µs of the runner's main thread a task. Here a job is a
tuple on a ``queue.SimpleQueue`` (one C call, which wakes one waiting thread), a job's outcome goes
through its own callback, and the idle threads are counted on a list (``append`` and ``pop`` are
each one step under the GIL). What stays as ``ThreadPoolExecutor`` had it:

- the bound: a thread is started for a job only when no started thread is idle, up to ``threads``;
- ``close``: every job handed over before it runs, then the threads are joined; ``submit`` after it
  raises ``RuntimeError``;
- at interpreter exit the jobs handed over still run (the threads are joined before the interpreter
  joins its other threads), and a pool dropped without ``close`` ends its threads;
- a job that raises does not end its thread (it is logged: nothing waits on a result here).

Threads: ``submit`` and ``close`` from one thread (the runner's main thread); jobs on the pool's.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["SenderPool"]

log = logging.getLogger("conductor_run.report")

_Job = tuple[Callable[..., object], tuple[Any, ...]]

_pools: weakref.WeakSet[SenderPool] = weakref.WeakSet()  # open pools, closed at interpreter exit


class SenderPool:
    """At most ``threads`` threads named ``{name}_0``, ``{name}_1``, ... running the jobs handed over."""

    def __init__(self, threads: int, name: str) -> None:
        if threads < 1:
            raise ValueError(f"a sender pool needs at least one thread, not {threads}")
        self._bound = threads
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._idle: list[int] = []  # one entry per job finished: a thread free to take the next one
        self._threads: list[threading.Thread] = []
        self._closed = False
        weakref.finalize(self, _stop, self._jobs, self._threads)  # dropped unclosed: end the threads
        _pools.add(self)

    def submit(self, job: Callable[..., object], *args: Any) -> None:
        """Run ``job(*args)`` on one of the pool's threads (started if none is idle, up to the bound)."""
        if self._closed:
            raise RuntimeError("the sender pool is closed: no job can be handed over")
        self._jobs.put((job, args))
        try:
            self._idle.pop()  # a thread that finished a job takes this one
        except IndexError:
            if len(self._threads) < self._bound:
                self._start()

    def close(self) -> None:
        """Run every job handed over so far, then end and join the threads. Idempotent."""
        self._closed = True
        threads = list(self._threads)
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join()
        self._threads.clear()

    def _start(self) -> None:
        thread = threading.Thread(target=_work, args=(self._jobs, self._idle),
                                  name=f"{self._name}_{len(self._threads)}")  # fmt: skip
        thread.start()
        self._threads.append(thread)


def _work(jobs: queue.SimpleQueue[_Job | None], idle: list[int]) -> None:
    """A pool thread: jobs until the stop mark (it holds no reference to the pool itself, so a pool
    dropped without ``close`` is collected, and its finalizer stops the threads)."""
    while (item := jobs.get()) is not None:
        job, args = item
        del item
        try:
            job(*args)
        except BaseException:  # a thread's top level: the pool goes on (the job owns its outcome)
            log.exception("a job of the sender pool failed")
        del job, args
        idle.append(1)


def _stop(jobs: queue.SimpleQueue[_Job | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        jobs.put(None)


def _close_all() -> None:
    """At interpreter exit, before its other threads are joined: the jobs handed over still run."""
    for pool in list(_pools):
        pool.close()


_register_atexit: Callable[[Callable[[], None]], None] | None = getattr(threading, "_register_atexit", None)
if _register_atexit is not None:  # what ThreadPoolExecutor uses (joined before the non-daemon threads)
    _register_atexit(_close_all)
