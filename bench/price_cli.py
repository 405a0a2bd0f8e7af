"""``python -m bench.price_cli --without PARTS run ...``: conductor-run with some of its guarantees taken
out, for the price list of safety (:mod:`bench.price`). A bench-only build: it patches the loaded
modules of this one process and its fork server's start; nothing in ``leasecore`` or ``cli`` changes,
and no product path can reach it.

PARTS, a comma list:

- ``files``: no task directory and no task files (input, output, checkpoint, secrets): the child
  reads its stdin from /dev/null and CONDUCTOR_OUTPUT_FILE points there, nothing is made or removed.
- ``logstream``: the child's output is still read from its pipes (the tails of a result), but no
  task log is buffered or streamed to the server.
- ``lease``: the lease engine knows no task: no lease is tracked, nothing is fenced or heartbeated
  (a task that outlived its lease would run on unwatched; these runs are `true`).
- ``record``: the state record (the journal of live trees a later start sweeps after a crash) is
  not written.

The group per tree is taken out by conductor-run's own switch (``--cgroup off``) and the metrics are
put in by theirs (``--metrics-port 0``): those need no patch.
"""

from __future__ import annotations

import os
import sys
from typing import Any

PARTS = ("files", "logstream", "lease", "record")


def _without_files() -> None:
    from leasecore.process import taskfiles

    def create_in(cls: Any, dirs: Any, task: Any, **_: Any) -> Any:
        # stdin from /dev/null; no output is read (below); an empty checkpoint path is never read
        return cls("", os.devnull, os.devnull, None, "", None)

    taskfiles.TaskFiles.create_in = classmethod(create_in)  # type: ignore[method-assign,assignment]
    taskfiles.TaskFiles.remove = lambda self, rmtree=None: None  # type: ignore[method-assign]
    taskfiles.TaskFiles.read_output = lambda self: (None, None)  # type: ignore[method-assign]


def _without_logstream() -> None:
    from leasecore.runner.upstream.logsink import LogStreamer as LogSink

    LogSink.open_lines = lambda self, task_id: (lambda stream, lines: None)  # type: ignore[method-assign]
    LogSink.open = lambda self, task_id: (lambda stream, line: None)  # type: ignore[method-assign]
    LogSink.close = lambda self, task_id: None  # type: ignore[method-assign]


def _without_lease() -> None:
    from leasecore.runner.leasing.engine import LeaseEngine

    def unknown(self: Any, task_id: str) -> Any:
        raise KeyError(task_id)

    for name in ("track", "start_held", "child_started", "child_exited", "final_update_failed", "reported"):
        setattr(LeaseEngine, name, lambda self, *a, **k: None)
    LeaseEngine.begin_final_update = lambda self, *a, **k: True  # type: ignore[method-assign]
    LeaseEngine.fence_reason = lambda self, task_id: None  # type: ignore[method-assign]
    LeaseEngine.view = unknown  # type: ignore[method-assign]
    LeaseEngine.views = lambda self: {}  # type: ignore[method-assign]


def _without_record() -> None:
    from leasecore.process.linux.leftovers import StateRecord

    StateRecord.add = lambda self, record: None  # type: ignore[method-assign]
    StateRecord.remove = lambda self, key: None  # type: ignore[method-assign]


PATCHES = {"files": _without_files, "logstream": _without_logstream, "lease": _without_lease,
           "record": _without_record}


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "--without":
        raise SystemExit(f"usage: python -m bench.price_cli --without PARTS run ... (PARTS of {PARTS})")
    parts = [p for p in argv[1].split(",") if p]
    unknown = [p for p in parts if p not in PATCHES]
    if unknown:
        raise SystemExit(f"--without: unknown part(s) {unknown}; allowed: {', '.join(PARTS)}")
    for part in parts:
        PATCHES[part]()
    sys.argv = [sys.argv[0], *argv[2:]]
    from cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main(sys.argv[1:])
