"""Kill latency and shutdown latency of conductor-run (the SDK and the floor never kill a tree).

The child is ``children/tree.sh``: a shell, a grandchild in its group and an escapee in its own session,
optionally all ignoring SIGTERM. "Gone" = the last of the three exited (pidfd wake-up time).

- lease deadline: once every task's heartbeat has been confirmed, the server process is SIGSTOPped
  (silenced, not closed). The deadline that matters is the server's: its record of the task's last
  heartbeat + R, when it may time the task out and hand it to someone else (the worker's own deadline
  counts from the beat's send time, a little earlier). Reported: how long BEFORE that deadline the
  tree was gone (the last of its processes exited), for one tree and for many at once; the worst tree
  counts. Target: before it (> 0), whatever the tree does with SIGTERM.
- termination: the workflow is terminated through the API; the runner sees it at its next ownership
  check (every ``ownership_check_interval``, 5 s by default) and kills the tree at once.
- shutdown: SIGTERM to the runner with K tasks running: time until the trees are gone and until the
  runner has exited (children TERMed, KILLed after the grace, each task reported FAILED).
- groups vs none (section ``kill-groups``): the shutdown measure with 200 trees, once with a cgroup per
  tree (``--cgroup auto``: the KILL is cgroup.kill, or freeze + KILL + thaw on v1) and once without
  (``--cgroup off``: /proc tracking), alternately, for both tree kinds. With ``ignore-term`` the trees
  live until the KILL, so ``trees gone - kill_grace`` is the KILL's own latency; ``obeys-term`` is the
  TERM path. The mechanism the runner chose is taken from its log ("task trees: ...").
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import CHILDREN, BenchServer, WorkerConfig, WorkerProcess, wait_until
from bench.measure import ExitWatch

HEARTBEAT_TIMEOUT_SECONDS = 4  # R of the kill tasks; heartbeats every 0.8 x (R - kill_grace - margin)


def _start(
    srv: BenchServer, workdir: Path, name: str, mode: str, count: int, kill_grace: float,
    cgroup: str | None = None,
) -> tuple[WorkerProcess, list[str], list[str], Path]:
    srv.define(name, response_timeout_seconds=HEARTBEAT_TIMEOUT_SECONDS)
    pids_dir = workdir / f"pids_{name}"
    pids_dir.mkdir()
    wf_ids = srv.start(name, count)
    task_ids = srv.task_ids(wf_ids)
    cfg = WorkerConfig(
        kind="conductor-run",
        url=srv.url,
        task_type=name,
        concurrency=count,
        command=[str(CHILDREN / "tree.sh"), mode, str(pids_dir)],
        state_dir=workdir / "state",
        kill_grace_seconds=kill_grace,
        cgroup=cgroup,
    )
    worker = WorkerProcess(cfg, workdir / f"{name}.log")
    return worker, wf_ids, task_ids, pids_dir


def _trees(pids_dir: Path, task_ids: list[str], worker: WorkerProcess) -> dict[str, list[int]]:
    def written() -> bool:
        if not worker.alive():
            raise RuntimeError(f"conductor-run exited early:\n{worker.log_tail()}")
        return all((pids_dir / t).exists() for t in task_ids)

    wait_until(written, 120, what="the task trees to start")
    return {t: [int(p) for p in (pids_dir / t).read_text().split()] for t in task_ids}


def _tree_pids(pids_dir: Path, task_ids: list[str], worker: WorkerProcess) -> list[int]:
    return [p for pids in _trees(pids_dir, task_ids, worker).values() for p in pids]


def lease_deadline(
    srv: BenchServer, workdir: Path, mode: str, kill_grace: float, trial: int, trees: int = 1
) -> dict[str, Any]:
    worker, _, task_ids, pids_dir = _start(
        srv, workdir, f"kl_{mode.replace('-', '_')}_{trees}_{trial}", mode, trees, kill_grace
    )
    try:
        pids = _trees(pids_dir, task_ids, worker)
        watch = ExitWatch([p for tree in pids.values() for p in tree])

        def every_lease_confirmed() -> bool:
            # Silence the server once every task has a confirmed heartbeat (a beat in flight then is
            # simply never answered; the server's record of it, if it made one, counts).
            leases = srv.marks(task_ids)["leases"]
            return all(leases[t] for t in task_ids)

        wait_until(every_lease_confirmed, 60, 0.05, what="a confirmed heartbeat per task")
        srv.pause()
        try:
            gone = watch.wait(HEARTBEAT_TIMEOUT_SECONDS + kill_grace + 30)
        finally:
            resumed_at = time.monotonic()
            srv.resume()
        # Only what the server recorded before it was silenced: a beat still in its socket buffer is
        # recorded after the resume, long after any of this. (Not "before the pause call": a beat
        # answered while the SIGSTOP was on its way counts, the worker got its ack.)
        leases = srv.marks(task_ids)["leases"]
        last = {t: max(m for m in leases[t] if m < resumed_at) for t in task_ids}
        leads = []
        for t, tree in pids.items():
            ends = [watch.exited_at.get(p) for p in tree]
            if gone is None or any(e is None for e in ends):
                leads.append(None)
                continue
            leads.append(last[t] + HEARTBEAT_TIMEOUT_SECONDS - max(e for e in ends if e is not None))
        known = [x for x in leads if x is not None]
        return {
            "mode": mode,
            "trees": trees,
            "kill_grace_seconds": kill_grace,
            # the worst tree: the least time between its tree gone and the server's deadline
            "before_deadline_seconds": min(known) if len(known) == len(leads) else None,
            "before_deadline_median_seconds": sorted(known)[len(known) // 2] if known else None,
            "target_seconds": 0.0,
        }
    finally:
        worker.stop()


def termination(srv: BenchServer, workdir: Path, mode: str, kill_grace: float, trial: int) -> dict[str, Any]:
    worker, wf_ids, task_ids, pids_dir = _start(
        srv, workdir, f"kt_{mode.replace('-', '_')}_{trial}", mode, 1, kill_grace
    )
    try:
        watch = ExitWatch(_tree_pids(pids_dir, task_ids, worker))
        sent = time.monotonic()
        srv.admin.terminate_workflow(wf_ids[0], "bench: kill latency")
        gone = watch.wait(30)
        return {"mode": mode, "latency_seconds": None if gone is None else gone - sent}
    finally:
        worker.stop()


def shutdown(
    srv: BenchServer, workdir: Path, mode: str, kill_grace: float, tasks: int, *, cgroup: str | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    worker, _, task_ids, pids_dir = _start(
        srv, workdir, name or f"ks_{mode.replace('-', '_')}_{tasks}", mode, tasks, kill_grace, cgroup
    )
    try:
        watch = ExitWatch(_tree_pids(pids_dir, task_ids, worker))
        gone: list[float | None] = []
        watcher = threading.Thread(target=lambda: gone.append(watch.wait(kill_grace + 60)))
        watcher.start()
        exited = worker.stop(timeout_seconds=kill_grace + 60)
        watcher.join()
        marks = srv.marks(task_ids)
        reported = sum(1 for u in marks["updates"].values() if any(s == "FAILED" for _when, s, _via in u))
        trees = gone[0] - worker.stop_sent_at if gone[0] is not None and worker.stop_sent_at else None
        log_text = worker.log_path.read_text(errors="replace")  # the worker has stopped: its log is whole
        mechanism = next((line.split("task trees: ", 1)[1] for line in log_text.splitlines()
                          if "task trees: " in line), None)  # fmt: skip
        return {
            "mode": mode,
            "cgroup": cgroup,
            "mechanism": mechanism,
            "tasks": tasks,
            "kill_grace_seconds": kill_grace,
            "exit_seconds": exited,
            "trees_gone_seconds": trees,
            "reported_failed": reported,
            "target_seconds": kill_grace + 0.2,
        }
    finally:
        worker.stop()


def run(
    srv: BenchServer,
    workdir: Path,
    *,
    kill_grace: float,
    trials: int,
    shutdown_tasks: list[int],
    log: Any,
    deadline_trees: tuple[int, ...] = (1, 200),
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_SECONDS,
        "kill_grace_seconds": kill_grace,
        "lease_deadline": [],
        "termination": [],
        "shutdown": [],
    }
    for trees in deadline_trees:
        for mode in ("obeys-term", "ignore-term"):
            for trial in range(trials):
                r = lease_deadline(srv, workdir, mode, kill_grace, trial, trees)
                log(f"tree gone before the lease deadline ({mode}, {trees} trees): worst "
                    f"{r['before_deadline_seconds']} s, median {r['before_deadline_median_seconds']} s")
                out["lease_deadline"].append(r)
    for trial in range(trials):
        r = termination(srv, workdir, "ignore-term", kill_grace, trial)
        log(f"kill after workflow termination: {r['latency_seconds']}")
        out["termination"].append(r)
    for tasks in shutdown_tasks:
        for mode in ("obeys-term", "ignore-term"):
            r = shutdown(srv, workdir, mode, kill_grace, tasks)
            log(
                f"shutdown ({mode}, {tasks} tasks): trees gone {r['trees_gone_seconds']} s, "
                f"exit {r['exit_seconds']} s, reported FAILED {r['reported_failed']}"
            )
            out["shutdown"].append(r)
    return out


def groups_vs_none(
    srv: BenchServer, workdir: Path, *, kill_grace: float, tasks: int, trials: int, log: Any
) -> dict[str, Any]:
    """SIGTERM -> ``tasks`` trees gone, with a cgroup per tree and without, alternately."""
    out: dict[str, Any] = {"kill_grace_seconds": kill_grace, "tasks": tasks, "runs": []}
    for trial in range(trials):
        for mode in ("ignore-term", "obeys-term"):
            for cgroup in ("auto", "off"):
                name = f"kg_{cgroup}_{mode.replace('-', '_')}_{trial}"
                r = shutdown(srv, workdir, mode, kill_grace, tasks, cgroup=cgroup, name=name)
                log(f"groups vs none ({cgroup}, {mode}, {tasks} trees): gone {r['trees_gone_seconds']} s, "
                    f"exit {r['exit_seconds']} s; {r['mechanism']}")  # fmt: skip
                out["runs"].append(r)
    return out
