#!/usr/bin/env python3
"""A worker written to conductor-cli's ``worker stdio`` contract; run it with ``--protocol stdio``.

It reads the whole task object from stdin, and prints one JSON document on stdout:
``{"status": ..., "output": {...}, "logs": [...], "reason": ...}``. Progress goes to stderr, which
conductor-run streams to the task's log while the script runs. Nothing in it knows conductor-run:
the same file runs under ``conductor worker stdio --type T python3 cli_stdio_worker.py``.

``inputData.mode`` picks what it does (the tests use every one):
  complete (default)  COMPLETED with a greeting, what it saw of the task and its environment
  fail                FAILED with a reason
  terminal            FAILED_WITH_TERMINAL_ERROR
  in_progress         IN_PROGRESS (callbackAfterSeconds 1) until the task's pollCount reaches 2
  garbage             prints text that is not JSON
  crash               a message on stderr, exit status 3
  sleep               runs ``inputData.seconds`` (with a child process of its own), then COMPLETED
  flood               prints 4 MiB on stdout
  big                 COMPLETED with ``output.blob``: ``inputData.size`` bytes of text
  logs                COMPLETED with ``inputData.count`` log lines (``logs``), one per item
"""

import json
import os
import subprocess
import sys
import time

task = json.load(sys.stdin)  # the whole task: taskId, workflowInstanceId, inputData, pollCount, ...
data = task.get("inputData") or {}
mode = data.get("mode") or "complete"
print(f"working on task {task.get('taskId')} ({mode})", file=sys.stderr, flush=True)


def reply(document: dict) -> None:
    json.dump(document, sys.stdout)
    sys.stdout.write("\n")


if mode == "fail":
    reply({"status": "FAILED", "reason": "the input was not good enough", "output": {"checked": True}})
elif mode == "terminal":
    reply({"status": "FAILED_WITH_TERMINAL_ERROR", "reason": "this can never work"})
elif mode == "in_progress":
    if int(task.get("pollCount") or 0) < 2:
        reply({"status": "IN_PROGRESS", "callbackAfterSeconds": 1, "logs": ["not ready yet"]})
    else:
        reply({"status": "COMPLETED", "output": {"ready": True, "pollCount": task.get("pollCount")}})
elif mode == "garbage":
    print("this is not JSON")
elif mode == "crash":
    print("something broke", file=sys.stderr)
    sys.exit(3)
elif mode == "sleep":
    helper = subprocess.Popen(["sleep", str(data.get("seconds", 60))])  # a grandchild to kill as well
    print(f"sleeping, helper pid {helper.pid}", file=sys.stderr, flush=True)
    helper.wait()
    reply({"status": "COMPLETED", "output": {"slept": data.get("seconds")}})
elif mode == "flood":
    chunk = "x" * 65536
    for _ in range(64):
        sys.stdout.write(chunk)
    reply({"status": "COMPLETED"})
elif mode == "big":
    reply({"status": "COMPLETED", "output": {"blob": "x" * int(data.get("size", 0))}})
elif mode == "logs":
    count = int(data.get("count", 3))
    reply({"status": "COMPLETED", "logs": [f"item {n}: line a\nline b" for n in range(count)]})
else:
    look_for = [str(value) for value in data.get("lookFor") or []]
    reply(
        {
            "status": "COMPLETED",
            "output": {
                "greeting": f"hello {data.get('name', 'world')}",
                "taskIdFromStdin": task.get("taskId"),
                "inputFromStdin": data,
                "cliEnv": {name: os.environ.get(name) for name in
                           ("TASK_TYPE", "TASK_ID", "WORKFLOW_ID", "EXECUTION_ID", "POLL_DOMAIN")},
                "conductorTaskId": os.environ.get("CONDUCTOR_TASK_ID"),
                "serverUrl": os.environ.get("CONDUCTOR_SERVER_URL"),  # to call back into Conductor
                "envNames": sorted(os.environ),
                "secretsSeen": [name for name, value in os.environ.items()
                                if any(secret in value for secret in look_for)],
                "startedAt": time.time(),
            },
            "logs": ["read the task from stdin", f"greeted {data.get('name', 'world')}"],
        }
    )
