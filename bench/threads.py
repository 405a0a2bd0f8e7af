"""Where one conductor-run worker's CPU goes, thread by thread, over a run of ``true`` tasks.

    python -m bench.threads [--tasks N] [--concurrency C] [--cgroup auto|v1|v2|off] [--rounds R]

Starts the bench server (``bench.server``) and one conductor-run worker against it, as the
throughput section does, waits for "serving", then reads every thread's CPU (user + system, through
psutil) of the runner and its fork server before and after the N tasks, and each thread's sleeps
(voluntary context switches: the hand-offs between threads and processes); also the children's CPU
(the fork server's reaped children: the ``true`` commands) and the server's, and the machine's steal
time (on a VM, the CPU time the hypervisor gave to others). Prints milliseconds (and sleeps) per
task for each, the sums, and the tasks per second on the server's clock (first claim to last final
update). Threads that start and end inside the window (none in a plain run) are not counted. A
diagnostic (docs/benchmarks.md), not a target: no report file is written.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

import psutil

from bench.harness import BenchServer, WorkerConfig, running_worker
from bench.measure import cpu_seconds, read_jiffies, steal_share, worker_processes
from bench.metrics_ab import cpu_at_serving


def _threads(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) per thread id of ``proc``."""
    return {t.id: t.user_time + t.system_time for t in proc.threads()}


def _switches(proc: psutil.Process) -> dict[int, int]:
    """Each thread's voluntary context switches (each a sleep: a wait for another thread, a lock, a
    socket or the GIL), by thread id; threads gone meanwhile are left out."""
    found = {}
    for tid in (t.id for t in proc.threads()):
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/status") as status:
                count = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status.read(), re.M)
        except OSError:
            continue
        found[tid] = int(count.group(1)) if count else 0
    return found


def _children_cpu(proc: psutil.Process) -> float:
    """CPU seconds of ``proc``'s reaped children (the fork server's: the task commands)."""
    times = proc.cpu_times()
    return times.children_user + times.children_system


def one_round(srv: BenchServer, work: Path, round_no: int, tasks: int, concurrency: int,
              cgroup: str | None) -> dict[str, float]:
    task_type = f"threads_{round_no}"
    srv.define(task_type)
    ids = srv.task_ids(srv.start(task_type, tasks))
    cfg = WorkerConfig(kind="conductor-run", url=srv.url, task_type=task_type, concurrency=concurrency,
                       command=["true"], state_dir=work / "state", cgroup=cgroup)
    log_path = work / f"{task_type}.log"
    with running_worker(cfg, log_path) as worker:
        if cpu_at_serving(worker.pid, log_path) is None:
            raise RuntimeError(f"the worker did not start serving:\n{worker.log_tail()}")
        runner, forkserver = worker_processes(worker.pid)[:2]
        server = psutil.Process(srv.pid)
        runner0, fs0 = _threads(runner), _threads(forkserver)
        sw0 = {**_switches(runner), **_switches(forkserver)}
        kids0, srv0, jiffies0 = _children_cpu(forkserver), cpu_seconds([server]), read_jiffies()
        srv.wait_settled(ids, timeout_seconds=60 + tasks * 0.2, worker=worker)
        runner1, fs1 = _threads(runner), _threads(forkserver)
        sw1 = {**_switches(runner), **_switches(forkserver)}
        kids1, srv1, jiffies1 = _children_cpu(forkserver), cpu_seconds([server]), read_jiffies()
    marks = srv.marks(ids)
    first = min(min(c) for c in marks["claims"].values() if c)
    last = max(when for u in marks["updates"].values() for when, status, _ in u if status != "IN_PROGRESS")
    per_task = {f"runner thread {k}": 1000 * (v - runner0.get(k, 0.0)) / tasks for k, v in runner1.items()}
    per_task.update({f"fork server thread {k}": 1000 * (v - fs0.get(k, 0.0)) / tasks for k, v in fs1.items()})
    switches = {tid: (count - sw0.get(tid, 0)) / tasks for tid, count in sw1.items()}
    worker_ms = sum(per_task.values())
    per_task = {k: v for k, v in per_task.items() if v >= 0.01}
    per_task["worker (runner + fork server)"] = worker_ms
    for tid, count in switches.items():
        if count >= 0.05:
            per_task[f"sleeps/task: thread {tid}"] = count
    per_task["sleeps/task: worker (all threads)"] = sum(switches.values())
    per_task["children (true)"] = 1000 * (kids1 - kids0) / tasks
    per_task["server"] = 1000 * (srv1 - srv0) / tasks
    per_task["tasks/s"] = tasks / (last - first)
    steal = steal_share(jiffies0, jiffies1)
    if steal is not None:  # the hypervisor's share of the machine's CPU time: a slower machine
        per_task["host steal %"] = 100 * steal
    return per_task


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.threads", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--cgroup", choices=("auto", "v1", "v2", "off"), default=None)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    if args.tasks < 1 or args.concurrency < 1 or args.rounds < 1:
        parser.error("--tasks, --concurrency and --rounds must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="bench-threads-"))
    srv = BenchServer(work / "server.log")
    try:
        for round_no in range(1, args.rounds + 1):
            figures = one_round(srv, work, round_no, args.tasks, args.concurrency, args.cgroup)
            print(f"round {round_no}: {args.tasks} tasks, concurrency {args.concurrency}, "
                  f"cgroup {args.cgroup or 'default'}")
            for name, value in figures.items():
                unit = "" if name in ("tasks/s", "host steal %") or name.startswith("sleeps") else " ms/task"
                print(f"  {name:40s} {value:8.3f}{unit}")
    finally:
        srv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
