"""The bench's server process: the embedded server plus a record of what each task went through.

Run as ``python -m bench.server``; it is a separate process from every worker, so the server's CPU
never counts against a worker and no GIL is shared. It prints one JSON line ``{"url": ..., "pid": ...}``
once listening, then answers JSON-line commands on stdin (one reply line each on stdout):

    {"cmd": "marks", "task_ids": [...] | null}  -> {"claims", "leases", "updates", "statuses", "ends"}
    {"cmd": "progress", "task_ids": [...]}      -> {"settled": n}  (reported or terminal; for waits)
    {"cmd": "quit"}

Recorded (server-side ``time.monotonic()``, which on Linux is the same clock in every process, so the
driver can compare it with its own readings):

- ``claims[task_id]``: each time a poll handed the task out;
- ``leases[task_id]``: each accepted ``extendLease`` (the moment the server reset the response timer);
- ``updates[task_id]``: ``[time, status]`` of every non-lease update (v1 or v2);
- ``ends[task_id]``: when the server ended the task (its ``endTime``, mapped back to the clock), or None.

The recording wraps the public ``Store.poll`` / ``Store.update_task`` in a subclass; the server itself
is unchanged. It is handed in through ``EmbeddedServer(store=...)``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from leasecore.server import EmbeddedServer
from leasecore.server.store import JSON, TERMINAL_TASK, ApiError, Store


class RecordingStore(Store):
    """A :class:`Store` that remembers when each task was claimed, leased and updated."""

    def __init__(self) -> None:
        # Tasks are looked up after the run: keep every finished workflow (the default forgets old ones).
        super().__init__(max_finished_workflows=10**9)
        self._marks_lock = threading.Lock()
        self.claims: dict[str, list[float]] = {}
        self.leases: dict[str, list[float]] = {}
        self.updates: dict[str, list[tuple[float, str]]] = {}

    def poll(
        self,
        task_type: str,
        *,
        count: int = 1,
        timeout_ms: int = 100,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[JSON]:
        got = super().poll(task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id, domain=domain)
        if got:
            now = time.monotonic()
            with self._marks_lock:
                for task in got:
                    self.claims.setdefault(str(task["taskId"]), []).append(now)
        return got

    def update_task(self, body: Any) -> str:
        task_id = super().update_task(body)
        self._record_update(body)
        return task_id

    def update_task_v2(self, body: Any) -> JSON | None:
        # The SDK reports through update-v2 (which may hand out the next task: recorded by poll()).
        nxt = super().update_task_v2(body)
        self._record_update(body)
        return nxt

    def _record_update(self, body: Any) -> None:
        now = time.monotonic()
        task_id = str(body.get("taskId"))
        with self._marks_lock:
            if body.get("extendLease") is True:
                self.leases.setdefault(task_id, []).append(now)
            else:
                self.updates.setdefault(task_id, []).append((now, str(body.get("status"))))

    def settled(self, task_ids: list[str]) -> int:
        """How many of ``task_ids`` got a final update, or are terminal on the server (timed out...)."""
        with self._marks_lock:
            pending = [t for t in task_ids if not any(s != "IN_PROGRESS" for _, s in self.updates.get(t, ()))]
        # Only the few unreported ones are looked up: get_task builds a whole JSON task.
        ended = sum(1 for t in pending if self.get_task(t).get("status") in TERMINAL_TASK)
        return len(task_ids) - len(pending) + ended

    def marks(self, task_ids: list[str] | None) -> dict[str, Any]:
        """Everything recorded for ``task_ids`` (every claimed task when None), with current statuses."""
        with self._marks_lock:
            ids = list(self.claims) if task_ids is None else task_ids
            out: dict[str, Any] = {
                "claims": {t: list(self.claims.get(t, [])) for t in ids},
                "leases": {t: list(self.leases.get(t, [])) for t in ids},
                "updates": {t: list(self.updates.get(t, [])) for t in ids},
            }
        statuses: dict[str, str | None] = {}
        ends: dict[str, float | None] = {}
        ref = time.monotonic()
        for t in ids:
            try:
                task = self.get_task(t)
            except ApiError:
                statuses[t], ends[t] = None, None
                continue
            statuses[t] = str(task.get("status"))
            # endTime is epoch ms derived linearly from the store's monotonic clock: map it back.
            end_ms = int(task.get("endTime") or 0)
            ends[t] = ref + (end_ms - self.epoch_ms(ref)) / 1000.0 if end_ms else None
        out["statuses"] = statuses
        out["ends"] = ends
        return out


def main() -> int:
    store = RecordingStore()
    server = EmbeddedServer("127.0.0.1", 0, store=store)
    server.start()
    print(json.dumps({"url": server.url, "pid": os.getpid()}), flush=True)
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            request = json.loads(line)
            if request.get("cmd") == "quit":
                break
            if request.get("cmd") == "marks":
                reply: dict[str, Any] = store.marks(request.get("task_ids"))
            elif request.get("cmd") == "progress":
                reply = {"settled": store.settled(request.get("task_ids") or [])}
            else:
                reply = {"error": f"unknown command {request.get('cmd')!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
