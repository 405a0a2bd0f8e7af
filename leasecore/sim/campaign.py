"""Many seeds: run them (in worker processes when asked), total them, and say what a violation was.

Owns ``run_campaign`` (seeds first..first+n-1 through ``run_seed``, in order; with ``jobs`` > 1 in a
process pool, each seed still alone in its own world), ``summary_line`` (the last line of
``./scripts/sim``) and ``violation_report`` (the seed, the violation, the trace leading to it).

Threads: none; worker processes only with ``jobs`` > 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from leasecore.sim.scenario import SeedResult, SimOptions, run_seed

__all__ = ["Totals", "run_campaign", "summary_line", "violation_report"]


@dataclass
class Totals:
    seeds: int = 0
    task_hours: float = 0.0
    attempts: int = 0
    faults: int = 0
    violations: int = 0

    def add(self, result: SeedResult) -> None:
        self.seeds += 1
        self.task_hours += result.task_hours
        self.attempts += result.attempts
        self.faults += result.faults
        self.violations += len(result.violations)


def _one(args: tuple[int, SimOptions]) -> SeedResult:
    return run_seed(*args)


def run_campaign(first: int, count: int, options: SimOptions, *, jobs: int = 1) -> Iterator[SeedResult]:
    """Each seed's result, in seed order."""
    work = [(seed, options) for seed in range(first, first + count)]
    if jobs <= 1:
        yield from map(_one, work)
        return
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        yield from pool.map(_one, work, chunksize=1)


def summary_line(t: Totals) -> str:
    return (f"sim: {t.seeds} seeds, {t.task_hours:.1f} simulated task-hours, {t.attempts} attempts, "
            f"{t.faults} faults, {t.violations} violations")


def violation_report(result: SeedResult, lines: int = 60, emit: Callable[[str], None] = print) -> None:
    emit(f"seed {result.seed}: {len(result.violations)} violation(s)")
    for v in result.violations:
        emit(f"  {v}")
    emit(f"  the last {min(lines, len(result.trace))} events (simulated seconds; replay: "
         f"./scripts/sim --seed {result.seed} --trace):")
    for line in result.trace[-lines:]:
        emit(f"    {line}")
