#!/usr/bin/env python3
"""Writes the input's "bytes" (default 300 MB) to stdout without a single newline, and some lines
to stderr: the runner must keep its memory bounded and its reads deadlock-free."""

import os
import sys

total = int(os.environ.get("CONDUCTOR_INPUT_BYTES", str(300 * 1024 * 1024)))
chunk = b"x" * (1024 * 1024)
written = 0
while written < total:
    n = min(len(chunk), total - written)
    sys.stdout.buffer.write(chunk[:n])
    written += n
    if written % (16 * 1024 * 1024) == 0:
        print(f"wrote {written} bytes", file=sys.stderr, flush=True)
sys.stdout.flush()
print("flood done", file=sys.stderr)
