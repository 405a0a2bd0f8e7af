"""Scale: many leases on one runner (R = 60 s by default, children that sleep), in growing counts.

For each count L (ascending), L one-task workflows with ``responseTimeoutSeconds`` = R are queued and
one conductor-run runs them all at once, each child a ``sleep`` of ``hold`` seconds, long enough for
every task to need two or more heartbeats. A task type's concurrency is at most 1000 (the
``concurrency`` key's bound), so L is spread over ceil(L / 1000) task types of one runner, given by a
config file of as many ``[[task]]`` tables (the runner shares its ownership-check budget, its fork
server and its threads among them). Measured per count:

- the time to claim and start all L (first to last claim, on the server's clock);
- heartbeat gaps (claim, then each accepted extendLease, up to the final update; as the heartbeat
  section counts them): p50, p99, max, and lost = tasks the server set TIMED_OUT (every child
  outlives R, so the runner was still running it);
- the runner's and its fork server's RSS (max, sampled every second), and per lease;
- their CPU during a window in which all L leases are held and no child has ended yet (the steady
  state: heartbeats, checks, timers), as ms of CPU per lease per minute and as a share of one core;
- the server's count of the runner's requests in that window, per task and hour, by kind.

A runner whose open-file limit cannot hold L trees says so at start and holds what fits (two fds a
tree: ``leasecore.runner.fdbudget``); the run then reads that cap from its log (``held_cap``), waits for
that many claims rather than L, gives its per-lease figures per lease held at once, and the report says
how many were claimed later, as slots freed.

The counts run one after the other, each only while the time left in ``budget_seconds`` can hold it
(a count that would not fit is skipped and said so): the section is bounded in time. The per-lease
figures between two counts (the slope) say how the cost grows; the note says where it stops.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import re
import time
from pathlib import Path
from typing import Any

import psutil

from bench.harness import BenchServer, WorkerConfig, running_worker, wait_until
from bench.measure import cpu_seconds, worker_processes
from bench.serverload import KINDS
from bench.stats import confirmation_gaps, summary


def _rss_mb(procs: list[psutil.Process]) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, p in enumerate(procs):
        with contextlib.suppress(psutil.Error):
            out["runner" if i == 0 else "forkserver"] = out.get("runner" if i == 0 else "forkserver", 0.0) + (
                p.memory_info().rss / 1e6
            )
    return out


MAX_PER_TYPE = 1000  # the concurrency key's bound (leasecore/config/keys.py)


_CAP = re.compile(r"open-file limit \(RLIMIT_NOFILE\) is (\d+): .*?; running at most (\d+) at once")


def held_cap(log_path: Path) -> int | None:
    """The most trees the runner said its fd limit lets it hold at once (its start-up warning), or
    None when it said nothing (every slot fits). Read once the runner is serving."""
    def serving() -> bool:
        return "serving " in log_path.read_text(errors="replace")

    wait_until(serving, 60, 0.2, what="the runner to serve")
    match = _CAP.search(log_path.read_text(errors="replace"))
    return int(match.group(2)) if match else None


def _requests(srv: BenchServer, types: list[str]) -> dict[str, int]:
    """The server's counts of the runner's requests, by kind, summed over its task types."""
    counts = srv.requests()
    return {k: sum(counts.get(t, {}).get(k, 0) for t in types) for k in KINDS}


def one_run(srv: BenchServer, workdir: Path, leases: int, r_seconds: int, hold_seconds: float,
            log: Any) -> dict[str, Any]:  # fmt: skip
    task_type = f"scale_{leases}_{r_seconds}"
    n_types = -(-leases // MAX_PER_TYPE)
    sizes = [leases // n_types + (1 if i < leases % n_types else 0) for i in range(n_types)]
    types = [f"{task_type}_{i}" for i in range(n_types)]
    t_queue = time.monotonic()
    task_ids: list[str] = []
    config = []
    for name, size in zip(types, sizes, strict=True):
        srv.define(name, response_timeout_seconds=r_seconds)
        task_ids += srv.task_ids(srv.start(name, size))
        config += ["[[task]]", f'type = "{name}"', f'command = ["sleep", "{hold_seconds:g}"]',
                   f"concurrency = {size}", ""]  # fmt: skip
    queued_seconds = time.monotonic() - t_queue
    config_file = workdir / f"{task_type}.toml"
    config_file.write_text("\n".join(config))
    cfg = WorkerConfig(kind="conductor-run", url=srv.url, task_type=task_type, concurrency=leases,
                       command=[], state_dir=workdir / f"state-{task_type}", config_file=config_file)
    rss_max: dict[str, float] = collections.defaultdict(float)
    window: dict[str, Any] = {}
    fds_max: dict[str, int] = collections.defaultdict(int)
    with running_worker(cfg, workdir / f"{task_type}.log") as worker:
        started = time.monotonic()

        def sample() -> list[psutil.Process]:
            if not worker.alive():
                raise RuntimeError(f"the runner exited:\n{worker.log_tail()}")
            procs = worker_processes(worker.pid)
            for k, v in _rss_mb(procs).items():
                rss_max[k] = max(rss_max[k], v)
            for i, proc in enumerate(procs[:2]):  # open fds: what bounds the count per process
                with contextlib.suppress(psutil.Error):
                    key = "runner" if i == 0 else "forkserver"
                    fds_max[key] = max(fds_max[key], proc.num_fds())
            return procs

        # A runner whose fd limit cannot hold L trees says so at start and holds what fits (fdbudget):
        # then "all held" is that many, and the rest are claimed as the first children end.
        cap = held_cap(worker.log_path)
        held = min(leases, cap) if cap is not None else leases

        def all_claimed() -> bool:
            sample()
            claims = srv.marks(task_ids)["claims"]
            return sum(1 for t in task_ids if claims[t]) >= held

        wait_until(all_claimed, 120 + leases * 0.05, 2.0, what=f"{held} tasks to be claimed")
        claimed_at = time.monotonic()
        # The window: every lease held, no child ended yet (the first ends ~hold after the first claim).
        window_end = started + hold_seconds - 5.0
        if window_end - claimed_at >= 20.0:
            time.sleep(2.0)  # the last spawns' answers settle (a measurement window follows, not a wait)
            procs = sample()
            cpu0, req0, t0 = cpu_seconds(procs), _requests(srv, types), time.monotonic()
            while time.monotonic() < window_end:
                procs = sample()
                time.sleep(1.0)
            cpu1, req1, t1 = cpu_seconds(procs), _requests(srv, types), time.monotonic()
            seconds = t1 - t0
            window = {
                "seconds": seconds,
                "cpu_seconds": cpu1 - cpu0,
                "cpu_ms_per_lease_per_minute": 1000 * (cpu1 - cpu0) / held / seconds * 60,
                "cores_busy": (cpu1 - cpu0) / seconds,
                "requests_per_task_per_hour": {
                    k: (req1.get(k, 0) - req0.get(k, 0)) * 3600.0 / (held * seconds) for k in KINDS
                },
                "requests_per_second": sum(req1.get(k, 0) - req0.get(k, 0) for k in KINDS) / seconds,
            }
        srv.wait_settled(task_ids, timeout_seconds=hold_seconds + 180 + leases * 0.05, worker=worker,
                         interval_seconds=2.0)  # fmt: skip
    marks = srv.marks(task_ids)
    gaps: list[float] = []
    for t in task_ids:
        if marks["statuses"][t] == "TIMED_OUT" and marks["ends"][t] is not None:
            end = marks["ends"][t]
            gaps += confirmation_gaps([*marks["claims"][t], end], marks["leases"][t], end)
        else:
            finals = [when for when, status, _via in marks["updates"][t] if status != "IN_PROGRESS"]
            gaps += confirmation_gaps(marks["claims"][t], marks["leases"][t], min(finals) if finals else None)
    claims = sorted(min(c) for c in marks["claims"].values() if c)[:held]  # those held at once
    statuses = collections.Counter(str(s) for s in marks["statuses"].values())
    rss_total = sum(rss_max.values())
    result = {
        "leases": leases,
        "task_types": n_types,
        "r_seconds": r_seconds,
        "hold_seconds": hold_seconds,
        "queue_seconds": queued_seconds,
        "claim_spread_seconds": (max(claims) - min(claims)) if claims else None,
        "gaps_seconds": summary(gaps),
        "target_p99_seconds": 0.8 * r_seconds + 0.05,
        "lost": statuses.get("TIMED_OUT", 0),
        "statuses": dict(statuses),
        "rss_max_mb": dict(rss_max),
        "rss_max_total_mb": rss_total,
        "rss_kb_per_lease": 1000 * rss_total / held,  # per lease held at once
        "open_fds_max": dict(fds_max),
        "held_cap": cap,  # the runner's cut for its fd limit (None: all L fit at once)
        "window": window or None,  # None: the claims took too long for a window before the first exit
    }
    g = result["gaps_seconds"]
    log(f"scale L={leases} R={r_seconds}s: claims over {result['claim_spread_seconds']:.1f} s, gaps p50 "
        f"{g['p50']} p99 {g['p99']} max {g['max']}, lost {result['lost']} {result['statuses']}; RSS "
        f"{rss_total:.0f} MB; window {window.get('cpu_ms_per_lease_per_minute', 'n/a')} CPU ms/lease/min")
    return result


def run(srv: BenchServer, workdir: Path, *, counts: list[int], r_seconds: int, hold_seconds: float,
        budget_seconds: float, log: Any) -> dict[str, Any]:  # fmt: skip
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    skipped: list[int] = []
    failed: list[dict[str, Any]] = []
    for leases in sorted(counts):
        # a run's time: queueing and claiming (~10 ms a task here, measured), the hold, the reports
        needed = hold_seconds + 30 + leases * 0.015
        if time.monotonic() - started + needed > budget_seconds:
            log(f"scale L={leases}: skipped, it would not fit in the {budget_seconds:.0f} s budget")
            skipped.append(leases)
            continue
        try:
            runs.append(one_run(srv, workdir, leases, r_seconds, hold_seconds, log))
        except Exception as exc:  # where it stops: said in the report, the smaller counts kept
            log(f"scale L={leases}: failed: {exc}")
            failed.append({"leases": leases, "error": f"{type(exc).__name__}: {exc}"[:2000]})
            break
    slopes = []
    for a, b in itertools.pairwise(runs):
        dl = b["leases"] - a["leases"]
        slopes.append({
            "from": a["leases"], "to": b["leases"],
            "rss_kb_per_added_lease": 1000 * (b["rss_max_total_mb"] - a["rss_max_total_mb"]) / dl,
        })  # fmt: skip
    return {"r_seconds": r_seconds, "hold_seconds": hold_seconds, "budget_seconds": budget_seconds,
            "runs": runs, "skipped": skipped, "failed": failed, "slopes": slopes}  # fmt: skip
