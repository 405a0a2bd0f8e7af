"""What is measured on processes: CPU and RSS of a worker's own processes, exit times of task trees.

Counted for a worker: every Python process in its process tree (conductor-run: the runner and its fork
server; the SDK: its parent, worker, logger and resource-tracker processes; the floor: itself). Task
children (``true``, ``sleep``, ``sh``...) are not counted: they are the user's work, not the worker's.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import select
import threading
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


def cpu_seconds(procs: Iterable[psutil.Process], *, children: bool = False) -> float:
    """User + system CPU seconds of ``procs`` so far (processes that vanished count 0); ``children``:
    of the children they reaped instead (with what those reaped): a worker's task commands, whoever of
    its processes reaps them (conductor-run's fork server)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.children_user + t.children_system if children else t.user + t.system
    return total


_PROC_STAT = "/proc/stat"
_Sample = tuple[float, float, "tuple[int, int] | None"]  # CpuSampler: monotonic, CPU seconds, jiffies


def machine_jiffies(stat_text: str) -> tuple[int, int] | None:
    """(steal, total) clock ticks of the whole machine from the text of ``/proc/stat``: the first
    ("cpu") line's steal (its 8th figure: time the hypervisor gave this VM's CPUs to someone else)
    and the sum of its first eight (user, nice, system, idle, iowait, irq, softirq, steal; guest time
    is already inside user). None when the line is not there or too short (no steal figure)."""
    first = stat_text.split("\n", 1)[0].split()
    if len(first) < 9 or first[0] != "cpu":
        return None
    ticks = [int(x) for x in first[1:9]]
    return ticks[7], sum(ticks)


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share (0..1) of the machine's CPU time taken by the hypervisor between two
    ``machine_jiffies`` readings (None: a reading is missing or no time passed)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def read_jiffies() -> tuple[int, int] | None:
    """``machine_jiffies`` now (None: no ``/proc/stat``)."""
    try:
        with open(_PROC_STAT) as f:
            return machine_jiffies(f.read())
    except OSError:
        return None


class CpuSampler:
    """CPU seconds of the server, a worker and the worker's reaped commands, sampled every ``interval``
    on a thread (``time.monotonic``: the clock the bench server marks claims and updates on), so a
    window's CPU leaves out what was spent outside it (the worker's start-up, its stop). The worker's
    processes are listed anew every half second (its helpers may start after it). Also the machine's
    steal time (``/proc/stat``): on a VM, the CPU time the hypervisor gave to others, which slows a
    round without any process of ours doing more."""

    def __init__(self, server_pid: int, worker_pid: int, interval: float = 0.02) -> None:
        self._server = worker_processes(server_pid)
        self._worker_pid = worker_pid
        self._interval = interval
        self._samples: list[_Sample] = []  # the CPU seconds of all three, and machine_jiffies
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        procs: list[psutil.Process] = []
        listed_at = -1.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - listed_at >= 0.5:
                procs, listed_at = worker_processes(self._worker_pid), now
            total = cpu_seconds(self._server) + cpu_seconds(procs) + cpu_seconds(procs, children=True)
            self._samples.append((time.monotonic(), total, read_jiffies()))
            self._stop.wait(self._interval)

    def cores_busy(self, start: float, end: float) -> float | None:
        """The average number of cores the three kept busy from ``start`` to ``end`` (None: too few
        samples): the CPU between the last sample at or before each end."""
        window = self._window(start, end)
        if window is None:
            return None
        (t0, c0, _), (t1, c1, _) = window
        return (c1 - c0) / (t1 - t0)

    def host_steal(self, start: float, end: float) -> float | None:
        """The share of the machine's CPU time the hypervisor took from ``start`` to ``end`` (between
        the same samples as ``cores_busy``; None: too few samples, or no steal figure)."""
        window = self._window(start, end)
        return None if window is None else steal_share(window[0][2], window[1][2])

    def _window(self, start: float, end: float) -> tuple[_Sample, _Sample] | None:
        """The last samples at or before ``start`` and ``end`` (None: not two different ones)."""
        times = [sample[0] for sample in self._samples]
        i, j = bisect.bisect_right(times, start) - 1, bisect.bisect_right(times, end) - 1
        return None if i < 0 or j <= i else (self._samples[i], self._samples[j])


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
