"""``python -m bench [--quick] [flags]``: run every benchmark once, write results/latest.{md,json}.

Not part of the test suite. docs/benchmarks.md says what is measured and how. Sizes are flags; the
default run is bounded (about 30 minutes on a 2-core machine, 12 of them the scale section);
``--quick`` takes a few.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench import (
    footprint,
    harness,
    heartbeat,
    kill,
    neighbour,
    price,
    realjar,
    report,
    scale,
    serverload,
    stall,
    throughput,
)
from bench.harness import THROUGHPUT_ONLY_KINDS, WORKER_KINDS, BenchServer

# kill-groups: only with --only
SECTIONS = ("throughput", "price", "throughput-busy", "heartbeat", "kill", "stall", "footprint", "serverload",
            "scale", "heartbeat-real", "kill-groups")
# Beside a busy process: the workers a user would choose between, and main before a change (an A/B).
BUSY_KINDS = ("conductor-run", "conductor-run-base", "sdk", "floor")
RESULTS = Path(__file__).resolve().parent / "results"


def _pairs(text: str) -> list[tuple[int, int]]:
    """``40x2,1000x10`` -> [(40, 2), (1000, 10)]: leases x R seconds."""
    out = []
    for item in text.split(","):
        leases, r = item.lower().split("x")
        out.append((int(leases), int(r)))
    return out


def _load_configs(text: str) -> list[tuple[str, int]]:
    """``conductor-run:20,sdk:20`` -> [("conductor-run", 20), ("sdk", 20)]: worker kind x tasks."""
    out = []
    for item in text.split(","):
        kind, _, tasks = item.partition(":")
        if kind not in WORKER_KINDS or not tasks.isdigit() or int(tasks) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: expected KIND:TASKS, KIND one of {WORKER_KINDS}")
        out.append((kind, int(tasks)))
    return out


def _ints(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of whole numbers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of numbers >= 1")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a minute or two")
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only these sections (repeatable)")
    p.add_argument("--workers", default=",".join(WORKER_KINDS), help="comma list of workers to compare")
    p.add_argument("--tasks", type=int, help="throughput: tasks per run (default 500; quick 200)")
    p.add_argument("--concurrency", type=int, help="throughput: concurrency (default 4)")
    p.add_argument("--rounds", type=int, help="throughput: alternating rounds (default 3; quick 1)")
    p.add_argument("--leases", type=_pairs, help="heartbeat: LEASESxR list (default 40x2,1000x2,1000x10)")
    p.add_argument("--kill-grace", type=float, default=1.0,
                   help="kill: kill_grace seconds (default 1: R/4, the most a grace may be)")
    p.add_argument("--kill-trials", type=int, help="kill: trials per measure (default 2; quick 1)")
    p.add_argument("--shutdown-tasks", type=_ints, help="kill: tasks running at SIGTERM, a comma list "
                   "(default 4,200; quick 4)")  # fmt: skip
    p.add_argument("--deadline-trees", type=_ints, help="kill: trees whose lease runs out at once, a comma "
                   "list (default 1,200; quick 1)")  # fmt: skip
    p.add_argument("--stall-trees", type=_ints, help="stall: trees whose runner stalls, a comma list "
                   "(default 200; quick 20)")  # fmt: skip
    p.add_argument("--stall-busy", type=int, help="stall: CPU spinners beside them (default 12: load 10+)")
    p.add_argument("--idle-seconds", type=float, help="footprint: idle window (default 60; quick 10)")
    p.add_argument("--print-mb", type=int, help="footprint: MB the child prints (default 300; quick 50)")
    p.add_argument("--real-leases", type=_pairs,
                   help="heartbeat-real: LEASESxR list on the real server (default 40x2,40x10)")
    p.add_argument("--load", type=_load_configs,
                   help="serverload: KIND:TASKS list (default conductor-run:20,sdk:20,conductor-run:200)")
    p.add_argument("--load-window", type=float, help="serverload: window in s (default 120; quick 30)")
    p.add_argument("--scale-counts", type=_ints,
                   help="scale: lease counts, run ascending (default 1000,2500,5000; quick 200)")
    p.add_argument("--scale-r", type=int, default=60, help="scale: R in seconds (default 60)")
    p.add_argument("--scale-hold", type=float,
                   help="scale: seconds each child sleeps (default 100: two heartbeats; quick 45)")
    p.add_argument("--scale-budget", type=float,
                   help="scale: seconds the section may take; a count that would not fit is skipped "
                   "(default 720; quick 120)")
    p.add_argument("--cgroup", choices=("auto", "v2", "v1", "off"),
                   help="conductor-run's --cgroup in every section (default: its own, auto)")
    p.add_argument("--base-checkout", type=Path,
                   help="A/B: run worker kind conductor-run-base from this checkout (e.g. a copy of main)")
    p.add_argument("--base-cgroup", choices=("auto", "v2", "v1", "off"),
                   help="A/B: conductor-run-base's --cgroup (e.g. off, with --base-checkout .)")
    p.add_argument("--out", type=Path, default=RESULTS, help="where latest.md / latest.json go")
    p.add_argument("--keep", action="store_true", help="keep the work dir (worker and server logs)")
    args = p.parse_args(argv)
    q = args.quick
    args.tasks = args.tasks or (200 if q else 500)
    args.concurrency = args.concurrency or 4
    args.rounds = args.rounds or (1 if q else 3)
    args.leases = args.leases or ([(40, 2), (200, 2)] if q else [(40, 2), (1000, 2), (1000, 10)])
    args.kill_trials = args.kill_trials or (1 if q else 2)
    args.shutdown_tasks = args.shutdown_tasks or ([4] if q else [4, 200])
    args.deadline_trees = args.deadline_trees or ([1] if q else [1, 200])
    args.stall_trees = args.stall_trees or ([20] if q else [200])
    args.stall_busy = 12 if args.stall_busy is None else args.stall_busy
    args.idle_seconds = args.idle_seconds or (10.0 if q else 60.0)
    args.print_mb = args.print_mb or (50 if q else 300)
    args.real_leases = args.real_leases or ([(40, 2)] if q else [(40, 2), (40, 10)])
    args.load = args.load or [("conductor-run", 20), ("sdk", 20), ("conductor-run", 200)]
    args.load_window = args.load_window or (30.0 if q else 120.0)
    args.scale_counts = args.scale_counts or ([200] if q else [1000, 2500, 5000])
    args.scale_hold = args.scale_hold or (45.0 if q else 100.0)
    args.scale_budget = args.scale_budget or (120.0 if q else 720.0)
    return args


@contextlib.contextmanager
def _workdir(keep: bool) -> Iterator[str]:
    if keep:
        yield tempfile.mkdtemp(prefix="conductor-run-bench-")
        return
    with tempfile.TemporaryDirectory(prefix="conductor-run-bench-") as tmp:
        yield tmp


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": model,
        "cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "memory_gb": psutil.virtual_memory().total / 1e9,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions() -> dict[str, str]:
    out = {}
    for name in ("conductor-run", "conductor-python", "psutil", "requests"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def compile_bytecode(base: Path | None = None) -> str:
    """Write the project's ``.pyc`` files, as ``pip install`` does for an installed package.

    An editable checkout has none until an import writes them, and with PYTHONDONTWRITEBYTECODE (set
    on the machine these reports come from) none ever is: every worker start then compiles ~45
    modules from source (~70 ms of CPU), which an installed conductor-run never does, and the SDK,
    installed from a wheel, does not either. Python reads existing ``.pyc`` files under that setting."""
    roots = [Path(__file__).resolve().parent.parent, *([base] if base else [])]  # both sides of an A/B
    ok = all(compileall.compile_dir(str(root / name), quiet=2)
             for root in roots for name in ("leasecore", "cli", "bench"))  # fmt: skip
    return "compiled (as an installed package)" if ok else "some modules failed to compile"


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    harness.CONDUCTOR_RUN_CGROUP = args.cgroup
    if args.base_checkout is not None:
        if not (args.base_checkout / "cli" / "__main__.py").is_file():
            print(f"--base-checkout {args.base_checkout}: not a conductor-run checkout (no cli/__main__.py)")
            return 2
        harness.BASE_CHECKOUT = args.base_checkout.resolve()
    harness.BASE_CGROUP = args.base_cgroup
    kinds = [k for k in args.workers.split(",") if k]
    sections = args.only or [s for s in SECTIONS if s != "kill-groups"]  # --only: in the order given
    started = time.monotonic()
    results: dict[str, Any] = {
        "started_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command_line": shlex.join(["python", "-m", "bench", *argv]),
        "machine": machine(),
        "versions": versions(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                     if k not in ("out", "keep")},
        "bytecode": compile_bytecode(harness.BASE_CHECKOUT),
        "errors": [],
        "notes": [],
    }

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", flush=True)

    with _workdir(args.keep) as tmp:
        workdir = Path(tmp)
        srv = BenchServer(workdir / "server.log")
        log(f"server at {srv.url} (pid {srv.pid}); work dir {workdir}")
        try:
            for section in sections:
                load_before = [round(x, 2) for x in os.getloadavg()]
                try:
                    if section == "throughput":
                        results[section] = throughput.run(
                            srv,
                            workdir,
                            kinds,
                            tasks=args.tasks,
                            concurrency=args.concurrency,
                            rounds=args.rounds,
                            log=log,
                        )
                    elif section == "price":
                        results[section] = price.run(
                            srv, workdir, tasks=args.tasks, concurrency=args.concurrency, rounds=args.rounds,
                            log=log,
                        )
                    elif section == "throughput-busy":
                        with neighbour.busy_process() as pid:
                            log(f"a busy process beside the workers: pid {pid}")
                            results["throughput_busy"] = throughput.run(
                                srv, workdir, [k for k in kinds if k in BUSY_KINDS], tasks=args.tasks,
                                concurrency=args.concurrency, rounds=args.rounds, log=log,
                            )  # fmt: skip
                    elif section == "heartbeat":
                        hb_kinds = [k for k in kinds if k not in THROUGHPUT_ONLY_KINDS]
                        results[section] = heartbeat.run(srv, workdir, hb_kinds, configs=args.leases, log=log)
                    elif section == "kill":
                        results[section] = kill.run(
                            srv,
                            workdir,
                            kill_grace=args.kill_grace,
                            trials=args.kill_trials,
                            shutdown_tasks=args.shutdown_tasks,
                            log=log,
                            deadline_trees=tuple(args.deadline_trees),
                        )
                    elif section == "heartbeat-real":
                        real_kinds = [k for k in kinds if k in ("conductor-run", "sdk")]
                        results["heartbeat_real"] = realjar.run(workdir, real_kinds, configs=args.real_leases,
                                                                log=log)  # fmt: skip
                    elif section == "serverload":
                        results[section] = serverload.run(
                            srv,
                            workdir,
                            [c for c in args.load if c[0] in kinds],
                            r_seconds=60,
                            window_seconds=args.load_window,
                            warmup_seconds=10.0,
                            log=log,
                        )
                    elif section == "stall":
                        results[section] = stall.run(
                            srv, workdir, kill_grace=args.kill_grace, trials=args.kill_trials,
                            trees=tuple(args.stall_trees), busy=args.stall_busy, log=log,
                        )  # fmt: skip
                    elif section == "scale":
                        results[section] = scale.run(
                            srv, workdir, counts=args.scale_counts, r_seconds=args.scale_r,
                            hold_seconds=args.scale_hold, budget_seconds=args.scale_budget, log=log,
                        )  # fmt: skip
                    elif section == "kill-groups":
                        results[section] = kill.groups_vs_none(
                            srv, workdir, kill_grace=args.kill_grace, tasks=max(args.shutdown_tasks),
                            trials=args.kill_trials, log=log,
                        )  # fmt: skip
                    elif section == "footprint":
                        fp_kinds = [k for k in kinds if k not in THROUGHPUT_ONLY_KINDS]
                        results[section] = footprint.run(
                            srv,
                            workdir,
                            fp_kinds,
                            idle_seconds=args.idle_seconds,
                            warmup=5.0,
                            print_mb=args.print_mb,
                            log=log,
                        )
                except Exception as exc:  # one broken section must not lose the others' figures
                    log(f"{section} failed: {exc}")
                    traceback.print_exc()
                    results["errors"].append(f"{section}: {type(exc).__name__}: {exc}")
                # the machine is shared: its load (1, 5, 15 min averages) as each section began and ended
                results.setdefault("load_by_section", {})[section] = {
                    "start": load_before, "end": [round(x, 2) for x in os.getloadavg()]}
        finally:
            srv.close()
    results["wall_seconds"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "latest.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (args.out / "latest.md").write_text(report.render(results))
    log(f"wrote {args.out / 'latest.md'} and latest.json")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
