"""The bench's server process: the embedded server plus a record of what each task went through.

Run as ``python -m bench.server``; it is a separate process from every worker, so the server's CPU
never counts against a worker and no GIL is shared. It prints one JSON line ``{"url": ..., "pid": ...}``
once listening, then answers JSON-line commands on stdin (one reply line each on stdout):

    {"cmd": "marks", "task_ids": [...] | null}  -> {"claims", "leases", "updates", "statuses", "ends"}
    {"cmd": "progress", "task_ids": [...]}      -> {"settled": n}  (reported or terminal; for waits)
    {"cmd": "refuse_update_v2", "task_type": T} -> {"ok": true}
    {"cmd": "hold_polls", "task_type": T}       -> {"ok": true}  (polls for T find nothing ...)
    {"cmd": "release_polls", "task_type": T}    -> {"ok": true}  (... until released: waiting polls wake)
    {"cmd": "requests"}                          -> {task type: {kind: count}}  (the server load)
    {"cmd": "quit"}

Recorded (server-side ``time.monotonic()``, which on Linux is the same clock in every process, so the
driver can compare it with its own readings):

- ``claims[task_id]``: each time a poll handed the task out;
- ``leases[task_id]``: each accepted ``extendLease`` (the moment the server reset the response timer);
- ``updates[task_id]``: ``[time, status, endpoint]`` of every non-lease update that was applied,
  endpoint ``"v1"`` (``POST /api/tasks``) or ``"v2"`` (``POST /api/tasks/update-v2``);
- ``refused[task_id]``: how many update-v2 calls for the task were refused (see below);
- ``ends[task_id]``: when the server ended the task (its ``endTime``, mapped back to the clock), or None;
- ``requests[task_type][kind]``: the calls workers made for that type, by kind: ``poll`` (each poll or
  batch poll), ``heartbeat`` (an ``extendLease`` update), ``update`` (any other update, v1 or v2),
  ``check`` (``GET /api/tasks/{id}``: an ownership check), ``log`` (``POST /api/tasks/{id}/log``).
  The bench's own look-ups (``marks``, ``progress``) go around the counting.

Refusing update-v2: after ``refuse_update_v2`` for a task type, every ``update-v2`` call for a task of
that type (known from the poll that handed it out) is answered 404 *before* the update is applied, as
by a server without the endpoint. The conductor-python SDK then switches to v1 ``POST /api/tasks`` for
good (retrying that same result at once through v1, which is the update that lands) and polls for each
next task itself; the bench's ``sdk-v1`` worker kind is the SDK run that way. Other task types keep v2.
Only the first refusal the SDK sees switches it: an update-v2 call already in flight when the switch
happens counts as an ordinary failure, retried 10 s later. So the throughput run lets the SDK switch
on one warm-up task, then queues the measured tasks while polls for the type are held (an empty queue,
as far as a worker can tell: the poll waits out its timeout) and releases them at once.

The recording wraps the public ``Store.poll`` / ``Store.update_task`` / ``Store.update_task_v2`` in a
subclass; the server itself is unchanged. It is handed in through ``EmbeddedServer(store=...)``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from leasecore.server import EmbeddedServer
from leasecore.server.store import JSON, ApiError, Store


class RecordingStore(Store):
    """A :class:`Store` that remembers when each task was claimed, leased and updated."""

    def __init__(self) -> None:
        # Tasks are looked up after the run: keep every finished workflow (the default forgets old ones).
        super().__init__(max_finished_workflows=10**9)
        self._marks_lock = threading.Lock()
        self.claims: dict[str, list[float]] = {}
        self.leases: dict[str, list[float]] = {}
        self.updates: dict[str, list[tuple[float, str, str]]] = {}
        self._task_types: dict[str, str] = {}  # task id -> its type, from the poll that handed it out
        self._refuse_v2: set[str] = set()  # task types whose update-v2 calls are answered 404
        self.refused: dict[str, int] = {}  # task id -> update-v2 calls refused
        self._held: dict[str, threading.Event] = {}  # task type -> set when its polls are released
        self.requests: dict[str, dict[str, int]] = {}  # task type -> kind -> calls (server load)
        self._in_v2 = threading.local()  # set while update-v2 claims the next task through poll()

    def _count(self, task_type: str | None, kind: str) -> None:
        with self._marks_lock:
            per_type = self.requests.setdefault(str(task_type), {})
            per_type[kind] = per_type.get(kind, 0) + 1

    def _type_of(self, task_id: Any) -> str | None:
        with self._marks_lock:
            return self._task_types.get(str(task_id))

    def get_task(self, task_id: str) -> JSON:
        self._count(self._type_of(task_id), "check")
        return super().get_task(task_id)

    def add_log(self, task_id: str, text: str) -> None:
        self._count(self._type_of(task_id), "log")
        super().add_log(task_id, text)

    def poll(
        self,
        task_type: str,
        *,
        count: int = 1,
        timeout_ms: int = 100,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[JSON]:
        if not getattr(self._in_v2, "active", False):  # update-v2's own claim is not a poll request
            self._count(task_type, "poll")
        with self._marks_lock:
            released = self._held.get(task_type)
        if released is not None:
            # Held: wait as a long poll on an empty queue would, but wake as soon as it is released.
            started = time.monotonic()
            if not released.wait(max(timeout_ms, 0) / 1000.0):
                return []
            timeout_ms = max(0, timeout_ms - int(1000 * (time.monotonic() - started)))
        got = super().poll(task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id, domain=domain)
        if got:
            now = time.monotonic()
            with self._marks_lock:
                for task in got:
                    task_id = str(task["taskId"])
                    self.claims.setdefault(task_id, []).append(now)
                    self._task_types[task_id] = str(task.get("taskType"))
        return got

    def hold_polls(self, task_type: str) -> None:
        """Polls for ``task_type`` find nothing until :meth:`release_polls`; tasks can be queued meanwhile."""
        with self._marks_lock:
            self._held.setdefault(task_type, threading.Event())

    def release_polls(self, task_type: str) -> None:
        with self._marks_lock:
            released = self._held.pop(task_type, None)
        if released is not None:
            released.set()

    def refuse_update_v2(self, task_type: str) -> None:
        """From now on, answer update-v2 for tasks of ``task_type`` with 404 (nothing applied)."""
        with self._marks_lock:
            self._refuse_v2.add(task_type)

    def update_task(self, body: Any) -> str:
        task_id = super().update_task(body)
        self._record_update(body, "v1")
        return task_id

    def update_task_v2(self, body: Any) -> JSON | None:
        # The SDK reports through update-v2 (which may hand out the next task: recorded by poll()).
        if isinstance(body, dict):
            task_id = str(body.get("taskId"))
            with self._marks_lock:
                refused = self._task_types.get(task_id) in self._refuse_v2
                if refused:
                    self.refused[task_id] = self.refused.get(task_id, 0) + 1
            if refused:
                # What a server without the endpoint answers; the SDK falls back to v1 on 404/405.
                raise ApiError(404, "No static resource api/tasks/update-v2.")
        self._in_v2.active = True
        try:
            nxt = super().update_task_v2(body)
        finally:
            self._in_v2.active = False
        self._record_update(body, "v2")
        return nxt

    def _record_update(self, body: Any, endpoint: str) -> None:
        now = time.monotonic()
        task_id = str(body.get("taskId"))
        self._count(self._type_of(task_id), "heartbeat" if body.get("extendLease") is True else "update")
        with self._marks_lock:
            if body.get("extendLease") is True:
                self.leases.setdefault(task_id, []).append(now)
            else:
                self.updates.setdefault(task_id, []).append((now, str(body.get("status")), endpoint))

    def settled(self, task_ids: list[str]) -> int:
        """How many of ``task_ids`` got a final update, or are terminal on the server (timed out...)."""
        with self._marks_lock:
            pending = [t for t in task_ids if not any(u[1] != "IN_PROGRESS" for u in self.updates.get(t, ()))]
        # The status straight from the store's records (count_terminal): get_task builds a whole
        # JSON task (a deep copy) under the store's lock, and the bench asks every second while up to
        # 1000 tasks are pending: ~0.2 s of that lock each time, which every heartbeat then waited
        # behind (the late gaps of the 1000-lease run were these waits, 140-216 ms, not the worker's).
        return len(task_ids) - len(pending) + self.count_terminal(pending)

    def marks(self, task_ids: list[str] | None) -> dict[str, Any]:
        """Everything recorded for ``task_ids`` (every claimed task when None), with current statuses."""
        with self._marks_lock:
            ids = list(self.claims) if task_ids is None else task_ids
            out: dict[str, Any] = {
                "claims": {t: list(self.claims.get(t, [])) for t in ids},
                "leases": {t: list(self.leases.get(t, [])) for t in ids},
                "updates": {t: list(self.updates.get(t, [])) for t in ids},
                "refused": {t: self.refused.get(t, 0) for t in ids},
            }
        statuses: dict[str, str | None] = {}
        ends: dict[str, float | None] = {}
        ref = time.monotonic()
        for t in ids:
            try:
                task = super().get_task(t)  # the bench's own look-up: not a worker's request
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
            elif request.get("cmd") == "refuse_update_v2":
                store.refuse_update_v2(str(request["task_type"]))
                reply = {"ok": True}
            elif request.get("cmd") == "hold_polls":
                store.hold_polls(str(request["task_type"]))
                reply = {"ok": True}
            elif request.get("cmd") == "requests":
                with store._marks_lock:
                    reply = {t: dict(kinds) for t, kinds in store.requests.items()}
            elif request.get("cmd") == "release_polls":
                store.release_polls(str(request["task_type"]))
                reply = {"ok": True}
            else:
                reply = {"error": f"unknown command {request.get('cmd')!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
