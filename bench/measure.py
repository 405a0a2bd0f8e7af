"""What is measured on processes: CPU and RSS of a worker's own processes, exit times of task trees.

Counted for a worker: every Python process in its process tree (conductor-run: the runner and its fork
server; the SDK: its parent, worker, logger and resource-tracker processes; the floor: itself). Task
children (``true``, ``sleep``, ``sh``...) are not counted: they are the user's work, not the worker's.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterable

import psutil


def worker_processes(pid: int) -> list[psutil.Process]:
    """The worker's own (Python) processes: ``pid`` and its Python descendants."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.pid == pid or "python" in p.name().lower():
                out.append(p)
    return out


def cpu_seconds(procs: Iterable[psutil.Process]) -> float:
    """User + system CPU seconds of ``procs`` so far (processes that vanished count 0)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def rss_bytes(procs: Iterable[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


class ExitWatch:
    """Exit times of a set of processes (not our children), exact to the poll wake-up, via pidfds."""

    def __init__(self, pids: Iterable[int]) -> None:
        self._fds: dict[int, int] = {}
        self.exited_at: dict[int, float] = {}
        for pid in pids:
            try:
                self._fds[os.pidfd_open(pid)] = pid
            except ProcessLookupError:
                self.exited_at[pid] = time.monotonic()  # already gone when we looked

    def wait(self, timeout_seconds: float) -> float | None:
        """Block until every process has exited; return when the last one did (None: timed out)."""
        poller = select.poll()
        for fd in self._fds:
            poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + timeout_seconds
        try:
            while self._fds:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                for fd, _ in poller.poll(left * 1000):
                    self.exited_at[self._fds.pop(fd)] = time.monotonic()
                    poller.unregister(fd)
                    os.close(fd)
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        return max(self.exited_at.values()) if self.exited_at else None
