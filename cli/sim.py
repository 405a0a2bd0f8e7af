"""``./scripts/sim``: run the deterministic simulator over a range of seeds (docs/simulator.md).

A developer's tool, not a ``conductor-run`` command: argparse, plain prints. The last line is always
``sim: N seeds, H simulated task-hours, A attempts, F faults, V violations``; exit 1 on any violation
(each printed with its seed and the trace leading to it), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from leasecore.sim.campaign import Totals, run_campaign, summary_line, violation_report
from leasecore.sim.scenario import SimOptions
from leasecore.sim.setting import Bugs

BUG_NAMES = tuple(Bugs.__dataclass_fields__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/sim", description="Deterministic simulation of runners "
                                "against a simulated Conductor under faults; see docs/simulator.md.")
    p.add_argument("--seeds", type=int, default=20, help="how many seeds (default 20)")
    p.add_argument("--first-seed", type=int, default=1, help="the first seed (default 1)")
    p.add_argument("--seed", type=int, help="run this one seed (same as --seeds 1 --first-seed X)")
    p.add_argument("--trace", action="store_true", help="print every event of each seed and its digest")
    p.add_argument("--runners", type=int, default=3, help="runners competing for the task type (default 3)")
    p.add_argument("--minutes", type=float, default=15.0,
                   help="simulated minutes of faults and new work per seed (default 15), then a quiet phase")
    p.add_argument("--hours", type=float, help="the same in simulated hours (overrides --minutes)")
    p.add_argument("--sweep", choices=("ideal", "coarse", "mixed"), default="mixed",
                   help="the server's timeout sweeps: prompt, late like the real server's, or drawn per seed")
    p.add_argument("--no-lost-update", action="store_true",
                   help="a server whose extendLease never writes back a stale copy")
    p.add_argument("--no-kill-by", action="store_true",
                   help="fork servers without the dead-man switch (a stalled runner's trees run on)")
    p.add_argument("--known-gaps", action="store_true",
                   help="requeue running tasks in every seed, under any fault (what is still open "
                   "around re-deliveries: see docs/simulator.md, findings)")
    p.add_argument("--fault-scale", type=float, default=1.0,
                   help="multiply every per-request fault probability (each capped at 0.2; default 1)")
    p.add_argument("--no-faults", action="store_true", help="no injected faults (a baseline)")
    p.add_argument("--no-operator", action="store_true",
                   help="no operator pauses and drains among the faults")
    p.add_argument("--bug", action="append", default=[], choices=BUG_NAMES, metavar="NAME",
                   help=f"plant a known race in the simulated runner: {', '.join(BUG_NAMES)}")
    p.add_argument("--jobs", type=int, default=0, help="worker processes (default: the CPUs available)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seed is not None:
        args.first_seed, args.seeds = args.seed, 1
    if args.hours is not None:
        args.minutes = args.hours * 60.0
    if args.seeds < 1 or args.runners < 1 or args.minutes <= 0 or not args.fault_scale >= 0:
        print("scripts/sim: --seeds and --runners must be at least 1, --minutes (--hours) above 0, "
              "--fault-scale at least 0", file=sys.stderr)
        return 2
    options = SimOptions(runners=args.runners, minutes=args.minutes, sweep=args.sweep,
                         lost_update=not args.no_lost_update, kill_by=not args.no_kill_by,
                         faults=not args.no_faults, known_gaps=args.known_gaps,
                         fault_scale=args.fault_scale, operator=not args.no_operator,
                         bugs=Bugs(**{name: True for name in args.bug}),
                         keep_trace=args.trace)
    jobs = args.jobs or len(os.sched_getaffinity(0))
    totals = Totals()
    began = time.monotonic()
    for result in run_campaign(args.first_seed, args.seeds, options, jobs=1 if args.trace else jobs):
        totals.add(result)
        if args.trace:
            for line in result.trace:
                print(line)
            print(f"seed {result.seed}: trace digest sha256:{result.digest} ({result.events} events)")
        if result.violations:
            violation_report(result)
    print(f"({time.monotonic() - began:.1f} s wall, {jobs if not args.trace else 1} process(es))",
          file=sys.stderr)
    print(summary_line(totals))
    return 1 if totals.violations else 0


if __name__ == "__main__":
    sys.exit(main())
