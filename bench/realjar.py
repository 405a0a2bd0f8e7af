"""Heartbeat precision on the real Conductor server (the jar tests/realserver.py starts).

The same measure as :mod:`bench.heartbeat` (L leases in flight, ``responseTimeoutSeconds`` = R, each
child a ``sleep`` of 2.6 x R), for the SDK and conductor-run, against Conductor OSS itself. The real
server records no lease times, so the workers talk through :class:`bench.relay.RecordingRelay`, and
the gaps are between the answers the relay saw (claim, then each accepted ``extendLease``, up to the
first final update). Two columns say what "lost" means here:

- **over R**: gaps longer than R: a lease a prompt timeout check (the embedded server's) takes back;
- **TIMED_OUT**: what the real server did. Its timeout checks run from its sweeper, seconds to a
  minute late on SQLite (CONDUCTOR_PROTOCOL.md §4), so a late heartbeat or final update often lands
  before it looks: the lapse goes unpunished. After every task settled, each workflow is decided once
  (``PUT /api/workflow/decide``) so the statuses are the server's final word.

Needs Java 21+ and the cached jar (``python -m tests.realserver fetch``); when they cannot be had the
section fails with that message, and the other sections still report.
"""

from __future__ import annotations

import collections
import contextlib
import time
from pathlib import Path
from typing import Any

from bench.harness import WorkerConfig, running_worker, wait_until
from bench.relay import RecordingRelay
from bench.stats import confirmation_gaps, summary
from leasecore.conductor.client import ConductorAdmin, ConductorClient

HOLD_FACTOR = 2.6
TERMINAL = {"COMPLETED", "FAILED", "FAILED_WITH_TERMINAL_ERROR", "TIMED_OUT", "CANCELED", "SKIPPED"}


def _define(admin: ConductorAdmin, task_type: str, r_seconds: int) -> None:
    admin.register_task_defs([{
        "name": task_type, "retryCount": 0, "retryDelaySeconds": 0, "responseTimeoutSeconds": r_seconds,
        "timeoutSeconds": 0, "timeoutPolicy": "TIME_OUT_WF", "ownerEmail": "bench@example.com",
    }])  # fmt: skip
    admin.register_workflow({
        "name": f"wf_{task_type}", "version": 1, "schemaVersion": 2, "ownerEmail": "bench@example.com",
        "tasks": [{"name": task_type, "taskReferenceName": "t", "type": "SIMPLE"}],
    }, overwrite=True)  # fmt: skip


def one_run(
    admin: ConductorAdmin, relay: RecordingRelay, workdir: Path, kind: str, leases: int, r_seconds: int,
    hold_seconds: float | None = None,
) -> dict[str, Any]:
    task_type = f"hbreal_{kind.replace('-', '_')}_{leases}_{r_seconds}_{int(time.time())}"
    _define(admin, task_type, r_seconds)
    workflows = [admin.start_workflow(f"wf_{task_type}", {"i": i}) for i in range(leases)]
    task_of: dict[str, str] = {}
    for wf in workflows:
        for t in admin.get_workflow(wf).get("tasks", []):
            task_of[wf] = str(t["taskId"])
    hold = HOLD_FACTOR * r_seconds if hold_seconds is None else hold_seconds
    cfg = WorkerConfig(kind=kind, url=relay.url, task_type=task_type, concurrency=leases,
                       command=["sleep", f"{hold:g}"], state_dir=workdir / f"state-{task_type}")  # fmt: skip

    def statuses() -> dict[str, str]:
        out = {}
        for wf, task_id in task_of.items():
            tasks = admin.get_workflow(wf).get("tasks", [])
            out[task_id] = str(tasks[0].get("status")) if tasks else "NONE"
        return out

    def settled() -> bool:
        with relay.lock:
            reported = {t for t, finals in relay.finals.items() if any(s != "IN_PROGRESS" for _, s in finals)}
        pending = [t for t in task_of.values() if t not in reported]
        if not pending:
            return True
        now = statuses()
        return all(now[t] in TERMINAL for t in pending)

    with running_worker(cfg, workdir / f"{task_type}.log") as worker:
        def done() -> bool:
            if not worker.alive():
                raise RuntimeError(f"the {kind} worker exited early:\n{worker.log_tail()}")
            return settled()

        wait_until(done, hold + 180, 1.0, what=f"{leases} {kind} tasks to settle on the real server")
    for wf in workflows:  # the server's final word on each lease: run its timeout checks now
        with contextlib.suppress(Exception):
            admin.decide(wf)
    final = statuses()
    gaps: list[float] = []
    with relay.lock:
        for task_id in task_of.values():
            finals = [at for at, s in relay.finals.get(task_id, []) if s != "IN_PROGRESS"]
            gaps += confirmation_gaps(relay.claims.get(task_id, []), relay.leases.get(task_id, []),
                                      min(finals) if finals else None)  # fmt: skip
    counted = collections.Counter(final.values())
    return {
        "kind": kind,
        "leases": leases,
        "r_seconds": r_seconds,
        "hold_seconds": hold,
        "gaps_seconds": summary(gaps),
        "gaps_over_r": sum(1 for g in gaps if g > r_seconds),
        "target_p99_seconds": 0.8 * r_seconds + 0.05,
        "lost": counted.get("TIMED_OUT", 0),
        "statuses": dict(counted),
    }


def run(workdir: Path, kinds: list[str], *, configs: list[tuple[int, int]], log: Any) -> dict[str, Any]:
    from tests.realserver import CONDUCTOR_VERSION, RealConductorServer, ensure_jar, find_java

    server = RealConductorServer(ensure_jar(), find_java())
    started = time.monotonic()
    server.start()
    log(f"real Conductor {CONDUCTOR_VERSION} up in {time.monotonic() - started:.0f} s at {server.url}")
    relay = RecordingRelay(server.base_url)
    client = ConductorClient(server.url, timeout_seconds=30.0)
    runs: list[dict[str, Any]] = []
    try:
        admin = ConductorAdmin(client)
        # Warm-up, not measured: a JVM answers its first calls of each kind slowly (JIT, pools). In a
        # cold start 3-4 of conductor-run's 40 first heartbeats at R = 2 s took over the 1.25 s they
        # had, and the runner fenced those tasks (reported FAILED): the server's start-up, not a
        # steady state. One batch of each worker kind, with heartbeats, goes through the relay first.
        for kind in kinds:
            one_run(admin, relay, workdir, kind, 40, 10, hold_seconds=9.0)
        log("real server warmed up (one unmeasured batch per worker)")
        for leases, r_seconds in configs:
            for kind in kinds:
                result = one_run(admin, relay, workdir, kind, leases, r_seconds)
                g = result["gaps_seconds"]
                log(f"heartbeat (real server) {kind} L={leases} R={r_seconds}s: p50 {g['p50']} "
                    f"p99 {g['p99']} max {g['max']} over R {result['gaps_over_r']} "
                    f"statuses {result['statuses']}")  # fmt: skip
                runs.append(result)
    finally:
        client.close()
        relay.close()
        server.stop()
    return {"server": f"Conductor OSS {CONDUCTOR_VERSION} (boot jar, SQLite)", "hold_factor": HOLD_FACTOR,
            "runs": runs}  # fmt: skip
