"""The final update's path alone: the CPU of update-v2 chaining through the runner's own reporter.

    python -m bench.report_path [--tasks 4000] [--rounds 3] [--senders 4]

Starts the bench server (``bench.server``, its own process: its CPU is not counted) and drives the
runner's report side in this process, as the runner wires it: ``Reporter`` -> ``ChainUpdates``
(``FinalUpdates``' guard) -> ``RecordedCalls`` -> ``ConductorClient`` on the lean transport. The
lease engine is a stub that allows every update (its cost is the engine's, not this path's); the
main thread plays the runner's main loop: it submits a result for every task an update-v2 claimed
(each result claims the next task, four chains at once) and takes every outcome off a queue.

Prints, per round and as medians: this process's CPU per task (``time.process_time``), the
reporter threads' CPU and sleeps (voluntary context switches) per task, and the main thread's.
A diagnostic for the report path's cuts (docs/benchmarks.md), not a target: no report file.
"""

from __future__ import annotations

import argparse
import functools
import queue
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import BenchServer
from leasecore.conductor.client import ConductorClient
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.runner.loop.task_end import ChainUpdates
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.runner.upstream.server_contact import RecordedCalls, ServerContact

SLOTS = 4
WARM = 60  # tasks before the measured window (threads started, connections open, code hot)


class AllowingEngine:
    """The guard's engine side, allowing every final update (no heartbeat to exclude)."""

    def begin_final_update(self, task_id: str, *, timeout_seconds: float | None = None) -> bool:
        return True

    def late_beats(self, task_id: str) -> None:
        return None

    def final_update_failed(self, task_id: str) -> None:
        pass

    def reported(self, task_id: str, *, poll_count: int | None = None) -> None:
        pass


def _thread_stats() -> dict[str, tuple[float, int]]:
    """Thread name -> (CPU seconds, voluntary context switches), from /proc for each live thread."""
    found = {}
    for thread in threading.enumerate():
        tid = thread.native_id
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        ticks = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)
        switches = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.M)
        found[thread.name] = (ticks / _TICKS, int(switches.group(1)) if switches else 0)
    return found


_TICKS = float(__import__("os").sysconf("SC_CLK_TCK"))


def _result(task: Task) -> TaskResult:
    """What the runner reports for a ``true`` command (the shape of its outputData)."""
    return TaskResult(task.task_id, task.workflow_id, TaskStatus.COMPLETED, output_data={
        "exitCode": 0, "signal": None, "durationSeconds": 0.002, "stdoutTail": "", "stderrTail": "",
        "resources": {"cpuSeconds": 0.001, "maxRssBytes": 1703936},
    }, worker_id="bench-report-path")


def one_round(server: BenchServer, round_no: int, tasks: int, senders: int) -> dict[str, float]:
    task_type = f"report_path_{round_no}"
    server.define(task_type)
    server.start(task_type, tasks + WARM)
    client = ConductorClient(server.url, timeout_seconds=10.0)
    events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
    port = ChainUpdates(RecordedCalls(client, ServerContact()), AllowingEngine(),  # type: ignore[arg-type]
                        reader=client)
    reporter = Reporter(port, lambda outcome: events.put(("done", outcome)), senders=senders)

    def on_chained(task: Task | None, sent_at: float, *, from_task: str) -> None:
        events.put(("chained", task))

    def submit(task: Task) -> None:
        reporter.submit(_result(task), retry_seconds=30.0, poll_count=task.poll_count, task_type=task_type,
                        on_chained=functools.partial(on_chained, from_task=task.task_id))

    first = client.poll(task_type, count=SLOTS, timeout_ms=2000, worker_id="bench-report-path")
    done = 0
    before: dict[str, tuple[float, int]] = {}
    cpu0 = wall0 = 0.0
    try:
        for task in first:
            submit(task)
        while done < tasks + WARM:
            kind, value = events.get(timeout=30)
            if kind == "chained":
                if value is not None:
                    submit(value)
                continue
            outcome: ReportOutcome = value
            if not outcome.delivered:
                raise RuntimeError(f"a result was not delivered: {outcome}")
            done += 1
            if done == WARM:
                before, cpu0, wall0 = _thread_stats(), time.process_time(), time.perf_counter()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        after = _thread_stats()
    finally:
        reporter.close()
        client.close()
    figures = {"cpu_ms_per_task": 1000 * cpu / tasks, "tasks_per_second": tasks / wall}
    reporters = [name for name in after if name.startswith("reporter") and name in before]
    for what, index in (("cpu_ms", 0), ("sleeps", 1)):
        scale = 1000 if what == "cpu_ms" else 1
        figures[f"reporters_{what}_per_task"] = scale * sum(
            after[n][index] - before[n][index] for n in reporters) / tasks
        main = threading.main_thread().name
        figures[f"main_{what}_per_task"] = scale * (after[main][index] - before[main][index]) / tasks
    figures["reporter_threads"] = len(reporters)
    return figures


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report_path", description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--senders", type=int, default=4)
    args = parser.parse_args(argv)
    runs: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = BenchServer(Path(tmp) / "server.log")
        try:
            for round_no in range(args.rounds):
                figures = one_round(server, round_no, args.tasks, args.senders)
                runs.append(figures)
                print(f"round {round_no + 1}/{args.rounds}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in figures.items()), flush=True)
        finally:
            server.close()
    medians = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
