#!/usr/bin/env python3
"""Reads the task input the three ways a child can, and writes what it saw as the task's output.

stdin and $CONDUCTOR_INPUT_FILE both hold the task's inputData as JSON; each top-level scalar is
also in $CONDUCTOR_INPUT_<KEY>. The JSON object written to $CONDUCTOR_OUTPUT_FILE becomes the
task's outputData (plus exitCode, durationSeconds and output tails added by conductor-run).
"""

import hashlib
import json
import os
import sys

from_stdin = json.load(sys.stdin)
with open(os.environ["CONDUCTOR_INPUT_FILE"], encoding="utf-8") as f:
    from_file = json.load(f)
from_env = {
    name: value
    for name, value in os.environ.items()
    if name.startswith("CONDUCTOR_INPUT_") and name != "CONDUCTOR_INPUT_FILE"
}
canonical = json.dumps(from_stdin, sort_keys=True).encode()
output = {
    # The input itself only when small: the output object is capped (1 MiB) to stay under 3 MB.
    "stdin": from_stdin if len(canonical) < 64 * 1024 else "(large: see stdin_sha256)",
    "stdin_sha256": hashlib.sha256(canonical).hexdigest(),
    "file_matches_stdin": from_file == from_stdin,
    "env": from_env,
    "task_id": os.environ["CONDUCTOR_TASK_ID"],
    "auth_vars": sorted(k for k in os.environ if k.upper().startswith("CONDUCTOR_AUTH")),
}
with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w", encoding="utf-8") as f:
    json.dump(output, f)
print("echoed", len(from_stdin), "input keys")
