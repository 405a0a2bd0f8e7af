"""A task command that keeps its own record, for the stall tests: it ignores SIGTERM and writes to the
file named by argv[1] (else $STALL_RECORD) one line per event: its kind, CLOCK_MONOTONIC seconds (the
same clock in every process of the host), wall-clock seconds (to compare with the server's times) and
its pid: ``start`` (with the task id), ``term`` for each SIGTERM it gets, and ``tick`` every 10 ms
while it lives; so its last tick is (within 10 ms) when it died."""

from __future__ import annotations

import os
import signal
import sys
import time

path = sys.argv[1] if len(sys.argv) > 1 else os.environ["STALL_RECORD"]
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def write(kind: str, extra: str = "") -> None:
    line = f"{kind} {time.monotonic():.6f} {time.time():.6f} {os.getpid()} {extra}".rstrip()
    os.write(fd, f"{line}\n".encode())  # one write per line: O_APPEND keeps the copies' lines whole


signal.signal(signal.SIGTERM, lambda *_: write("term"))
write("start", os.environ.get("CONDUCTOR_TASK_ID", "-"))
while True:
    write("tick")
    time.sleep(0.01)
