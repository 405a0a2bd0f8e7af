"""The runner's side of the dead-man's switches: each task's kill-by times, sent to its tree.

Owns ``KillByTimes``: the latest (TERM at, KILL at) of each task's lease (``Lease.kill_by``, handed
over by the lease engine's threads after every acknowledged heartbeat, ``None`` once the lease is
over), which tree each task runs as, and the ``kill_by`` requests to the fork server
(``switches.py`` holds and enforces them). A spawn carries the times known when it is sent;
``attach`` then queues whatever moved meanwhile, so no renewal falls between the two.

The requests go out on a thread of their own (``kill-by``, started at the first one): a heartbeat's
sender only records the new times and returns, so a fork server that does not read (stopped) can
never hold up a heartbeat. What waits is one entry per tree, the latest times (a newer renewal
replaces an older one not sent yet), sent together in one request: bounded, and one wake-up of the
fork server for many renewals.

Must not touch: the decisions (the lease's and ``deadman.Switch``'s), the socket (the link's). The
times are ``time.monotonic()`` seconds: the same clock in every process on Linux.
Threads: ``renew`` from the engine's threads, ``spawning``/``attach`` from the thread that starts a
task, ``gone`` from the reader thread, ``close`` from the closing one; the ``kill-by`` thread sends.
One lock (a condition) guards the tables; no request is sent with it held.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from leasecore.errors import ProcessError

KillBy = tuple[float, float]
_TASKS_MAX = 65536  # tasks whose times are kept: far above any runner's leases (a lost None leaks one)
_BATCH_MAX = 4096  # trees per request (a frame stays small)


class KillByTimes:
    """Each task's kill-by times and the tree they go to; see the module docstring."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._times: dict[str, KillBy] = {}  # task id -> its lease's latest kill-by times
        self._keys: dict[str, str] = {}  # task id -> the key of the tree running it
        self._tasks: dict[str, str] = {}  # tree key -> task id
        self._due: dict[str, KillBy] = {}  # tree key -> times to send (the latest)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._sending = False  # a batch taken from _due is on its way
        self.renewals = 0  # trees' kill-by times sent (diagnostics)

    def renew(self, task_id: str, times: KillBy | None) -> None:
        """The lease of ``task_id`` now ends at ``times`` (None: the lease is over, forget it)."""
        with self._cond:
            if times is None:
                self._times.pop(task_id, None)
                key = self._keys.pop(task_id, None)
                if key is not None:
                    self._tasks.pop(key, None)
                return
            self._times[task_id] = times
            if len(self._times) > _TASKS_MAX:
                del self._times[next(iter(self._times))]
            key = self._keys.get(task_id)
            if key is not None:
                self._queue_locked(key, times)

    def spawning(self, task_id: str) -> list[float] | None:
        """The times a spawn of ``task_id`` carries now (None: its lease has no deadline)."""
        with self._cond:
            times = self._times.get(task_id)
            return None if times is None else list(times)

    def attach(self, task_id: str, key: str, sent: list[float] | None) -> None:
        """The spawn of ``task_id`` as tree ``key`` went out with ``sent``: renewals go to it from now
        on, and one that came after ``spawning`` is queued now."""
        with self._cond:
            old = self._keys.get(task_id)
            if old is not None:
                self._tasks.pop(old, None)
            # Even with no times yet: the lease's first ones may still be on their way from another
            # engine thread (each hands out what all the leases queued), and must reach this tree.
            self._keys[task_id] = key
            self._tasks[key] = task_id
            times = self._times.get(task_id)
            if times is not None and (sent is None or tuple(sent) != times):
                self._queue_locked(key, times)

    def gone(self, key: str) -> None:
        """Tree ``key`` is gone: its task's renewals go nowhere until a next tree is attached."""
        with self._cond:
            self._due.pop(key, None)
            task_id = self._tasks.pop(key, None)
            if task_id is not None and self._keys.get(task_id) == key:
                del self._keys[task_id]

    def wait_sent(self, timeout_seconds: float) -> bool:
        """Wait until every queued renewal has been handed to the socket (tests, diagnostics)."""
        with self._cond:
            return self._cond.wait_for(lambda: (not self._due and not self._sending) or self._closed,
                                       timeout_seconds)  # fmt: skip

    def close(self) -> None:
        """Stop the sending thread (what is queued is dropped: its trees are being killed)."""
        with self._cond:
            self._closed = True
            self._due.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5.0)

    def _queue_locked(self, key: str, times: KillBy) -> None:
        if self._closed:
            return
        self._due[key] = times
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kill-by", daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._due or self._closed)
                if self._closed:
                    return
                keys = list(self._due)[:_BATCH_MAX]
                batch = [[key, *self._due.pop(key)] for key in keys]
                self._sending = True
            try:
                with contextlib.suppress(ProcessError):  # the fork server is gone: its trees die with it
                    self._send({"op": "kill_by", "trees": batch})
            finally:
                with self._cond:
                    self._sending = False
                    self.renewals += len(batch)
                    self._cond.notify_all()  # (wait_sent)
