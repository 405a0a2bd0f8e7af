"""Footprint: idle CPU and RSS while long polling an empty queue; RSS while a child prints a lot.

CPU and RSS are those of the worker's own processes (see :mod:`bench.measure`). Idle: the worker
starts on a task type with no tasks, gets ``warmup`` seconds to settle, then CPU seconds are read at
the start and end of the window and RSS every second (max reported). Printing: one task whose child
writes ``print_mb`` MB of 64-byte lines to stdout; RSS is sampled every 50 ms until the task is
reported (peak reported).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness import BenchServer, WorkerConfig, running_worker
from bench.measure import cpu_seconds, rss_bytes, worker_processes

MB = 1024 * 1024
LINE = "bench output line: 0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ"  # 63 chars + newline


def idle(srv: BenchServer, workdir: Path, kind: str, *, seconds: float, warmup: float) -> dict[str, Any]:
    task_type = f"idle_{kind.replace('-', '_')}"
    srv.define(task_type)
    cfg = WorkerConfig(
        kind=kind,
        url=srv.url,
        task_type=task_type,
        concurrency=4,
        command=["true"],
        state_dir=workdir / "state",
    )
    with running_worker(cfg, workdir / f"{task_type}.log") as worker:
        time.sleep(warmup)  # a measurement window, not a wait for a condition: start-up is excluded
        procs = worker_processes(worker.pid)
        cpu0, t0 = cpu_seconds(procs), time.monotonic()
        rss: list[int] = []
        end = t0 + seconds
        while time.monotonic() < end:
            rss.append(rss_bytes(procs))
            time.sleep(min(1.0, max(end - time.monotonic(), 0)))
        cpu1, t1 = cpu_seconds(procs), time.monotonic()
        each = [(_role(p, worker.pid), p.memory_info().rss / MB) for p in procs]
        if not worker.alive():
            raise RuntimeError(f"the {kind} worker exited during the idle window:\n{worker.log_tail()}")
    return {
        "kind": kind,
        "seconds": t1 - t0,
        "processes": len(procs),
        "cpu_percent": 100.0 * (cpu1 - cpu0) / (t1 - t0),
        "rss_max_mb": max(rss) / MB,
        "rss_last_mb": rss[-1] / MB,
        "rss_by_process_mb": each,
    }


def _role(proc: psutil.Process, root_pid: int) -> str:
    """The worker's main process, or what its command line says a helper is (fork server, ...)."""
    if proc.pid == root_pid:
        return "main"
    try:
        line = " ".join(proc.cmdline())
    except psutil.Error:
        return "helper"
    if "forkserver" in line or "_BOOT" in line or " -I -S " in line:
        return "fork server"
    return "helper"


def printing(srv: BenchServer, workdir: Path, kind: str, *, print_mb: int) -> dict[str, Any]:
    task_type = f"print_{kind.replace('-', '_')}"
    srv.define(task_type)
    task_ids = srv.task_ids(srv.start(task_type, 1))
    script = f"yes '{LINE}' | head -c {print_mb * MB}"  # a fixed bench command; no task data in it
    cfg = WorkerConfig(
        kind=kind,
        url=srv.url,
        task_type=task_type,
        concurrency=1,
        command=["sh", "-c", script],
        state_dir=workdir / "state",
    )
    with running_worker(cfg, workdir / f"{task_type}.log") as worker:
        peak, started = 0, time.monotonic()
        deadline = started + 300
        while srv.settled(task_ids) < 1:
            if not worker.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {kind} worker did not finish printing:\n{worker.log_tail()}")
            peak = max(peak, rss_bytes(worker_processes(worker.pid)))
            time.sleep(0.05)
        took = time.monotonic() - started
    statuses = srv.marks(task_ids)["statuses"]
    return {
        "kind": kind,
        "print_mb": print_mb,
        "rss_peak_mb": peak / MB,
        "seconds": took,
        "status": statuses[task_ids[0]],
    }


def run(
    srv: BenchServer,
    workdir: Path,
    kinds: list[str],
    *,
    idle_seconds: float,
    warmup: float,
    print_mb: int,
    log: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {"idle_seconds": idle_seconds, "print_mb": print_mb, "idle": [], "printing": []}
    for kind in kinds:
        r = idle(srv, workdir, kind, seconds=idle_seconds, warmup=warmup)
        log(
            f"idle {kind}: CPU {r['cpu_percent']:.2f} % RSS {r['rss_max_mb']:.1f} MB ({r['processes']} procs)"
        )
        out["idle"].append(r)
    for kind in kinds:
        r = printing(srv, workdir, kind, print_mb=print_mb)
        log(f"printing {print_mb} MB {kind}: peak RSS {r['rss_peak_mb']:.1f} MB in {r['seconds']:.1f} s")
        out["printing"].append(r)
    return out
