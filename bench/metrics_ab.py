"""The metrics A/B ("counting must not slow the hot paths"): conductor-run with its metrics
endpoint on (``conductor-run-metrics``) against off, in the throughput section's alternating rounds.

Owns: the start-up CPU mark of a conductor-run worker (``cpu_at_serving``: its processes' CPU when it
logs "serving", i.e. after the imports, prometheus-client's among them, and before the first poll),
and the ratios the report gives (``ratios``): time, worker CPU per task with the start-up, and worker
CPU per task of the run alone (the hot paths), each as the ratio of the medians and per round (the
machine is shared: the spread of the per-round ratios says how much is noise). Pure arithmetic but
for ``cpu_at_serving``, which reads the worker's log and its processes' CPU (bench's own thread).
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any

from bench.measure import cpu_seconds, worker_processes
from bench.stats import median, ratio

ON, OFF = "conductor-run-metrics", "conductor-run"
SERVING = b" serving "  # conductor-run's log line once set up: "serving TYPE on URL as WORKER"


def cpu_at_serving(pid: int, log_path: Path, timeout_seconds: float = 60.0) -> float | None:
    """CPU seconds of the worker's processes when its log first says "serving" (None: it did not).

    Polled every 2 ms: the first claim may come that much before the mark, a few microseconds of CPU."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        try:
            if SERVING in log_path.read_bytes():
                return cpu_seconds(worker_processes(pid))
        except OSError:
            pass
        time.sleep(0.002)
    return None


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """On / off: medians' ratio and every round's own, for time, CPU per task, run-only CPU per task."""
    out: dict[str, Any] = {}
    for name, field in (("time", "seconds"), ("cpu", "worker_cpu_ms_per_task"),
                        ("run_cpu", "worker_run_cpu_ms_per_task")):
        on = [r[field] for r in runs if r["kind"] == ON and r.get(field) is not None]
        off = [r[field] for r in runs if r["kind"] == OFF and r.get(field) is not None]
        out[f"{name}_on_over_off"] = ratio(median(on), median(off))
        out[f"{name}_on_over_off_per_round"] = per_round(runs, field)
        out[f"{name}_per_round_median"] = median([x for x in out[f"{name}_on_over_off_per_round"]
                                                  if x is not None])
    starts = {kind: median([r["worker_start_cpu_ms"] for r in runs
                            if r["kind"] == kind and r.get("worker_start_cpu_ms") is not None])
              for kind in (ON, OFF)}
    out["start_cpu_ms"] = starts
    return out


def per_round(runs: list[dict[str, Any]], field: str) -> list[float | None]:
    by_round: dict[int, dict[str, float]] = collections.defaultdict(dict)
    for r in runs:
        if r.get(field) is not None:
            by_round[r["round"]][r["kind"]] = r[field]
    return [ratio(v.get(ON), v.get(OFF)) for _, v in sorted(by_round.items()) if ON in v and OFF in v]
