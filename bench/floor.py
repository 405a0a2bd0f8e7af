"""The floor: the least a subprocess worker can do. Batch poll, fork/exec, reap, report; nothing else.

No heartbeats, no ownership checks, no output capture (the child's stdio is /dev/null), no input
passing, no retries, no status file, one thread. Loop: batch-poll for the free slots (long poll only
when nothing runs), ``posix_spawn`` each task's command, block in ``waitpid`` when there is nothing
else to do, report each exit with one POST /api/tasks (v1). This is the yardstick conductor-run's
per-task overhead is compared with, and the throughput target "<= 0.9 x the floor's time" is against it.

``--update-v2`` (the bench's ``floor-v2``, a diagnostic): report each exit with
``POST /api/tasks/update-v2`` instead and run the task it returns at once, in the slot just freed:
the same chaining conductor-run and the SDK do, with nothing else. It says what the chaining alone
is worth to a worker that does no more than this.

    python -m bench.floor --server URL --task-type T --concurrency C [--update-v2] -- CMD ARGS...
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import requests

LONG_POLL_MS = 1000


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.floor")
    parser.add_argument("--server", required=True)
    parser.add_argument("--task-type", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--update-v2", action="store_true", help="report with update-v2, run what it claims")
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    session = requests.Session()
    poll_url = f"{args.server}/tasks/poll/batch/{args.task_type}"
    update_url = f"{args.server}/tasks/update-v2" if args.update_v2 else f"{args.server}/tasks"
    devnull = os.open(os.devnull, os.O_RDWR)
    actions = [(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)]
    running: dict[int, dict[str, Any]] = {}

    def start(task: dict[str, Any]) -> None:
        running[os.posix_spawnp(args.command[0], args.command, os.environ, file_actions=actions)] = task

    while True:  # ended by SIGTERM's default action: the floor has nothing to clean up
        free = args.concurrency - len(running)
        polled: list[dict[str, Any]] = []
        if free > 0:
            params: dict[str, str | int] = {
                "count": free,
                "timeout": 0 if running else LONG_POLL_MS,
                "workerid": "bench-floor",
            }
            polled = session.get(poll_url, params=params, timeout=30).json()
            for task in polled:
                start(task)
        if not running:
            continue
        # Block for an exit when the slots are full or the queue looked empty; else just look.
        pid, status = os.waitpid(-1, 0 if not polled or len(running) >= args.concurrency else os.WNOHANG)
        while pid:
            task = running.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            result = {
                "taskId": task["taskId"],
                "workflowInstanceId": task["workflowInstanceId"],
                "status": "COMPLETED" if code == 0 else "FAILED",
                "workerId": "bench-floor",
                "outputData": {"exit_code": code},
            }
            reply = session.post(update_url, json=result, timeout=30)
            reply.raise_for_status()
            if args.update_v2 and reply.status_code == 200 and reply.content.strip():  # 204: none queued
                start(reply.json())
            pid, status = os.waitpid(-1, os.WNOHANG) if running else (0, 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
