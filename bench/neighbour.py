"""A busy process beside the bench (the ``throughput-busy`` section): one Python loop that never
sleeps, in its own session (its own scheduling autogroup, as a separate service's would be), for the
length of a ``with``. What it shows: how much of each worker's throughput is left on a host that also
runs something else (docs/benchmarks.md, "What each figure is" and "The fork server").
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_process() -> Iterator[int]:
    """Run one CPU-bound loop for the block; its pid. Killed (and reaped) on the way out, whatever."""
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP], start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # fmt: skip
    try:
        yield loop.pid
    finally:
        loop.kill()
        loop.wait()
