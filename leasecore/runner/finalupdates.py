"""The final updates' guard: every attempt to report a task's result excludes that task's heartbeats.

Owns ``FinalUpdates``, the reporter's update port: around each attempt of the client's ``update`` it
calls the lease engine's ``begin_final_update`` (no beat of the task starts; one in flight is waited
for), then ``reported`` once the server acknowledged it, or ``final_update_failed`` when it raised (the
task beats again until the reporter's retry, so its lease outlives a slow report). DESIGN.md §4: no
heartbeat overlaps or follows a task's final update. ``runner.ports.FinalUpdateGuard`` is the engine
side it needs (``LeaseEngine``, and the runner's ``EnginePort``).

Must not touch: the lease engine's queues or leases (that bookkeeping is ``LeaseEngine``'s own), the
retry policy (``leasecore.runner.reporter``'s), the result's content.

Threads: whichever thread calls ``update``: the reporter's threads in the product. It holds no lock of
its own; the engine's calls are thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from leasecore.models import TaskResult
from leasecore.runner.ports import FinalUpdateGuard, UpdatePort

__all__ = ["FinalUpdates"]


_Guard = TypeVar("_Guard", bound=FinalUpdateGuard)
_Sent = TypeVar("_Sent")


class FinalUpdates:
    """The reporter's update port: each attempt of a final update excludes that task's heartbeats.

    Wraps the client's ``update``: ``begin_final_update`` before each attempt, ``reported`` once it is
    acknowledged, ``final_update_failed`` when it raises (the reporter may retry: the task beats again
    meanwhile, so its lease outlives a slow report). The engine is attached once it exists (the runner
    makes it), so both can be built without an order between them::

        updates = FinalUpdates(client)
        make_engine = lambda on_fence: updates.attach(LeaseEngine(client, on_fence))
        make_reporter = lambda done: Reporter(updates, done)
    """

    def __init__(self, port: UpdatePort, engine: FinalUpdateGuard | None = None) -> None:
        self._port = port
        self._engine = engine

    def attach(self, engine: _Guard) -> _Guard:
        """Use ``engine`` from now on; returns it (for a factory's one-liner)."""
        self._engine = engine
        return engine

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.guarded(result.task_id, lambda: self._port.update(result, timeout_seconds=timeout_seconds))

    def guarded(self, task_id: str, send: Callable[[], _Sent]) -> _Sent:
        """``send()`` (one attempt of a final update, whichever endpoint carries it) with the task's
        heartbeats excluded: ``reported`` when it returns, ``final_update_failed`` when it raises."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("FinalUpdates.update before attach(): no lease engine to exclude")
        engine.begin_final_update(task_id)
        try:
            sent = send()
        except BaseException:
            engine.final_update_failed(task_id)
            raise
        engine.reported(task_id)
        return sent
