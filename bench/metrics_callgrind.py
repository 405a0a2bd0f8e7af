"""Instructions of the runner process per task, metrics on against off, counted by callgrind.

``python -m bench.metrics_callgrind [SIZES] [ROUNDS]`` (default ``20,220 2``): for each round and size
N, one ``conductor-run run --max-tasks N --concurrency 4 --cgroup off -- true`` under ``valgrind
--tool=callgrind`` (the runner only: the fork server is its own process, not traced) against the
bench's embedded server, once with ``--metrics-port 0`` and once without, in alternating order. The
per-task figure is the difference between two sizes divided by their task difference, so start-up
(imports, the metrics endpoint) drops out. Instruction counts do not depend on the machine's load,
which moved the throughput A/B's rounds by far more than the 3 % it is to show.
Not part of the suite or of ``python -m bench``: each run takes 10-30 s under valgrind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.harness import ROOT, BenchServer


def run(size: int, mode: str, label: str, server: BenchServer, out: Path) -> int:
    task_type = f"cg_{label}"
    server.define(task_type)
    server.start(task_type, size)
    argv = [
        "valgrind", "--tool=callgrind", "--trace-children=no",
        f"--callgrind-out-file={out / f'callgrind.{task_type}.out'}",
        sys.executable, "-m", "cli", "run", "--server", server.url, "--task-type", task_type,
        "--concurrency", "4", "--worker-id", "cg", "--state-dir", tempfile.mkdtemp(prefix="cg-state-"),
        "--max-tasks", str(size), "--cgroup", "off",
        *(["--metrics-port", "0"] if mode == "on" else []), "--", "true",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONDUCTOR")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{task_type}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    sizes = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "20,220").split(",")]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    small, large = min(sizes), max(sizes)
    out = Path(tempfile.mkdtemp(prefix="bench-callgrind-"))
    server = BenchServer(out / "server.log")
    per_task: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for r in range(rounds):
            counts: dict[tuple[str, int], int] = {}
            for size in (small, large):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                    counts[(mode, size)] = run(size, mode, f"{mode}_{r}_{size}", server, out)
                    print(f"round {r + 1} {mode} {size} tasks: {counts[(mode, size)]} instructions",
                          flush=True)
            for mode in ("off", "on"):
                per_task[mode].append((counts[(mode, large)] - counts[(mode, small)]) / (large - small))
    finally:
        server.close()
    for off, on in zip(per_task["off"], per_task["on"], strict=True):
        print(f"per task: off {off / 1e6:.3f} M, on {on / 1e6:.3f} M, on / off {on / off:.3f}")


if __name__ == "__main__":
    main()
