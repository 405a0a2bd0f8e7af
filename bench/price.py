"""The price list of safety: what each of conductor-run's guarantees costs per task, side by side.

One throughput run (N ``true`` tasks at concurrency C, rounds alternating the order) of conductor-run
as shipped, of conductor-run with one guarantee taken out (``harness.PRICE_KINDS``: the group per tree
by ``--cgroup off``, the rest by the bench-only build ``bench.price_cli``), with all of them out at
once (``conductor-run-bare``), with the metrics on (``conductor-run-metrics``: they are off by
default, so their price is on - off), and of floor-v2 (the bare update-v2 chaining loop) and the SDK.

A part's price is, per round, the full run's figure minus the run without it, then the median over
the rounds (paired in one round, so a slow spell of the machine lands on both): in wall time per
task (the run's time / N), in slot time per task (x C: what each task adds to the time its slot is
busy, the figure for "a task that runs 100 ms"), and in the worker's CPU per task (runner + fork
server, start-up included as in the throughput section). The parts' prices need not add up to the
whole (full - bare): taking one part out moves where the others wait.

What cannot be taken out here: the fork server hop (the runner asks another process to spawn; there
is no in-process spawner to compare with) is given as the fork server's own CPU per task, an upper
bound (its ``posix_spawn`` and reaping would be paid by any spawner); output capture's pipes stay in
every run (the child's tails are read from them; ``logstream`` takes out the task log buffered and
streamed to the server).
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from bench import throughput
from bench.harness import FLOOR_V2_KIND, METRICS_KIND, PRICE_KINDS, BenchServer
from bench.stats import median, ratio

FULL = "conductor-run"
BARE = "conductor-run-bare"
# (part, what it is, kind whose difference with the full run is the price, sign): sign -1 for a
# part the full run does not have on by default (metrics: on - off)
PARTS: list[tuple[str, str, str, int]] = [
    ("group per tree", "a cgroup per tree: kill of escapees, limits, OOM reasons, accounting",
     "conductor-run-without-group", 1),
    ("task's files", "input.json, output.json, checkpoint and secrets files: made, read, removed",
     "conductor-run-without-files", 1),
    ("log stream", "the task log buffered and streamed to the server (the pipes stay)",
     "conductor-run-without-logstream", 1),
    ("lease engine", "the lease tracked from the claim: heartbeats, fences, ownership checks",
     "conductor-run-without-lease", 1),
    ("state record", "the journal of live trees a restart sweeps after a crash",
     "conductor-run-without-record", 1),
    ("metrics (when on)", "--metrics-port: counters and histograms per task (off by default)",
     METRICS_KIND, -1),
]
KINDS = [FULL, *PRICE_KINDS, METRICS_KIND, FLOOR_V2_KIND, "sdk"]


def _by_round(runs: list[dict[str, Any]], key: str) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = collections.defaultdict(dict)
    for r in runs:
        if r.get(key) is not None:
            out[r["round"]][r["kind"]] = r[key]
    return out


def _paired(by_round: dict[int, dict[str, float]], a: str, b: str) -> list[float]:
    """a - b within each round that ran both."""
    return [times[a] - times[b] for _, times in sorted(by_round.items()) if a in times and b in times]


def analyse(tp: dict[str, Any]) -> dict[str, Any]:
    """The price list from a throughput result that ran ``KINDS`` (pure)."""
    n, c = tp["tasks"], tp["concurrency"]
    runs = tp["runs"]
    seconds = _by_round(runs, "seconds")
    cpu = _by_round(runs, "worker_cpu_ms_per_task")
    root = _by_round(runs, "root_cpu_ms_per_task")
    full_wall = median([t[FULL] * 1000 / n for t in seconds.values() if FULL in t])
    full_cpu = median([t[FULL] for t in cpu.values() if FULL in t])
    rows = []
    for part, what, kind, sign in [*PARTS, ("all of the above but metrics", "everything removable at once",
                                            BARE, 1)]:
        wall = [sign * d * 1000 / n for d in _paired(seconds, FULL, kind)]
        cpus = [sign * d for d in _paired(cpu, FULL, kind)]
        wall_ms = median(wall)
        rows.append({
            "part": part, "what": what, "kind": kind,
            "wall_ms_per_task": wall_ms,
            "slot_ms_per_task": None if wall_ms is None else wall_ms * c,
            "cpu_ms_per_task": median(cpus),
            "wall_per_round": wall, "cpu_per_round": cpus,
            "share_of_wall": ratio(wall_ms, full_wall),
            "share_of_cpu": ratio(median(cpus), full_cpu),
        })  # fmt: skip
    total = rows[-1]
    forkserver = [t[FULL] - root[r][FULL] for r, t in cpu.items() if FULL in t and FULL in root.get(r, {})]
    floor_gap = [d * 1000 / n for d in _paired(seconds, FULL, FLOOR_V2_KIND)]
    slot = total["slot_ms_per_task"]
    return {
        "tasks": n,
        "concurrency": c,
        "full_wall_ms_per_task": full_wall,
        "full_slot_ms_per_task": None if full_wall is None else full_wall * c,
        "full_cpu_ms_per_task": full_cpu,
        "parts": rows,
        # the single parts but metrics (off by default) and the whole
        "sum_of_parts_wall_ms": sum(r["wall_ms_per_task"] or 0.0 for r in rows[:-2]),
        "forkserver_cpu_ms_per_task": median(forkserver),
        "gap_to_floor_v2_wall_ms_per_task": median(floor_gap),
        # the users' question: a task of 100 ms keeps its slot busy this many % longer for the safety
        "percent_of_100ms_task": None if slot is None else slot,
        "cpu_percent_of_100ms_task": total["cpu_ms_per_task"],
    }


def run(
    srv: BenchServer, workdir: Path, *, tasks: int, concurrency: int, rounds: int, log: Any
) -> dict[str, Any]:
    tp = throughput.run(srv, workdir, KINDS, tasks=tasks, concurrency=concurrency, rounds=rounds, log=log)
    tp["price"] = analyse(tp)
    return tp
