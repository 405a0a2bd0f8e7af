"""The conductor-python 2.0.0 SDK worker the bench compares with (what users would otherwise pick).

    python -m bench.sdk_worker --server URL --task-type T --threads C [--lease-extend] -- CMD ARGS...

One ``Worker`` (``thread_count`` = C, default poll interval, ``lease_extend_enabled`` as asked) running
:func:`bench.sdk_task.run_command` under a ``TaskHandler``. Stops on SIGINT (Ctrl-C) as documented; the
bench also SIGKILLs the process group afterwards (SIGTERM alone orphans the SDK's worker processes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from conductor.client.automator.task_handler import TaskHandler
from conductor.client.configuration.configuration import Configuration
from conductor.client.worker.worker import Worker

from bench.sdk_task import run_command


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.sdk_worker")
    parser.add_argument("--server", required=True)
    parser.add_argument("--task-type", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lease-extend", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args(argv)
    os.environ["BENCH_SDK_COMMAND"] = json.dumps(args.command)  # inherited by the spawned workers
    worker = Worker(
        args.task_type,
        run_command,
        thread_count=args.threads,
        lease_extend_enabled=args.lease_extend,
        worker_id="bench-sdk",
    )
    config = Configuration(server_api_url=args.server)
    with TaskHandler(workers=[worker], configuration=config, scan_for_annotated_workers=False) as handler:
        handler.start_processes()
        with contextlib.suppress(KeyboardInterrupt):
            handler.join_processes()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
