"""The task function the conductor-python SDK worker runs: the command, with ``subprocess``.

What an SDK user would write to wrap a shell command: input as JSON on stdin, output captured, exit
code 0 = COMPLETED, anything else raises (the SDK reports FAILED). Module level, so the SDK's "spawn"
worker processes can import it; the command comes from ``BENCH_SDK_COMMAND`` (a JSON argv list).
No ``from __future__ import annotations`` here: the SDK inspects the real ``Task`` annotation to decide
to pass the whole task.
"""

import json
import os
import subprocess
from typing import Any

from conductor.client.http.models.task import Task

STDOUT_TAIL_CHARS = 1000


def run_command(task: Task) -> dict[str, Any]:
    """Run the configured command for ``task``; its captured stdout tail becomes the output."""
    argv = json.loads(os.environ["BENCH_SDK_COMMAND"])
    proc = subprocess.run(
        argv, input=json.dumps(task.input_data or {}).encode(), capture_output=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}: {proc.stderr[-200:].decode(errors='replace')}")
    return {"exit_code": 0, "stdout_tail": proc.stdout[-STDOUT_TAIL_CHARS:].decode(errors="replace")}
