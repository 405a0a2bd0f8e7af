"""The state every part of the embedded server's store shares: the lock, the clock, the tables.

:class:`StoreState` is handed to each part of the store (views, due schedule, decider, task calls,
metadata, workflows), which read and change its tables; it owns the bounds that keep them from
growing. It decides nothing. Every method here expects ``lock`` held unless its docstring says
otherwise.

Threads: every request thread and the timer thread, one at a time through ``lock``.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping

from leasecore.clock import Clock, SystemClock
from leasecore.server.queues import DelayQueue
from leasecore.server.records import JSON, ApiError, SweepMode, TaskRecord, WorkflowRecord

DEFAULT_MAX_FINISHED_WORKFLOWS = 10_000
DEFAULT_MAX_LOGS_PER_TASK = 1_000
MAX_UNKNOWN_LOG_TASKS = 10_000  # task ids that got logs without being a task of this server
MAX_POLL_DATA_ENTRIES = 10_000  # (task type, domain) pairs remembered for poll data

# Where the server's own secrets and environment values are read from, as the OSS server reads its
# environment: CONDUCTOR_SECRET_<NAME>, CONDUCTOR_ENV_<NAME>.
SECRET_PREFIX = "CONDUCTOR_SECRET_"
ENV_PREFIX = "CONDUCTOR_ENV_"


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
        self.new_id = id_factory or (lambda: str(uuid.uuid4()))
        self.lock = threading.Lock()
        # What the timer thread waits on; made on ``lock``, like every queue's condition.
        self.timer_cond = threading.Condition(self.lock)
        self.mono0 = self.clock.monotonic()
        self._wall0_ms = self.clock.now().timestamp() * 1000.0
        self.closed = False
        # None: os.environ, read at each use (so a test or an operator may change it while serving).
        self.runtime_environ: Mapping[str, str] | None = None
        # Test-only: set, extendLease is a read-modify-write of the whole task as on the real server,
        # this called between its read and its write (tasks.py, _extend_lease_by_copy); None: atomic.
        self.lease_write_back: Callable[[], None] | None = None

        self.task_defs: dict[str, JSON] = {}
        self.workflow_defs: dict[str, dict[int, JSON]] = {}
        self.workflows: dict[str, WorkflowRecord] = {}
        self.tasks: dict[str, TaskRecord] = {}
        self.queues: dict[str, DelayQueue] = {}
        self.logs: dict[str, list[JSON]] = {}
        self.poll_data: OrderedDict[tuple[str, str], JSON] = OrderedDict()  # least recent poll first
        self.poll_mono: dict[tuple[str, str], float] = {}
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished workflow ids, oldest first
        self._unknown_log_tasks: OrderedDict[str, None] = OrderedDict()
        self.evicted_workflows = 0

    # ------------------------------------------------------------------------------------ time

    def now(self) -> float:
        return self.clock.monotonic()

    def epoch_ms(self, t: float | None) -> int:
        """Epoch milliseconds for a store time; 0 for "not set", as Conductor does (lock not needed)."""
        if t is None:
            return 0
        return round(self._wall0_ms + (t - self.mono0) * 1000.0)

    # ------------------------------------------------------------------------------------ environment

    def environ(self) -> Mapping[str, str]:
        return os.environ if self.runtime_environ is None else self.runtime_environ

    def env_values(self) -> JSON:
        """``${workflow.env.X}``: every CONDUCTOR_ENV_X of the environment, by X."""
        prefix = len(ENV_PREFIX)
        return {name[prefix:]: value for name, value in self.environ().items() if name.startswith(ENV_PREFIX)}

    # ------------------------------------------------------------------------------------ lookups

    def queue(self, name: str) -> DelayQueue:
        q = self.queues.get(name)
        if q is None:
            q = self.queues[name] = DelayQueue(self.lock)
        return q

    def dequeue(self, name: str, task_id: str) -> None:
        """Take ``task_id`` out of queue ``name`` (a queue that does not exist is not created)."""
        q = self.queues.get(name)
        if q is not None:
            q.remove(task_id)

    def notify_queue(self, name: str) -> None:
        # A delayed message also wakes the pollers: they shorten their wait to its time.
        q = self.queues.get(name)
        if q is not None:
            q.cond.notify_all()

    def wake_all(self) -> None:
        """Wake the timer thread and every long poll."""
        self.timer_cond.notify_all()
        for q in self.queues.values():
            q.cond.notify_all()

    def workflow(self, workflow_id: str) -> WorkflowRecord:
        wf = self.workflows.get(workflow_id)
        if wf is None:
            raise ApiError(404, f"No such workflow found by id: {workflow_id}")
        return wf

    # ------------------------------------------------------------------------------------ bounds

    def finished_workflow(self, wf: WorkflowRecord) -> list[str]:
        """Count ``wf`` among the finished ones; forget the oldest beyond ``max_finished_workflows``
        and return their ids.

        A running workflow is never forgotten. A forgotten one (its tasks, their logs) is gone: every
        call naming it answers 404, as for an id the server never had.
        """
        self._finished[wf.workflow_id] = None
        self._finished.move_to_end(wf.workflow_id)
        forgotten: list[str] = []
        while len(self._finished) > self.max_finished_workflows:
            old_id, _ = self._finished.popitem(last=False)
            forgotten.append(old_id)
            old = self.workflows.pop(old_id, None)
            if old is None:
                continue
            self.evicted_workflows += 1
            for t in old.tasks:
                self.tasks.pop(t.task_id, None)
                self.logs.pop(t.task_id, None)
                queue = self.queues.get(t.queue_name)
                if queue is not None:
                    queue.remove(t.task_id)
        return forgotten

    def log_entries(self, task_id: str) -> list[JSON]:
        """The log list of ``task_id``; logs of ids that are not tasks here are kept for a bounded few."""
        entries = self.logs.get(task_id)
        if entries is not None:
            return entries
        if task_id not in self.tasks:
            self._unknown_log_tasks[task_id] = None
            while len(self._unknown_log_tasks) > MAX_UNKNOWN_LOG_TASKS:
                old_id, _ = self._unknown_log_tasks.popitem(last=False)
                if old_id not in self.tasks:
                    self.logs.pop(old_id, None)
        entries = self.logs[task_id] = []
        return entries

    def trim_logs(self, entries: list[JSON]) -> None:
        excess = len(entries) - self.max_logs_per_task
        if excess > 0:
            del entries[:excess]

    def remember_poll(self, key: tuple[str, str], entry: JSON, now: float) -> None:
        self.poll_data[key] = entry
        self.poll_data.move_to_end(key)
        self.poll_mono[key] = now
        while len(self.poll_data) > MAX_POLL_DATA_ENTRIES:
            old_key, _ = self.poll_data.popitem(last=False)
            self.poll_mono.pop(old_key, None)
