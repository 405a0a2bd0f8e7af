"""What the lease engine costs a task: the threaded ``LeaseEngine`` (its timer thread and senders
started, a dead-man's-switch callback as the runner wires it) driven through one short task's events
as the runner sends them, ``WINDOW`` tasks in flight, against a port that answers at once.

Per task: its ``LeasePolicy.from_task`` (as the runner makes it at the poll) -> ``track`` ->
``child_started`` -> ``child_exited`` -> ``begin_final_update`` -> ``late_beats`` -> ``reported`` ->
``reported(poll_count=)`` (the runner forgetting the run), plus the runner's queries around them
(``lease_times`` x3; ``child_exited`` answers the fence). Prints microseconds of process CPU (every
thread: the timer's wake-ups count) and of wall time per task, the median of ``--rounds``.
Standalone: ``.venv/bin/python -m bench.engine_events [--tasks N] [--rounds R] [--no-queries]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from leasecore.lease import LeasePolicy
from leasecore.models import Task
from leasecore.runner.leasing.engine import LeaseEngine

WINDOW = 4  # tasks in flight at once (a concurrency-4 runner)


class _NoServer:
    """A lease port that counts its calls: none is expected (no beat or check comes due in a task
    that lives a few microseconds; ``run`` refuses a round that made one)."""

    calls = 0

    def extend_lease(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1

    def get_task_ownership(self, *args: Any, **kwargs: Any) -> None:
        self.calls += 1


def _policy(task: Task) -> LeasePolicy:
    # As the runner makes it for a task type with the config's defaults.
    return LeasePolicy.from_task(task, kill_grace_seconds=10.0, ownership_check_interval_seconds=5.0,
                                 first_attempt_spread=0.3)  # fmt: skip


def run(tasks: int, *, queries: bool) -> tuple[float, float]:
    """Process CPU and wall seconds for ``tasks`` tasks through a started engine."""
    kill_bys: list[Any] = []
    port = _NoServer()
    engine = LeaseEngine(port, lambda *args: None,
                         on_kill_by=lambda task_id, times: kill_bys.append(times))  # fmt: skip
    engine.start()
    made = [Task(task_id=f"t{i}", workflow_id="w", task_type="x", response_timeout_seconds=60,
                 timeout_seconds=300, poll_count=1) for i in range(tasks)]  # fmt: skip

    def begin(i: int) -> None:
        task = made[i]
        engine.track(task, _policy(task))
        if queries:
            engine.lease_times(task.task_id)  # the admission's look: fenced, past its TERM point?
            engine.lease_times(task.task_id)  # CONDUCTOR_DEADLINE
        engine.child_started(task.task_id)

    def end(i: int) -> None:
        task_id = made[i].task_id
        if queries:
            engine.lease_times(task_id)  # fenced before the exit, how late it is
        engine.child_exited(task_id)  # (its answer: the fence the runner keeps)
        engine.begin_final_update(task_id)
        engine.late_beats(task_id)
        engine.reported(task_id)
        engine.reported(task_id, poll_count=1)

    cpu, wall = time.process_time(), time.perf_counter()
    for i in range(tasks):
        begin(i)
        if i >= WINDOW:
            end(i - WINDOW)
    for i in range(max(0, tasks - WINDOW), tasks):
        end(i)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    engine.stop(5.0)
    if port.calls:
        raise SystemExit(f"{port.calls} heartbeats or checks went out: not the short task's path")
    if len(kill_bys) != 2 * tasks:  # each lease: its kill-by times once, then None at its end
        raise SystemExit(f"expected {2 * tasks} kill-by hand-outs, saw {len(kill_bys)}")
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-queries", action="store_true", help="only the events, not the runner's queries")
    args = parser.parse_args()
    run(1000, queries=not args.no_queries)  # warm up
    cpus, walls = [], []
    for _ in range(args.rounds):
        cpu, wall = run(args.tasks, queries=not args.no_queries)
        cpus.append(cpu / args.tasks * 1e6)
        walls.append(wall / args.tasks * 1e6)
    print(f"lease engine, {args.tasks} tasks x {args.rounds} rounds"
          f"{'' if args.no_queries else ' (with the runner queries)'}: "
          f"CPU {statistics.median(cpus):.1f} us/task (min {min(cpus):.1f}), "
          f"wall {statistics.median(walls):.1f} us/task (min {min(walls):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
