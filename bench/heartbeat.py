"""Heartbeat precision: gaps between consecutive lease confirmations with L leases in flight.

L workflows of a task type with ``responseTimeoutSeconds`` = R are queued; the worker runs them at
concurrency L, each child a ``sleep`` of ``hold`` x R, so every lease needs several heartbeats. The
server records each confirmation (the claim by poll, then every accepted ``extendLease``); a gap is the
time between two consecutive confirmations of one task, up to its final update (for a task the server
timed out, the last gap runs to the timeout and counts too). The server's timeout
checks are exact (embedded server, "ideal" sweep), so a gap beyond R is a lease the server takes back:
"lost" = tasks the server set TIMED_OUT while the worker still ran them (all children outlive R).

Every task that ends FAILED (or FAILED_WITH_TERMINAL_ERROR) is kept on record: its
``reasonForIncompletion`` as the server holds it, and the worker's log lines that name it (its start,
fences, result), bounded (``MAX_FAILED_KEPT`` tasks, ``MAX_LINES_PER_TASK`` lines each); the run counts
them by reason (``failed_by_reason``), so a FAILED in a heartbeat run says why without a rerun.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from bench.harness import BenchServer, WorkerConfig, running_worker
from bench.stats import confirmation_gaps, summary

HOLD_FACTOR = 2.6  # children live 2.6 x R: three heartbeats each at 0.8 x R
MAX_FAILED_KEPT = 50  # FAILED tasks whose reason and log lines a run keeps (all are counted by reason)
MAX_LINES_PER_TASK = 20
_FAILED = frozenset({"FAILED", "FAILED_WITH_TERMINAL_ERROR"})


def failed_records(srv: BenchServer, statuses: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """The FAILED tasks of a run: counted by the server's reasonForIncompletion, and the first
    ``MAX_FAILED_KEPT`` of them kept with their reason and the worker's log lines naming them."""
    failed = sorted(t for t, status in statuses.items() if str(status) in _FAILED)
    reasons: dict[str, str] = {}
    for task_id in failed:
        try:
            task = srv.client.get_task(task_id)
            reasons[task_id] = str(task.get("reasonForIncompletion") or "(no reason given)")
        except Exception as exc:  # a record, not the run: say why it is missing
            reasons[task_id] = f"(could not read the task: {type(exc).__name__}: {exc})"
    kept = failed[:MAX_FAILED_KEPT]
    lines: dict[str, list[str]] = {t: [] for t in kept}
    if kept and log_path.exists():
        with log_path.open(errors="replace") as log:
            for line in log:
                for task_id in kept:
                    if task_id in line and len(lines[task_id]) < MAX_LINES_PER_TASK:
                        lines[task_id].append(line.rstrip("\n")[:1000])
    by_reason = collections.Counter(reasons.values())
    return {
        "failed_by_reason": dict(by_reason.most_common()),
        "failed_tasks": [
            {"task_id": t, "status": str(statuses[t]), "reason": reasons[t], "log": lines[t]} for t in kept
        ],
        "worker_log": str(log_path),
    }


def one_run(srv: BenchServer, workdir: Path, kind: str, leases: int, r_seconds: int) -> dict[str, Any]:
    task_type = f"hb_{kind.replace('-', '_')}_{leases}_{r_seconds}"
    srv.define(task_type, response_timeout_seconds=r_seconds)
    task_ids = srv.task_ids(srv.start(task_type, leases))
    hold = HOLD_FACTOR * r_seconds
    cfg = WorkerConfig(
        kind=kind,
        url=srv.url,
        task_type=task_type,
        concurrency=leases,
        command=["sleep", f"{hold:g}"],
        state_dir=workdir / "state",
    )
    log_path = workdir / f"{task_type}.log"
    with running_worker(cfg, log_path) as worker:
        # conductor-run reports nothing for a task the server took back: settled = reported or ended.
        srv.wait_settled(
            task_ids, timeout_seconds=hold + 120 + leases * 0.1, worker=worker, interval_seconds=1.0
        )
    marks = srv.marks(task_ids)
    target = 0.8 * r_seconds + 0.05
    gaps: list[float] = []
    late_by_ordinal: collections.Counter[int] = collections.Counter()  # which gap of a task was late
    for t in task_ids:
        before = len(gaps)
        if marks["statuses"][t] == "TIMED_OUT" and marks["ends"][t] is not None:
            # Taken back by the server: the last gap is open until the timeout, and it counts.
            end = marks["ends"][t]
            gaps += confirmation_gaps([*marks["claims"][t], end], marks["leases"][t], end)
        else:
            finals = [when for when, status, _via in marks["updates"][t] if status != "IN_PROGRESS"]
            gaps += confirmation_gaps(marks["claims"][t], marks["leases"][t], min(finals) if finals else None)
        late_by_ordinal.update(i + 1 for i, gap in enumerate(gaps[before:]) if gap > target)
    claims = [min(c) for c in marks["claims"].values() if c]
    statuses = collections.Counter(str(s) for s in marks["statuses"].values())
    return {
        "kind": kind,
        "leases": leases,
        "r_seconds": r_seconds,
        "hold_seconds": hold,
        "gaps_seconds": summary(gaps),
        "gaps_over_target": sum(1 for g in gaps if g > target),
        # Diagnostic: of the late gaps, how many were a task's 1st (claim -> first beat), 2nd, ...
        "gaps_over_target_by_ordinal": {str(k): v for k, v in sorted(late_by_ordinal.items())},
        "target_p99_seconds": target,
        "lost": statuses.get("TIMED_OUT", 0),
        "statuses": dict(statuses),
        "claim_spread_seconds": (max(claims) - min(claims)) if claims else None,
        **failed_records(srv, marks["statuses"], log_path),
    }


def run(
    srv: BenchServer, workdir: Path, kinds: list[str], *, configs: list[tuple[int, int]], log: Any
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for leases, r_seconds in configs:
        for kind in kinds:
            result = one_run(srv, workdir, kind, leases, r_seconds)
            g = result["gaps_seconds"]
            log(
                f"heartbeat {kind} L={leases} R={r_seconds}s: p50 {g['p50']} p99 {g['p99']} "
                f"max {g['max']} lost {result['lost']} {result['statuses']}"
            )
            for reason, count in result["failed_by_reason"].items():
                log(f"heartbeat {kind} L={leases} R={r_seconds}s: FAILED {count}: {reason}")
            for record in result["failed_tasks"][:3]:  # the first few in full in the output; all in the JSON
                log(f"  {record['task_id']} ({record['reason']}):\n    " + "\n    ".join(record["log"]))
            runs.append(result)
    return {"hold_factor": HOLD_FACTOR, "runs": runs}
