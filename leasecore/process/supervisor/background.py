"""The Supervisor's chores thread ("supervisor-chores"): work the reader thread must not wait for.

Owns a queue of chores and the one daemon thread that runs them, started at the first chore: the
``shutil.rmtree`` of a task directory the child filled with files (it takes as long as it takes) and
the kill of a command whose start was given up (a send to the fork server, which blocks while its
socket is full: were the reader waiting there, the fork server, itself blocked on its answers to the
reader, would never drain it). ``urgent`` chores (the kills) go before any rmtree still waiting.

Must not touch: children, pipes, the fork server's socket or the Supervisor's tables; a chore is an
opaque callable. A failing chore is logged and the next one runs.

Threads: ``submit`` from any thread (the reader's, mostly); the chores on "supervisor-chores". Once
closed, or while no thread can be started, a chore runs on the caller's thread (for a kill on the
reader thread that risk is taken: it needs the thread start to fail). ``close`` from the
Supervisor's closing thread, with a bounded wait.
"""

from __future__ import annotations

import collections
import logging
import shutil
import threading
from collections.abc import Callable

# one logger for the runner's side of process/
log = logging.getLogger("leasecore.process.supervisor.supervisor")


class Chores:
    """The chores queue and its thread; see the module docstring."""

    def __init__(self) -> None:
        self._chores: collections.deque[Callable[[], None]] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def rmtree(self, path: str) -> None:
        self.submit(lambda: shutil.rmtree(path, ignore_errors=True))

    def submit(self, chore: Callable[[], None], *, urgent: bool = False) -> None:
        with self._cond:
            inline = self._closed
            if not inline and self._thread is None:
                thread = threading.Thread(target=self._run, name="supervisor-chores", daemon=True)
                try:
                    thread.start()
                    self._thread = thread
                except RuntimeError:  # no thread to be had now: do it here (tried again next time)
                    inline = True
            if not inline:
                if urgent:
                    self._chores.appendleft(chore)
                else:
                    self._chores.append(chore)
                self._cond.notify()
        if inline:
            self._do(chore)

    def close(self, timeout_seconds: float) -> None:
        """Finish the chores handed over (bounded wait); later ones run on their caller's thread."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify()
        if thread is not None:
            thread.join(timeout_seconds)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._chores and not self._closed:
                    self._cond.wait()
                if not self._chores:
                    return
                chore = self._chores.popleft()
            self._do(chore)

    @staticmethod
    def _do(chore: Callable[[], None]) -> None:
        try:
            chore()
        except Exception:  # a chore's failure must not end the thread that runs the next one
            log.exception("a supervisor chore failed")

