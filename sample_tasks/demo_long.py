#!/usr/bin/env python3
"""A long job, the one `conductor-run demo` runs: it works for the input's "seconds", printing progress.

It shows the child's side of the contract:
- input arrives as data: the task's inputData as JSON on stdin (also in $CONDUCTOR_INPUT_FILE and,
  for scalars, in $CONDUCTOR_INPUT_<KEY>); nothing in it is ever run as code;
- every stdout line streams to the task's execution log while the job runs;
- the JSON object written to $CONDUCTOR_OUTPUT_FILE becomes the task's output; exit 0 = COMPLETED;
- the secrets its task def declares (runtimeMetadata) arrive as variables of the same name and in the
  JSON file $CONDUCTOR_SECRETS_FILE; it prints a line holding each value, which conductor-run masks
  (***) in the task log and everywhere else it writes.

It also starts a helper grandchild (a `sleep` that would outlive it), the way real scripts start
tools that fork: when conductor-run fences the task it stops the whole tree, helper included.
With the optional input "pids_file" it appends its own pid and the helper's there, one per line,
so the demo can check that the whole tree is gone.
"""

import json
import os
import subprocess
import sys
import time

task_input = json.load(sys.stdin)
seconds = int(task_input.get("seconds", 8))

# A grandchild that would outlive this script if nobody stopped the whole tree.
helper = subprocess.Popen(["sleep", str(seconds + 60)])
pids_file = task_input.get("pids_file")
if pids_file:
    with open(pids_file, "a", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n{helper.pid}\n")

# Only set when the task def declares secrets (the demo declares one): say each arrived both ways.
secrets_file = os.environ.get("CONDUCTOR_SECRETS_FILE")
if secrets_file:
    with open(secrets_file, encoding="utf-8") as f:
        for name, value in sorted(json.load(f).items()):
            same = "the same" if os.environ.get(name) == value else "NOT the same"
            print(f"secret {name}: {same} in ${name} and in $CONDUCTOR_SECRETS_FILE: {value}", flush=True)

started = time.monotonic()
for step in range(1, seconds + 1):
    print(f"working: step {step} of {seconds}", flush=True)
    time.sleep(max(0.0, started + step - time.monotonic()))

helper.terminate()  # a clean exit tidies up after itself
helper.wait()
with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w", encoding="utf-8") as f:
    json.dump({"worked_seconds": seconds}, f)
print("done", flush=True)
