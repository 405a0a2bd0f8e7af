"""Server load: the requests a worker makes per running task per hour, by kind, with R = 60 s.

For each configuration (worker kind, tasks), that many one-task workflows of a type with
``responseTimeoutSeconds`` = R are queued and the worker runs them all at once (concurrency = tasks),
each child a ``sleep`` outliving the window. Once every task is claimed and ``warmup`` seconds have
passed, the server's counts of that type's requests (``bench.server``: polls, heartbeats, other
updates, ownership checks, logs) are read at the start and end of a window; per task and hour =
count / (tasks x window) x 3600. Heartbeats are few per task in a window (one per 0.8 R), so their
rate is also given from the gaps between each task's accepted ``extendLease`` calls (median gap ->
3600 / gap), which a window's edges do not skew.

The configurations run at the same time (each on its own task type), to keep the section short;
the counts are per type, so they do not mix. Nothing here is a target: the ownership checks' budget
(``ownership_check_rate``, docs/leases.md) is what bounds conductor-run's checks, and the 200-task row shows
it at work (200 tasks at a 5 s interval would be 40 checks a second; the budget is 20).
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchServer, WorkerConfig, running_worker, wait_until

KINDS = ("poll", "heartbeat", "check", "log", "update")


def run(
    srv: BenchServer,
    workdir: Path,
    configs: list[tuple[str, int]],
    *,
    r_seconds: int,
    window_seconds: float,
    warmup_seconds: float,
    log: Any,
) -> dict[str, Any]:
    started: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        for kind, tasks in configs:
            task_type = f"load_{kind.replace('-', '_')}_{tasks}"
            srv.define(task_type, response_timeout_seconds=r_seconds)
            task_ids = srv.task_ids(srv.start(task_type, tasks))
            hold = warmup_seconds + window_seconds + 3 * r_seconds
            cfg = WorkerConfig(
                kind=kind,
                url=srv.url,
                task_type=task_type,
                concurrency=tasks,
                command=["sleep", f"{hold:g}"],
                state_dir=workdir / f"state-{task_type}",
            )
            worker = stack.enter_context(running_worker(cfg, workdir / f"{task_type}.log"))
            started.append(
                {"kind": kind, "tasks": tasks, "type": task_type, "ids": task_ids, "worker": worker}
            )
        for run_ in started:
            ids, worker = run_["ids"], run_["worker"]

            def claimed(ids: list[str] = ids, worker: Any = worker) -> bool:
                if not worker.alive():
                    raise RuntimeError(f"the {worker.cfg.kind} worker exited:\n{worker.log_tail()}")
                return all(srv.marks(ids)["claims"][t] for t in ids)

            wait_until(claimed, 120, 0.5, what=f"{len(ids)} {run_['kind']} tasks to be claimed")
        time.sleep(warmup_seconds)  # a measurement window, not a wait for a condition
        before, t0 = srv.requests(), time.monotonic()
        time.sleep(window_seconds)
        after, t1 = srv.requests(), time.monotonic()
        for run_ in started:
            if not run_["worker"].alive():
                raise RuntimeError(f"the {run_['kind']} worker exited during the window")
        marks = {run_["type"]: srv.marks(run_["ids"]) for run_ in started}
    window = t1 - t0
    rows = []
    for run_ in started:
        counts0, counts1 = before.get(run_["type"], {}), after.get(run_["type"], {})
        per_hour = {
            k: (counts1.get(k, 0) - counts0.get(k, 0)) * 3600.0 / (run_["tasks"] * window) for k in KINDS
        }
        m = marks[run_["type"]]
        gaps = []
        for t in run_["ids"]:
            times = sorted(m["leases"][t])
            gaps += [b - a for a, b in itertools.pairwise(times)]
        statuses: dict[str, int] = {}
        for s in m["statuses"].values():
            statuses[str(s)] = statuses.get(str(s), 0) + 1
        row = {
            "kind": run_["kind"],
            "tasks": run_["tasks"],
            "r_seconds": r_seconds,
            "window_seconds": window,
            "per_task_per_hour": per_hour,
            "total_per_hour": sum(per_hour.values()),
            "heartbeat_gap_median_seconds": statistics.median(gaps) if gaps else None,
            "heartbeats_per_task_per_hour_from_gaps": (3600.0 / statistics.median(gaps)) if gaps else None,
            "runner_requests_per_second": sum(
                counts1.get(k, 0) - counts0.get(k, 0) for k in KINDS
            ) / window,
            "statuses_at_end": statuses,
        }
        log(
            f"server load {row['kind']} x{row['tasks']} (R={r_seconds}s, {window:.0f} s): per task per hour "
            + ", ".join(f"{k} {v:.0f}" for k, v in per_hour.items())
            + f"; heartbeat gap {row['heartbeat_gap_median_seconds']}"
        )
        rows.append(row)
    return {"r_seconds": r_seconds, "window_seconds": window_seconds, "warmup_seconds": warmup_seconds,
            "concurrent": True, "runs": rows}
