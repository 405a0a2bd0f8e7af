"""A task command that keeps its own record, for the stall tests: it ignores SIGTERM and writes to the
file named by argv[1] (else $STALL_RECORD) one line per event, each with CLOCK_MONOTONIC seconds (the
same clock in every process of the host): ``start <t> <task id>``, ``term <t>`` for each SIGTERM it
gets, and ``tick <t>`` every 10 ms while it lives; so its last tick is (within 10 ms) when it died."""

from __future__ import annotations

import os
import signal
import sys
import time

path = sys.argv[1] if len(sys.argv) > 1 else os.environ["STALL_RECORD"]
fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)


def write(line: str) -> None:
    os.write(fd, f"{line}\n".encode())  # one write per line: O_APPEND keeps copies' lines whole


signal.signal(signal.SIGTERM, lambda *_: write(f"term {time.monotonic():.6f}"))
write(f"start {time.monotonic():.6f} {os.environ.get('CONDUCTOR_TASK_ID', '-')} {os.getpid()}")
while True:
    write(f"tick {time.monotonic():.6f}")
    time.sleep(0.01)
