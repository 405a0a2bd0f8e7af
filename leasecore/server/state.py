"""The state every part of the embedded server's store shares: the lock, the clock, the tables.

:class:`StoreState` is the base of the store's mixins (views, timers, decider, tasks); the concrete
:class:`~leasecore.server.store.Store` combines them. Every method here expects ``_lock`` held unless
its docstring says otherwise.

Threads: every request thread and the timer thread, one at a time through ``_lock``.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable

from leasecore.clock import Clock, SystemClock
from leasecore.server.queues import DelayQueue
from leasecore.server.records import JSON, ApiError, SweepMode, TaskRecord, WorkflowRecord

DEFAULT_MAX_FINISHED_WORKFLOWS = 10_000
DEFAULT_MAX_LOGS_PER_TASK = 1_000
MAX_UNKNOWN_LOG_TASKS = 10_000  # task ids that got logs without being a task of this server
MAX_POLL_DATA_ENTRIES = 10_000  # (task type, domain) pairs remembered for poll data


class StoreState:
    """Tables, lock and time of the store."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        sweep_mode: SweepMode = "ideal",
        id_factory: Callable[[], str] | None = None,
        max_finished_workflows: int = DEFAULT_MAX_FINISHED_WORKFLOWS,
        max_logs_per_task: int = DEFAULT_MAX_LOGS_PER_TASK,
    ) -> None:
        if sweep_mode not in ("ideal", "coarse"):
            raise ValueError(f"sweep_mode must be 'ideal' or 'coarse', not {sweep_mode!r}")
        if max_finished_workflows < 1 or max_logs_per_task < 1:
            raise ValueError("max_finished_workflows and max_logs_per_task must be at least 1")
        self.max_finished_workflows = max_finished_workflows
        self.max_logs_per_task = max_logs_per_task
        self.clock: Clock = clock or SystemClock()
        self.sweep_mode: SweepMode = sweep_mode
        self._new_id = id_factory or (lambda: str(uuid.uuid4()))
        self._lock = threading.Lock()
        self._timer_cond = threading.Condition(self._lock)
        self._mono0 = self.clock.monotonic()
        self._wall0_ms = self.clock.now().timestamp() * 1000.0
        self._closed = False
        # Test-only: set, extendLease is a read-modify-write of the whole task as on the real server,
        # this called between its read and its write (tasks.py, _extend_lease_by_copy); None: atomic.
        self.lease_write_back: Callable[[], None] | None = None

        self._task_defs: dict[str, JSON] = {}
        self._workflow_defs: dict[str, dict[int, JSON]] = {}
        self._workflows: dict[str, WorkflowRecord] = {}
        self._tasks: dict[str, TaskRecord] = {}
        self._queues: dict[str, DelayQueue] = {}
        self._logs: dict[str, list[JSON]] = {}
        self._poll_data: OrderedDict[tuple[str, str], JSON] = OrderedDict()  # least recent poll first
        self._poll_mono: dict[tuple[str, str], float] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished workflow ids, oldest first
        self._unknown_log_tasks: OrderedDict[str, None] = OrderedDict()
        self.evicted_workflows = 0

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

    def _dequeue(self, name: str, task_id: str) -> None:
        """Take ``task_id`` out of queue ``name`` (a queue that does not exist is not created)."""
        q = self._queues.get(name)
        if q is not None:
            q.remove(task_id)

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

    # ------------------------------------------------------------------------------------ bounds

    def _finished_workflow(self, wf: WorkflowRecord) -> None:
        """Count ``wf`` among the finished ones; forget the oldest beyond ``max_finished_workflows``.

        A running workflow is never forgotten. A forgotten one (its tasks, their logs) is gone: every
        call naming it answers 404, as for an id the server never had.
        """
        self._finished[wf.workflow_id] = None
        self._finished.move_to_end(wf.workflow_id)
        while len(self._finished) > self.max_finished_workflows:
            old_id, _ = self._finished.popitem(last=False)
            old = self._workflows.pop(old_id, None)
            self._due.pop(old_id, None)
            if old is None:
                continue
            self.evicted_workflows += 1
            for t in old.tasks:
                self._tasks.pop(t.task_id, None)
                self._logs.pop(t.task_id, None)
                queue = self._queues.get(t.queue_name)
                if queue is not None:
                    queue.remove(t.task_id)

    def _log_entries(self, task_id: str) -> list[JSON]:
        """The log list of ``task_id``; logs of ids that are not tasks here are kept for a bounded few."""
        entries = self._logs.get(task_id)
        if entries is not None:
            return entries
        if task_id not in self._tasks:
            self._unknown_log_tasks[task_id] = None
            while len(self._unknown_log_tasks) > MAX_UNKNOWN_LOG_TASKS:
                old_id, _ = self._unknown_log_tasks.popitem(last=False)
                if old_id not in self._tasks:
                    self._logs.pop(old_id, None)
        entries = self._logs[task_id] = []
        return entries

    def _trim_logs(self, entries: list[JSON]) -> None:
        excess = len(entries) - self.max_logs_per_task
        if excess > 0:
            del entries[:excess]

    def _remember_poll(self, key: tuple[str, str], entry: JSON, now: float) -> None:
        self._poll_data[key] = entry
        self._poll_data.move_to_end(key)
        self._poll_mono[key] = now
        while len(self._poll_data) > MAX_POLL_DATA_ENTRIES:
            old_key, _ = self._poll_data.popitem(last=False)
            self._poll_mono.pop(old_key, None)

    # Provided by the mixins further down the chain (timers, decider); declared for the earlier ones.

    def _decide(self, wf: WorkflowRecord, now: float) -> None:
        raise NotImplementedError

    def _reschedule(self, wf: WorkflowRecord, now: float) -> None:
        raise NotImplementedError
