"""Throughput: N trivial tasks (``true``) at concurrency C, for each worker, in alternating rounds.

Time of a run = the server's clock from the first claim of a task to the last final update: worker
start-up (imports, the SDK's process spawning) is outside it, the same for every worker. The tasks
are queued before the worker starts. Rounds rotate the order of the workers so that a slow spell of
the (shared) machine does not land on one worker only; the report gives medians over the rounds.

``sdk-v1`` is the SDK worker unchanged, with the server refusing update-v2 (404) for that run's task
type: it falls back to v1 and polls for each task, as conductor-run and the floor do. The SDK switches
on the first 404 it sees, but its other update-v2 calls already in flight then count as failures and
are retried 10 s later; so an sdk-v1 run first lets it switch on one warm-up task (not measured), then
queues the measured tasks while the server holds polls for the type, and releases them: to the worker
the tasks were queued before it polled, as in the other runs. conductor-run, like the SDK, chains
through update-v2 (each final update claims the next task into its slot). Each run records
through which endpoint its final updates landed (``updates_via``); an sdk-v1 run with any v2
update, or an sdk or conductor-run run with none, fails: its figure would not be what it is labelled.
"""

from __future__ import annotations

import collections
import re
import urllib.request
from pathlib import Path
from typing import Any

from bench import metrics_ab
from bench.harness import (
    FLOOR_V2_KIND,
    METRICS_KIND,
    PRICE_KINDS,
    V1_KIND,
    BenchServer,
    WorkerConfig,
    running_worker,
)
from bench.measure import CpuSampler, cpu_seconds, worker_processes
from bench.stats import median, ratio


def one_run(
    srv: BenchServer, workdir: Path, kind: str, round_no: int, tasks: int, concurrency: int
) -> dict[str, Any]:
    task_type = f"tp_{kind.replace('-', '_')}_{round_no}"
    srv.define(task_type)
    sdk_v1 = kind == "sdk-v1"
    warmup_ids: list[str] = []
    task_ids: list[str] = []
    if sdk_v1:
        srv.refuse_update_v2(task_type)
        warmup_ids = srv.task_ids(srv.start(task_type, 1))
    else:
        if kind == V1_KIND:  # its first final update is refused, retried through v1 at once: no warm-up
            srv.refuse_update_v2(task_type)
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
    start_cpu: float | None = None
    log_path = workdir / f"{task_type}.log"
    with running_worker(cfg, log_path) as worker, CpuSampler(srv.pid, worker.pid) as sampler:
        if kind in (METRICS_KIND, "conductor-run", *PRICE_KINDS):  # the start-up's CPU, apart from the run's
            start_cpu = metrics_ab.cpu_at_serving(worker.pid, worker.log_path)
        if sdk_v1:
            srv.wait_settled(warmup_ids, timeout_seconds=60, worker=worker)
            srv.hold_polls(task_type)
            try:
                task_ids = srv.task_ids(srv.start(task_type, tasks))
                server_cpu0 = cpu_seconds(worker_processes(srv.pid))
            finally:
                srv.release_polls(task_type)
        srv.wait_settled(task_ids, timeout_seconds=60 + tasks * 0.2, worker=worker)
        procs = worker_processes(worker.pid)
        worker_cpu, task_cpu = cpu_seconds(procs), cpu_seconds(procs, children=True)
        # conductor-run's own split: the runner (the root) and the fork server (its Python child)
        runner_cpu = cpu_seconds([p for p in procs if p.pid == worker.pid])
        if kind == METRICS_KIND:
            _check_counted(worker.log_path.read_text(errors="replace"), task_type, tasks)
    server_cpu = cpu_seconds(worker_processes(srv.pid)) - server_cpu0
    marks = srv.marks(task_ids)
    first_claim = min(min(c) for c in marks["claims"].values() if c)
    finals = [(when, via) for u in marks["updates"].values() for when, s, via in u if s != "IN_PROGRESS"]
    last_report = max(when for when, _ in finals)
    seconds = last_report - first_claim
    statuses = collections.Counter(str(s) for s in marks["statuses"].values())
    if statuses.get("COMPLETED", 0) != tasks:  # every `true` completes: else the run timed something else
        raise RuntimeError(f"{kind} run {round_no}: not every task COMPLETED: {dict(statuses)}")
    via = collections.Counter(v for _, v in finals)
    if kind in ("sdk-v1", V1_KIND) and via.get("v2"):
        raise RuntimeError(f"{kind} run {round_no}: {via['v2']} final updates still landed through update-v2")
    if kind in ("sdk", "conductor-run", METRICS_KIND, FLOOR_V2_KIND, *PRICE_KINDS) and not via.get("v2"):
        # They chain through update-v2: a run without it is not what the targets compare.
        raise RuntimeError(f"{kind} run {round_no}: no final update came through update-v2 ({dict(via)})")
    return {
        "kind": kind,
        "round": round_no,
        "seconds": seconds,
        "tasks_per_second": tasks / seconds,
        "statuses": dict(statuses),
        "updates_via": dict(via),  # final updates per endpoint: "v1" POST /api/tasks, "v2" update-v2
        # update-v2 calls answered 404: sdk-v1's switch to v1, on its warm-up task (1 expected)
        "v2_refused": sum(marks["refused"].values()) + sum(srv.marks(warmup_ids)["refused"].values()),
        # Diagnostics: where the CPU went. The worker's figure includes its start-up.
        "server_cpu_ms_per_task": 1000 * server_cpu / tasks,
        "worker_cpu_ms_per_task": 1000 * worker_cpu / tasks,
        # of it, the root process's (conductor-run: the runner; the rest is its fork server's)
        "root_cpu_ms_per_task": 1000 * runner_cpu / tasks,
        # The `true` commands' own CPU (what the worker's processes reaped), and how many of the
        # machine's cores the server, the worker and the commands kept busy on average from the first
        # claim to the last final update: near the core count, the run is bound by CPU, not by waits.
        "task_cpu_ms_per_task": 1000 * task_cpu / tasks,
        "cores_busy": sampler.cores_busy(first_claim, last_report),
        # The hypervisor's share of the machine's CPU time over the same window (steal): what slows a
        # round on this VM with no process of ours doing more (0 off a VM; None: too few samples).
        "host_steal": sampler.host_steal(first_claim, last_report),
        # conductor-run's CPU until it logs "serving" (imports, setup), and after it (the run)
        "worker_start_cpu_ms": None if start_cpu is None else 1000 * start_cpu,
        "worker_run_cpu_ms_per_task": None if start_cpu is None else 1000 * (worker_cpu - start_cpu) / tasks,
    }


def _check_counted(log: str, task_type: str, tasks: int) -> None:
    """The metrics run really counted: its /metrics says every task was started."""
    found = re.search(r"metrics on (http://127\.0\.0\.1:\d+)/metrics", log)
    if found is None:
        raise RuntimeError(f"{METRICS_KIND}: the runner did not log its metrics endpoint:\n{log}")
    with urllib.request.urlopen(found.group(1) + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    line = f'task_execution_started_total{{taskType="{task_type}"}} {float(tasks)}'
    if line not in text:
        raise RuntimeError(f"{METRICS_KIND}: /metrics does not say {line!r}")


def _percent(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.1f} %"


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
                f"({result['tasks_per_second']:.0f} tasks/s) {result['statuses']}, final updates via "
                f"{result['updates_via']}; CPU ms/task: server {result['server_cpu_ms_per_task']:.2f}, "
                f"worker {result['worker_cpu_ms_per_task']:.2f}; "
                f"host steal {_percent(result.get('host_steal'))}"
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
        # The worker's CPU per task (runner + fork server for conductor-run), median over the rounds.
        "median_worker_cpu_ms_per_task": {
            k: median([r["worker_cpu_ms_per_task"] for r in runs if r["kind"] == k]) for k in kinds
        },
        "ratios": {
            "conductor_run_over_floor": ratio(medians.get("conductor-run"), medians.get("floor")),
            "sdk_over_conductor_run": ratio(medians.get("sdk"), medians.get("conductor-run")),
            # Diagnostic: the SDK without update-v2's claim-with-the-report, against conductor-run.
            "sdk_v1_over_conductor_run": ratio(medians.get("sdk-v1"), medians.get("conductor-run")),
            # update-v2's chaining A/B: conductor-run on v1 only (update-v2 refused) over conductor-run.
            "v1_over_v2_conductor_run": ratio(medians.get(V1_KIND), medians.get("conductor-run")),
            # The floor chaining through update-v2 against the floor, conductor-run and the SDK:
            # what the throughput targets would ask of a worker that does nothing but chain.
            "floor_v2_over_floor": ratio(medians.get(FLOOR_V2_KIND), medians.get("floor")),
            "conductor_run_over_floor_v2": ratio(medians.get("conductor-run"), medians.get(FLOOR_V2_KIND)),
            "sdk_over_floor_v2": ratio(medians.get("sdk"), medians.get(FLOOR_V2_KIND)),
            # The run time with the metrics endpoint on over off (target <= 1.03), and the same
            # ratio within each round (the machine is shared: the spread says how much is noise).
            "metrics_on_over_off": ratio(medians.get(METRICS_KIND), medians.get("conductor-run")),
            "metrics_on_over_off_per_round": _per_round(runs, METRICS_KIND, "conductor-run"),
        },
        # Metrics: time and worker CPU (with and without the start-up), on / off, per round too
        "metrics_ab": metrics_ab.ratios(runs) if METRICS_KIND in kinds and "conductor-run" in kinds else None,
    }


def _per_round(runs: list[dict[str, Any]], kind: str, base: str) -> list[float | None]:
    by_round: dict[int, dict[str, float]] = collections.defaultdict(dict)
    for r in runs:
        by_round[r["round"]][r["kind"]] = r["seconds"]
    return [ratio(times.get(kind), times.get(base)) for _, times in sorted(by_round.items())
            if kind in times and base in times]
