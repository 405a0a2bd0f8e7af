"""Kill latency and shutdown latency of conductor-run (the SDK and the floor never kill a tree).

The child is ``children/tree.sh``: a shell, a grandchild in its group and an escapee in its own session,
optionally all ignoring SIGTERM. "Gone" = the last of the three exited (pidfd wake-up time).

- lease deadline: once a heartbeat has been confirmed, the server process is SIGSTOPped (silenced, not
  closed). The worker's deadline is its last acknowledged heartbeat's send time + heartbeat timeout; the
  bench takes the server's record of that heartbeat instead (a little later: the latency is slightly
  overstated, never understated). Target: gone within kill_grace + 200 ms of the deadline.
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

HEARTBEAT_TIMEOUT_SECONDS = 4  # R of the kill tasks; heartbeats every 3.2 s


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


def _tree_pids(pids_dir: Path, task_ids: list[str], worker: WorkerProcess) -> list[int]:
    def written() -> bool:
        if not worker.alive():
            raise RuntimeError(f"conductor-run exited early:\n{worker.log_tail()}")
        return all((pids_dir / t).exists() for t in task_ids)

    wait_until(written, 60, what="the task trees to start")
    return [int(p) for t in task_ids for p in (pids_dir / t).read_text().split()]


def lease_deadline(
    srv: BenchServer, workdir: Path, mode: str, kill_grace: float, trial: int
) -> dict[str, Any]:
    worker, _, task_ids, pids_dir = _start(
        srv, workdir, f"kl_{mode.replace('-', '_')}_{trial}", mode, 1, kill_grace
    )
    try:
        watch = ExitWatch(_tree_pids(pids_dir, task_ids, worker))
        interval = 0.8 * HEARTBEAT_TIMEOUT_SECONDS
        last: float | None = None

        def quiet_after_a_heartbeat() -> bool:
            # Silence the server between heartbeats: never while one may be in flight.
            nonlocal last
            leases = srv.marks(task_ids)["leases"][task_ids[0]]
            if not leases:
                return False
            last = leases[-1]
            return 0.2 <= time.monotonic() - last <= interval - 0.8

        wait_until(quiet_after_a_heartbeat, 30, 0.02, what="a confirmed heartbeat")
        srv.pause()
        try:
            gone = watch.wait(HEARTBEAT_TIMEOUT_SECONDS + kill_grace + 30)
        finally:
            srv.resume()
        assert last is not None
        deadline = last + HEARTBEAT_TIMEOUT_SECONDS
        return {
            "mode": mode,
            "kill_grace_seconds": kill_grace,
            "latency_seconds": None if gone is None else gone - deadline,
            "target_seconds": kill_grace + 0.2,
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
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT_SECONDS,
        "kill_grace_seconds": kill_grace,
        "lease_deadline": [],
        "termination": [],
        "shutdown": [],
    }
    for mode in ("obeys-term", "ignore-term"):
        for trial in range(trials):
            r = lease_deadline(srv, workdir, mode, kill_grace, trial)
            log(f"kill at lease deadline ({mode}): {r['latency_seconds']}")
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
