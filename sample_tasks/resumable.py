#!/usr/bin/env python3
"""A long job that resumes: counts ``steps`` steps of ``step_seconds`` each, keeping its place in
CONDUCTOR_CHECKPOINT_FILE, so that a yield, a retry or a crash costs at most one step.

Input (all optional): ``steps`` (10), ``step_seconds`` (1), ``yield_every`` (0: never; else hand the
task back every N steps with ``"$status": "IN_PROGRESS"``, to be polled again), ``fail_at`` (exit 3
at that step on the first attempt, to show a retry resuming), ``record`` (a file each run appends one
line to: ``<task id> <first step> <last step>``).

Run it with: conductor-run run --task-type count -- python3 sample_tasks/resumable.py
"""

import json
import os
import sys
import time


def load_checkpoint(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    return json.loads(text) if text.strip() else {"step": 0}


def save_checkpoint(path: str, state: dict) -> None:
    tmp = path + ".tmp"  # write then rename: the runner never sees half a checkpoint
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def main() -> int:
    job = json.load(sys.stdin)
    steps = int(job.get("steps") or 10)
    step_seconds = float(job.get("step_seconds") or 1)
    yield_every = int(job.get("yield_every") or 0)
    fail_at = job.get("fail_at")
    record = job.get("record")
    checkpoint = os.environ["CONDUCTOR_CHECKPOINT_FILE"]
    state = load_checkpoint(checkpoint)
    first = state["step"]
    print(f"resuming after step {first} of {steps}" if first else f"starting: {steps} steps", flush=True)
    step = first
    outcome = None
    while step < steps:
        time.sleep(step_seconds)  # the work of one step
        step += 1
        save_checkpoint(checkpoint, {"step": step, "progress": round(step / steps, 4)})
        if fail_at == step and os.environ.get("CONDUCTOR_RETRY_COUNT") == "0":
            outcome = 3
            break
        if yield_every and step % yield_every == 0 and step < steps:
            outcome = "yield"
            break
    if record:
        with open(record, "a") as f:
            f.write(f"{os.environ['CONDUCTOR_TASK_ID']} {first} {step}\n")
    if outcome == 3:
        print(f"failing at step {step}", file=sys.stderr)
        return 3
    with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w") as f:
        if outcome == "yield":  # back to the server; the next run starts from the checkpoint
            json.dump({"$status": "IN_PROGRESS", "$callbackAfterSeconds": 0}, f)
        else:
            json.dump({"steps": steps, "resumedAfter": first}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
