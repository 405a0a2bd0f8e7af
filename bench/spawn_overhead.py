"""Per-task spawn overhead: spawn + wait of ``true`` through the Supervisor, against the plain ways.

Three loops, each run ``--runs`` times (default 200) after a few warm-up runs, one at a time:

- ``subprocess``: ``subprocess.run(["true"])`` (vfork/exec + waitpid, no pipes kept);
- ``posix_spawn``: ``os.posix_spawn`` + ``os.waitpid`` (the least Python can do);
- ``supervisor``: ``Supervisor.spawn(task, CommandSpec(argv=("true",)))`` + ``child.wait()``: the
  conductor-run path (task temp dir + input file, env build, 2 pipes, the fork server's fork/exec in
  a new session, exit report, output thread drain, output file read, temp dir removal).

Prints the median, p90 and max per loop, in milliseconds, and the supervisor's extra cost over each.

    python -m bench.spawn_overhead [--runs 200] [--profile]

``--profile`` runs the supervisor loop under pyinstrument (the runner's side only: the fork server is
another process) and prints where the time goes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor

WARMUP = 10
TRUE = shutil.which("true") or "/bin/true"


def _timed(action: Callable[[], None], runs: int) -> list[float]:
    for _ in range(WARMUP):
        action()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000.0)
    return samples


def _subprocess() -> None:
    subprocess.run([TRUE], check=True)


def _posix_spawn() -> None:
    pid = os.posix_spawn(TRUE, [TRUE], os.environ)
    os.waitpid(pid, 0)


def _supervised(supervisor: Supervisor) -> Callable[[], None]:
    task = Task(task_id="t", workflow_id="w", task_type="bench")
    spec = CommandSpec(argv=(TRUE,))

    def run() -> None:
        exit = supervisor.spawn(task, spec, worker_id="bench").wait(30)
        assert exit is not None and exit.exit_code == 0

    return run


def _summary(name: str, samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[int(len(ordered) * 0.9) - 1]
    median = statistics.median(samples)
    return f"{name:<12} median {median:7.3f} ms   p90 {p90:7.3f} ms   max {ordered[-1]:7.3f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.spawn_overhead")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--profile", action="store_true", help="profile the supervisor loop (pyinstrument)")
    args = parser.parse_args(argv)
    environ = {"PATH": os.environ.get("PATH", os.defpath)}
    with Supervisor(Path(os.environ.get("TMPDIR", "/tmp")) / "spawn-overhead-state", environ=environ) as sup:
        supervised = _supervised(sup)
        if args.profile:
            from pyinstrument import Profiler  # test extra only

            profiler = Profiler(interval=0.0002)
            with profiler:
                _timed(supervised, args.runs)
            print(profiler.output_text(unicode=True, color=False, show_all=False))
            return 0
        results = {
            "subprocess": _timed(_subprocess, args.runs),
            "posix_spawn": _timed(_posix_spawn, args.runs),
            "supervisor": _timed(supervised, args.runs),
        }
    for name, samples in results.items():
        print(_summary(name, samples))
    ours = statistics.median(results["supervisor"])
    for name in ("subprocess", "posix_spawn"):
        base = statistics.median(results[name])
        print(f"supervisor - {name}: {ours - base:+.3f} ms per task (x{ours / base:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
