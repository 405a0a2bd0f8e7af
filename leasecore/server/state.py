"""The state every part of the embedded server's store shares: the lock, the clock, the tables.

:class:`StoreState` is the base of the store's mixins (views, timers, decider, tasks); the concrete
:class:`~leasecore.server.store.Store` combines them. Every method here expects ``_lock`` held unless
its docstring says otherwise.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Callable

from leasecore.clock import Clock, SystemClock
from leasecore.server.queues import DelayQueue
from leasecore.server.records import JSON, ApiError, SweepMode, TaskRecord, WorkflowRecord


class StoreState:
    """Tables, lock and time of the store."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        sweep_mode: SweepMode = "ideal",
        id_factory: Callable[[], str] | None = None,
    ) -> None:
        if sweep_mode not in ("ideal", "coarse"):
            raise ValueError(f"sweep_mode must be 'ideal' or 'coarse', not {sweep_mode!r}")
        self.clock: Clock = clock or SystemClock()
        self.sweep_mode: SweepMode = sweep_mode
        self._new_id = id_factory or (lambda: str(uuid.uuid4()))
        self._lock = threading.Lock()
        self._timer_cond = threading.Condition(self._lock)
        self._mono0 = self.clock.monotonic()
        self._wall0_ms = self.clock.now().timestamp() * 1000.0
        self._closed = False

        self._task_defs: dict[str, JSON] = {}
        self._workflow_defs: dict[str, dict[int, JSON]] = {}
        self._workflows: dict[str, WorkflowRecord] = {}
        self._tasks: dict[str, TaskRecord] = {}
        self._queues: dict[str, DelayQueue] = {}
        self._logs: dict[str, list[JSON]] = {}
        self._poll_data: dict[tuple[str, str], JSON] = {}
        self._poll_mono: dict[tuple[str, str], float] = {}

        self._due_heap: list[tuple[float, int, str]] = []
        self._due: dict[str, tuple[float, int]] = {}
        self._due_seq = itertools.count()

    # ------------------------------------------------------------------------------------ time

    def _now(self) -> float:
        return self.clock.monotonic()

    def epoch_ms(self, t: float | None) -> int:
        """Epoch milliseconds for a store time; 0 for "not set", as Conductor does."""
        if t is None:
            return 0
        return round(self._wall0_ms + (t - self._mono0) * 1000.0)

    def _queue(self, name: str) -> DelayQueue:
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = DelayQueue(self._lock)
        return q

    def _notify_queue(self, name: str) -> None:
        # A delayed message also wakes the pollers: they shorten their wait to its time.
        q = self._queues.get(name)
        if q is not None:
            q.cond.notify_all()

    def _workflow(self, workflow_id: str) -> WorkflowRecord:
        wf = self._workflows.get(workflow_id)
        if wf is None:
            raise ApiError(404, f"No such workflow found by id: {workflow_id}")
        return wf

    # Provided by the mixins further down the chain (timers, decider); declared for the earlier ones.

    def _decide(self, wf: WorkflowRecord, now: float) -> None:
        raise NotImplementedError

    def _reschedule(self, wf: WorkflowRecord, now: float) -> None:
        raise NotImplementedError
