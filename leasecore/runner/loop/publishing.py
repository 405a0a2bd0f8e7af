"""The runner's status snapshots, on its main thread: what each publish shows, and how often.

``SnapshotPublisher``, one of the runner's parts (``runner.Runner`` builds it, handing it the shared
``table.TaskTable``, the engine's views, the pollers, the server-contact record and the status port).
A snapshot holds every task in flight (``status.task_snapshot``), the results still saved in the
outbox, the server's health as the pollers and calls saw it, the paused types and whether a stop
began. A snapshot costs O(tasks) to build and a file write, so publishes are spaced: at most every
``status_min_interval``, and at most 1/20 of the main loop's time; a change in between is published
when that spacing allows (``pending``).

Main thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from leasecore.clock import Clock
from leasecore.runner.loop.status import server_health, task_snapshot
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.ports import EnginePort, StatusPort
from leasecore.runner.upstream.poller import Poller
from leasecore.runner.upstream.server_contact import ServerContact
from leasecore.state.outbox import still_saved

__all__ = ["SnapshotPublisher"]

MAIN_LOOP_SHARE = 20  # a publish may take at most 1/20 of the main loop's time


class SnapshotPublisher:
    """Builds and publishes the status snapshots, spaced (see the module docstring)."""

    def __init__(
        self, table: TaskTable, *, clock: Clock, engine: EnginePort, status: StatusPort | None,
        pollers: dict[str, Poller], contact: ServerContact, paused_types: Callable[[], list[str]],
    ) -> None:  # fmt: skip
        self._t, self._clock, self._engine, self._status = table, clock, engine, status
        self._pollers, self._contact, self._paused_types = pollers, contact, paused_types
        self._publish_at = clock.monotonic()
        self.pending = False  # a change waits for the spacing to allow its publish

    def wait_seconds(self, wait: float) -> float:
        """``wait`` shortened to when a pending publish is due."""
        if not self.pending:
            return wait
        return max(0.0, min(wait, self._publish_at - self._clock.monotonic()))

    def maybe_publish(self) -> None:
        """Publish now if the spacing allows, else mark it pending (a burst of events, e.g. 1000 tasks
        polled at once, is one publish, not one per event)."""
        now = self._clock.monotonic()
        if now < self._publish_at:
            self.pending = True
            return
        self.pending = False
        self.publish()
        # ... and at most 1/20 of the main loop's time: with 1000 tasks a snapshot costs ~50 ms, and
        # 5 of them a second starved the spawns and heartbeats.
        cost = self._clock.monotonic() - now
        self._publish_at = now + max(self._t.options.status_min_interval_seconds, MAIN_LOOP_SHARE * cost)

    def publish(self) -> None:
        """Publish a snapshot now. The publisher coalesces: it writes at once on a change, else about
        once a second."""
        if self._status is None:
            return
        tasks = [task_snapshot(e, self._engine, self._clock) for e in self._t.tasks.values()]
        saved = self._t.undelivered
        waiting = still_saved([path for path, _ in saved.values()]) if saved else ()
        for task_id, (path, snapshot) in list(self._t.undelivered.items()):
            if path not in waiting:  # delivered or dropped since
                del self._t.undelivered[task_id]
            elif task_id not in self._t.tasks:
                tasks.append(snapshot)
        self._status.publish(tasks, server=server_health(self._pollers.values(), self._contact, self._clock),
                             paused=self._paused_types(), stopping=self._t.stopping_since is not None)
