"""A stalled runner: how late the fork server's dead-man's switch ends the trees (docs/runner-stalls.md).

The child is ``children/tree.sh`` (a shell, a grandchild in its group, a setsid escapee), as in
``kill.py``. "Gone" = the last of the three exited (pidfd wake-up time).

- runner stalled: once every task's heartbeat has been confirmed, the runner's main process is
  SIGSTOPped (its fork server and the trees go on), with ``busy`` CPU spinners beside it (load 10+ on
  this 2-core host). Reported: how long BEFORE the server's deadline (its record of the task's last
  heartbeat + R) the tree was gone, the worst of ``trees``; target: before it (> 0). Run once with the
  fork server's priority boost (root: nice -10) and once without it (``setpriv`` drops CAP_SYS_NICE),
  so the table shows what the boost buys.
- thawed: the residual case of a frozen host. Runner, fork server and every tree SIGSTOPped together
  past the KILL point, then thawed, trees first (the worst order: they run before the fork server
  does). Reported: how long each tree ran after its thaw before it was gone, the worst of ``trees``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from bench.harness import CHILDREN, BenchServer, WorkerConfig, WorkerProcess, wait_until
from bench.measure import ExitWatch

R_SECONDS = 4  # responseTimeoutSeconds: with kill_grace 1 s, TERM at ack + 2.6 s, KILL at ack + 3.6 s
NO_NICE = ("setpriv", "--inh-caps=-sys_nice", "--bounding-set=-sys_nice", "--")  # root minus CAP_SYS_NICE


@contextlib.contextmanager
def spinners(count: int) -> Iterator[None]:
    """``count`` processes that only burn CPU (nice 0, like the workers), until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


Started = tuple[WorkerProcess, list[str], dict[str, list[int]]]


def _start(srv: BenchServer, workdir: Path, name: str, mode: str, trees: int, kill_grace: float,
           prefix: tuple[str, ...] = ()) -> Started:  # fmt: skip
    srv.define(name, response_timeout_seconds=R_SECONDS)
    pids_dir = workdir / f"pids_{name}"
    pids_dir.mkdir()
    task_ids = srv.task_ids(srv.start(name, trees))
    cfg = WorkerConfig(kind="conductor-run", url=srv.url, task_type=name, concurrency=trees,
                       command=[str(CHILDREN / "tree.sh"), mode, str(pids_dir)], state_dir=workdir / "state",
                       kill_grace_seconds=kill_grace, prefix=prefix)  # fmt: skip
    worker = WorkerProcess(cfg, workdir / f"{name}.log")

    def written() -> bool:
        if not worker.alive():
            raise RuntimeError(f"conductor-run exited early:\n{worker.log_tail()}")
        return all((pids_dir / t).exists() for t in task_ids)

    wait_until(written, 180, what="the task trees to start")
    pids = {t: [int(p) for p in (pids_dir / t).read_text().split()] for t in task_ids}
    return worker, task_ids, pids


def _forkserver(worker: WorkerProcess) -> psutil.Process:
    for proc in psutil.Process(worker.pid).children():
        if "forkserver" in " ".join(proc.cmdline()):
            return proc
    raise RuntimeError("the worker has no fork server")


def runner_stalled(srv: BenchServer, workdir: Path, mode: str, kill_grace: float, trial: int, trees: int,
                   busy: int, *, boost: bool = True) -> dict[str, Any]:  # fmt: skip
    name = f"st_{mode.replace('-', '_')}_{trees}_{'b' if boost else 'n'}_{trial}"
    stopped = False
    with spinners(busy):  # from the start: the 1-minute load has climbed by the stall
        worker, task_ids, pids = _start(srv, workdir, name, mode, trees, kill_grace, () if boost else NO_NICE)
        try:
            nice = os.getpriority(os.PRIO_PROCESS, _forkserver(worker).pid)
            watch = ExitWatch([p for tree in pids.values() for p in tree])
            all_started = time.monotonic()

            def fresh() -> bool:  # every lease renewed since all trees run (or its tree already gone)
                leases = srv.marks(task_ids)["leases"]
                return all(any(m > all_started for m in leases[t]) or not _alive(pids[t]) for t in task_ids)

            wait_until(fresh, 120, 0.1, what="a heartbeat confirmed per task since they all started")
            os.kill(worker.pid, signal.SIGSTOP)  # the runner stalls; its fork server goes on
            stopped = True
            stalled_at = time.monotonic()
            running = {t for t in task_ids if _alive(pids[t])}  # (some leases may be lost already)
            runnable = _runnable()
            gone = watch.wait(R_SECONDS + kill_grace + 60)
            load = os.getloadavg()[0]
        finally:
            if stopped:
                os.kill(worker.pid, signal.SIGCONT)
            worker.stop()
    leases = srv.marks(task_ids)["leases"]
    last = {t: max(m for m in leases[t] if m < stalled_at + 0.5) for t in task_ids}  # (a beat in flight)
    # Measured: the trees whose lease was still good at the stall. Under this load the runner may have
    # lost a few leases before it (a heartbeat too late: it fenced the tree itself): counted apart.
    measured = {t for t in running if last[t] + R_SECONDS > stalled_at}
    leads = []
    for t, tree in pids.items():
        if t not in measured:
            continue
        ends = [watch.exited_at.get(p) for p in tree]
        leads.append(None if gone is None or None in ends else
                     last[t] + R_SECONDS - max(e for e in ends if e is not None))  # fmt: skip
    known = sorted(x for x in leads if x is not None)
    # The switch's own lateness, as the fork server measured it (the runner logs it once it resumes).
    acted = [int(ms) for ms in re.findall(r"it acted (\d+) ms after its point", worker.log_path.read_text())]
    worst = None
    if known and len(known) == len(leads):  # which tree, and which of its processes died last
        t = [t for t in pids if t in measured][leads.index(known[0])]
        ends = [watch.exited_at[p] for p in pids[t]]
        worst = {"task_id": t, "last_member": ("shell", "grandchild", "escapee")[ends.index(max(ends))],
                 "members_vs_deadline": [round(e - last[t] - R_SECONDS, 3) for e in ends],
                 "stalled_at_vs_deadline": round(stalled_at - last[t] - R_SECONDS, 3)}  # fmt: skip
    return {
        "mode": mode, "trees": trees, "busy": busy, "load_1min": round(load, 1), "runnable": runnable,
        "forkserver_nice": nice, "kill_grace_seconds": kill_grace, "measured_trees": len(measured),
        "lost_before_stall": trees - len(measured),
        "before_deadline_seconds": known[0] if len(known) == len(leads) else None,  # the worst tree
        "before_deadline_median_seconds": known[len(known) // 2] if known else None,
        "target_seconds": 0.0, "worst": worst, "switch_late_max_ms": max(acted, default=None),
        "switched_trees": len(acted),
    }  # fmt: skip


def _alive(pids: list[int]) -> bool:
    """Every process of a tree still runs (not a zombie)."""
    try:
        return all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
    except psutil.NoSuchProcess:
        return False


def _runnable() -> int:
    """Processes runnable right now, host-wide (/proc/loadavg's 4th field, "running/total")."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return -1


def thawed(srv: BenchServer, workdir: Path, mode: str, kill_grace: float, trial: int, trees: int,
           frozen_seconds: float = 2.0, *, freeze_trees: bool = True) -> dict[str, Any]:  # fmt: skip
    """``freeze_trees`` False: only the runner and its fork server stop (the trees run on); the time
    is then from the fork server's SIGCONT."""
    name = f"th_{mode.replace('-', '_')}_{trees}_{'h' if freeze_trees else 'f'}_{trial}"
    worker, task_ids, pids = _start(srv, workdir, name, mode, trees, kill_grace)
    server = _forkserver(worker)
    members = [p for tree in pids.values() for p in tree]
    frozen = [worker.pid, server.pid, *(members if freeze_trees else [])]
    try:
        wait_until(lambda: all(srv.marks(task_ids)["leases"][t] for t in task_ids), 120, 0.05,
                   what="a confirmed heartbeat per task")  # fmt: skip
        for pid in frozen:  # the whole host (container) freezes: runner, fork server, trees
            os.kill(pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        watch = ExitWatch(members)
        # Past every tree's KILL point (its last ack + R - M, the last ack before the freeze) and more.
        wait_until(lambda: time.monotonic() >= frozen_at + R_SECONDS + frozen_seconds, 60, 0.05,
                   what="the freeze to outlast the lease")  # fmt: skip
        for pid in frozen[2:]:  # trees first: they run before anyone can act
            os.kill(pid, signal.SIGCONT)
        thawed_at = time.monotonic()
        os.kill(server.pid, signal.SIGCONT)
        os.kill(worker.pid, signal.SIGCONT)
        gone = watch.wait(30)
        ran = [watch.exited_at[p] - thawed_at for p in members if p in watch.exited_at]
        return {
            "mode": mode, "trees": trees, "frozen_seconds": round(thawed_at - frozen_at, 2),
            "trees_frozen": freeze_trees,
            "ran_after_thaw_max_seconds": max(ran) if gone is not None else None,
            "ran_after_thaw_median_seconds": sorted(ran)[len(ran) // 2] if ran else None,
        }  # fmt: skip
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        worker.stop()


def run(srv: BenchServer, workdir: Path, *, kill_grace: float, trials: int, trees: tuple[int, ...], busy: int,
        log: Any) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {"heartbeat_timeout_seconds": R_SECONDS, "kill_grace_seconds": kill_grace,
                           "runner_stalled": [], "thawed": []}  # fmt: skip
    for count in trees:
        for trial in range(trials):
            for boost in (True, False):
                r = runner_stalled(srv, workdir, "ignore-term", kill_grace, trial, count, busy, boost=boost)
                log(f"worst tree: {r['worst']}; {r['lost_before_stall']} lease(s) lost before the stall; "
                    f"switch: {r['switched_trees']} trees, {r['switch_late_max_ms']} ms late at most")
                log(f"runner stalled ({count} trees, {busy} spinners, load {r['load_1min']}, fork server "
                    f"nice {r['forkserver_nice']}): worst tree gone {r['before_deadline_seconds']} s before "
                    f"the server's deadline, median {r['before_deadline_median_seconds']} s")  # fmt: skip
                out["runner_stalled"].append(r)
            for freeze_trees in (True, False):
                r = thawed(srv, workdir, "ignore-term", kill_grace, trial, count, freeze_trees=freeze_trees)
                what = "thawed host" if freeze_trees else "runner and fork server resumed"
                log(f"{what} ({count} trees, stopped {r['frozen_seconds']} s): trees ran "
                    f"{r['ran_after_thaw_max_seconds']} s at most after it (median "
                    f"{r['ran_after_thaw_median_seconds']} s)")  # fmt: skip
                out["thawed"].append(r)
    return out
