"""Throughput: N trivial tasks (``true``) at concurrency C, for each worker, in alternating rounds.

Time of a run = the server's clock from the first claim of a task to the last final update: worker
start-up (imports, the SDK's process spawning) is outside it, the same for every worker. The tasks
are queued before the worker starts. Rounds rotate the order of the workers so that a slow spell of
the (shared) machine does not land on one worker only; the report gives medians over the rounds.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from bench.harness import BenchServer, WorkerConfig, running_worker
from bench.measure import cpu_seconds, worker_processes
from bench.stats import median, ratio


def one_run(
    srv: BenchServer, workdir: Path, kind: str, round_no: int, tasks: int, concurrency: int
) -> dict[str, Any]:
    task_type = f"tp_{kind.replace('-', '_')}_{round_no}"
    srv.define(task_type)
    task_ids = srv.task_ids(srv.start(task_type, tasks))
    cfg = WorkerConfig(
        kind=kind,
        url=srv.url,
        task_type=task_type,
        concurrency=concurrency,
        command=["true"],
        state_dir=workdir / "state",
    )
    server_cpu0 = cpu_seconds(worker_processes(srv.pid))
    with running_worker(cfg, workdir / f"{task_type}.log") as worker:
        srv.wait_settled(task_ids, timeout_seconds=60 + tasks * 0.2, worker=worker)
        worker_cpu = cpu_seconds(worker_processes(worker.pid))
    server_cpu = cpu_seconds(worker_processes(srv.pid)) - server_cpu0
    marks = srv.marks(task_ids)
    first_claim = min(min(c) for c in marks["claims"].values() if c)
    last_report = max(max(t for t, s in u if s != "IN_PROGRESS") for u in marks["updates"].values() if u)
    seconds = last_report - first_claim
    statuses = collections.Counter(str(s) for s in marks["statuses"].values())
    return {
        "kind": kind,
        "round": round_no,
        "seconds": seconds,
        "tasks_per_second": tasks / seconds,
        "statuses": dict(statuses),
        # Diagnostics: where the CPU went. The worker's figure includes its start-up.
        "server_cpu_ms_per_task": 1000 * server_cpu / tasks,
        "worker_cpu_ms_per_task": 1000 * worker_cpu / tasks,
    }


def run(
    srv: BenchServer, workdir: Path, kinds: list[str], *, tasks: int, concurrency: int, rounds: int, log: Any
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for round_no in range(rounds):
        order = kinds[round_no % len(kinds) :] + kinds[: round_no % len(kinds)]
        for kind in order:
            result = one_run(srv, workdir, kind, round_no, tasks, concurrency)
            log(
                f"throughput round {round_no + 1}/{rounds} {kind}: {result['seconds']:.2f} s "
                f"({result['tasks_per_second']:.0f} tasks/s) {result['statuses']}; CPU ms/task: server "
                f"{result['server_cpu_ms_per_task']:.2f}, worker {result['worker_cpu_ms_per_task']:.2f}"
            )
            runs.append(result)
    medians = {k: median([r["seconds"] for r in runs if r["kind"] == k]) for k in kinds}
    return {
        "tasks": tasks,
        "concurrency": concurrency,
        "rounds": rounds,
        "command": ["true"],
        "runs": runs,
        "median_seconds": medians,
        "median_tasks_per_second": {k: (tasks / v if v else None) for k, v in medians.items()},
        "ratios": {
            "conductor_run_over_floor": ratio(medians.get("conductor-run"), medians.get("floor")),
            "sdk_over_conductor_run": ratio(medians.get("sdk"), medians.get("conductor-run")),
        },
    }
