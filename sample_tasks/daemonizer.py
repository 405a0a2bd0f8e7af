#!/usr/bin/env python3
"""Starts a classic daemon (fork, setsid, fork again: it leaves the task's process group and is
re-parented away from us), writes the daemon's pid to the output file, then either exits at once
(input "then": "exit") or keeps running (the default). Either way the daemon must die with the task.
"""

import json
import os
import sys
import time

read_end, write_end = os.pipe()
if os.fork() == 0:  # first child: new session, then fork the daemon and leave
    os.setsid()
    if os.fork() == 0:  # the daemon: detached from our session, stdio to /dev/null
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.write(write_end, f"{os.getpid()}\n".encode())
        while True:
            time.sleep(1)
    os._exit(0)
os.close(write_end)
daemon_pid = int(os.read(read_end, 64).decode())
with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w") as f:
    json.dump({"daemon_pid": daemon_pid, "main_pid": os.getpid()}, f)
print("daemon", daemon_pid, flush=True)
if os.environ.get("CONDUCTOR_INPUT_THEN") == "exit":
    sys.exit(0)
while True:
    time.sleep(1)
