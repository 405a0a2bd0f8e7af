"""State and decider of the embedded Conductor-compatible server (CONDUCTOR_PROTOCOL.md §2-§9).

Everything lives in memory behind one lock. Handler threads call the public methods; long polls wait
on a per-queue :class:`threading.Condition` built on that lock, so a push wakes exactly the pollers of
that queue. Time comes from an injected :class:`~leasecore.clock.Clock`: every decision reads
``clock.monotonic()``; the epoch-millisecond fields of the JSON are derived from it
(``wall at start + elapsed``), so they never go back even if the wall clock does.

Timer-driven checks (response timeout, task timeout, poll timeout, total and workflow timeouts) are
kept as one due time per running workflow in a heap; :meth:`Store.run_due` evaluates the workflows whose
time has come and :meth:`Store.timer_loop` is what the server's single timer thread runs (woken
when an earlier due time appears). Unit tests drive :meth:`Store.run_due` with a ``FakeClock``.

``sweep_mode="coarse"`` imitates the SQLite-backed real server: the first timer-driven check of a
workflow fires on time, every later one only at the first 60 s "unack sweep" tick that is more than
60 s past the requested time (so 60-120 s late). Synchronous decides (start, update, terminate,
``PUT /api/workflow/decide``) are immediate in both modes, as on the real server.

:class:`Store` is a thin facade over parts with one job each, every one handed what it needs:
``storestate`` (:class:`StoreState`: the lock, the clock, the tables and their bounds), ``views``
(JSON), ``timers`` (:class:`DueSchedule`, the due heap and sweep modes; :class:`Sweeper`, the timer
loop), ``decider`` (:class:`Decider`), ``tasks`` (:class:`TaskCalls`: polls, updates, extendLease,
logs), ``metadata`` (:class:`MetadataCalls`) and ``workflows`` (:class:`WorkflowCalls`), over
``records`` (records, constants, error helpers), ``definitions`` (validation, defaults, expressions)
and ``queues`` (the delay queue). The facade only forwards, so that a recording subclass (the
``store=`` hook of :class:`~leasecore.server.embedded.EmbeddedServer`) sees every call through its
public methods; ``update_task_v2`` claims its next task through :meth:`Store.poll`, and
``start_workflow_request`` starts through :meth:`Store.start_workflow`, for the same reason.

Known simplifications (documented in docs/embedded-server.md): only SIMPLE tasks, run in sequence; no rate or
concurrency limits; no external payload storage; no workflow pause/resume/restart/retry; a batch poll
returns as soon as at least one task is available (the SQLite queue keeps collecting until ``count``
or the timeout).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from leasecore.clock import Clock
from leasecore.server.decider import Decider
from leasecore.server.definitions import resolve_expressions
from leasecore.server.metadata import MetadataCalls
from leasecore.server.records import (
    JSON,
    TERMINAL_TASK,
    ApiError,
    SweepMode,
    TaskRecord,
    WorkflowRecord,
    as_int,
    as_obj,
    queue_name,
)
from leasecore.server.storestate import DEFAULT_MAX_FINISHED_WORKFLOWS, DEFAULT_MAX_LOGS_PER_TASK, StoreState
from leasecore.server.tasks import TaskCalls
from leasecore.server.timers import DueSchedule, Sweeper
from leasecore.server.views import StoreViews
from leasecore.server.workflows import WorkflowCalls

__all__ = [
    "JSON",
    "TERMINAL_TASK",
    "ApiError",
    "Store",
    "SweepMode",
    "TaskRecord",
    "WorkflowRecord",
    "queue_name",
    "resolve_expressions",
]


class Store:
    """The whole server state. Every public method is thread-safe."""

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        sweep_mode: SweepMode = "ideal",
        id_factory: Callable[[], str] | None = None,
        max_finished_workflows: int = DEFAULT_MAX_FINISHED_WORKFLOWS,
        max_logs_per_task: int = DEFAULT_MAX_LOGS_PER_TASK,
    ) -> None:
        state = StoreState(
            clock=clock,
            sweep_mode=sweep_mode,
            id_factory=id_factory,
            max_finished_workflows=max_finished_workflows,
            max_logs_per_task=max_logs_per_task,
        )
        schedule = DueSchedule(state.sweep_mode, state.mono0, state.timer_cond.notify_all)
        views = StoreViews(state)
        decider = Decider(state, schedule)
        metadata = MetadataCalls(state)
        self._state = state
        self._due = schedule
        self._sweeper = Sweeper(state, schedule, decider.decide)
        self._task_calls = TaskCalls(state, views, decider, schedule)
        self._metadata = metadata
        self._workflow_calls = WorkflowCalls(state, views, decider, metadata)

    # ------------------------------------------------------------------------------------ facts

    @property
    def clock(self) -> Clock:
        return self._state.clock

    @property
    def sweep_mode(self) -> SweepMode:
        return self._state.sweep_mode

    @property
    def max_finished_workflows(self) -> int:
        return self._state.max_finished_workflows

    @property
    def max_logs_per_task(self) -> int:
        return self._state.max_logs_per_task

    @property
    def evicted_workflows(self) -> int:
        """Finished workflows forgotten so far (beyond ``max_finished_workflows``)."""
        return self._state.evicted_workflows

    @property
    def runtime_environ(self) -> Mapping[str, str] | None:
        """Where secrets and environment values are read from (CONDUCTOR_SECRET_<NAME>,
        CONDUCTOR_ENV_<NAME>); None: this process's environment, read at each use."""
        return self._state.runtime_environ

    @runtime_environ.setter
    def runtime_environ(self, environ: Mapping[str, str] | None) -> None:
        with self._state.lock:
            self._state.runtime_environ = environ

    @property
    def state(self) -> StoreState:
        """The tables, the lock and the clock, for a driver in this process that reads them under
        ``state.lock`` (the simulator, ``leasecore.sim``); request handlers use the methods."""
        return self._state

    @property
    def lease_write_back(self) -> Callable[[], None] | None:
        """Test-only: the real server's lost update in extendLease (``TaskCalls._extend_lease_by_copy``)."""
        return self._state.lease_write_back

    @lease_write_back.setter
    def lease_write_back(self, between: Callable[[], None] | None) -> None:
        with self._state.lock:
            self._state.lease_write_back = between

    def epoch_ms(self, t: float | None) -> int:
        """Epoch milliseconds for a store time (``clock.monotonic()``); 0 for None."""
        return self._state.epoch_ms(t)

    def count_terminal(self, task_ids: list[str]) -> int:
        """How many of ``task_ids`` are tasks here that have ended: a cheap look, no JSON built."""
        with self._state.lock:
            tasks = self._state.tasks
            return sum(1 for t in task_ids if (task := tasks.get(t)) is not None and task.terminal)

    # ------------------------------------------------------------------------------------ timers

    def next_due(self) -> float | None:
        """The store time of the next timer-driven check, or None."""
        with self._state.lock:
            return self._due.earliest()

    def run_due(self) -> int:
        """Evaluate every workflow whose check time has come; return how many were evaluated."""
        with self._state.lock:
            return self._sweeper.run_due()

    def timer_loop(self) -> None:
        """Body of the server's timer thread: sleep until the next due check, run it; until closed."""
        self._sweeper.loop()

    def wake(self) -> None:
        """Wake the timer thread and every long poll (after a fake clock moved, or to shut down)."""
        with self._state.lock:
            self._state.wake_all()

    def close(self) -> None:
        with self._state.lock:
            self._state.closed = True
        self.wake()

    # ------------------------------------------------------------------------------------ metadata

    def register_task_defs(self, body: Any) -> None:
        self._metadata.register_task_defs(body)

    def update_task_def(self, body: Any) -> None:
        self._metadata.update_task_def(body)

    def get_task_def(self, name: str) -> JSON:
        return self._metadata.get_task_def(name)

    def list_task_defs(self) -> list[JSON]:
        return self._metadata.list_task_defs()

    def delete_task_def(self, name: str) -> None:
        self._metadata.delete_task_def(name)

    def register_workflow_def(self, body: Any, *, overwrite: bool = False) -> None:
        self._metadata.register_workflow_def(body, overwrite=overwrite)

    def update_workflow_defs(self, body: Any) -> None:
        self._metadata.update_workflow_defs(body)

    def get_workflow_def(self, name: str, version: int | None = None) -> JSON:
        return self._metadata.get_workflow_def(name, version)

    # ------------------------------------------------------------------------------------ workflows

    def start_workflow(
        self,
        name: str | None,
        input_data: Any,
        *,
        version: int | None = None,
        correlation_id: str | None = None,
        task_to_domain: Any = None,
        workflow_def: Any = None,
        priority: int = 0,
    ) -> str:
        """Start a workflow (registered by name, or the inline ``workflow_def``); return its id."""
        return self._workflow_calls.start_workflow(
            name,
            input_data,
            version=version,
            correlation_id=correlation_id,
            task_to_domain=task_to_domain,
            workflow_def=workflow_def,
            priority=priority,
        )

    def start_workflow_request(self, body: Any) -> str:
        req = as_obj(body, "the StartWorkflowRequest")
        version = req.get("version")
        return self.start_workflow(
            req.get("name"),
            req.get("input"),
            version=None if version is None else as_int(version, 1),
            correlation_id=req.get("correlationId"),
            task_to_domain=req.get("taskToDomain"),
            workflow_def=req.get("workflowDef"),
            priority=as_int(req.get("priority"), 0),
        )

    def get_workflow(self, workflow_id: str, *, include_tasks: bool = True) -> JSON:
        return self._workflow_calls.get_workflow(workflow_id, include_tasks=include_tasks)

    def get_workflow_status(self, workflow_id: str) -> JSON:
        return self._workflow_calls.get_workflow_status(workflow_id)

    def terminate_workflow(self, workflow_id: str, reason: str | None) -> None:
        self._workflow_calls.terminate_workflow(workflow_id, reason)

    def decide(self, workflow_id: str) -> None:
        self._workflow_calls.decide(workflow_id)

    # ------------------------------------------------------------------------------------ tasks

    def poll(
        self,
        task_type: str,
        *,
        count: int = 1,
        timeout_ms: int = 100,
        worker_id: str | None = None,
        domain: str | None = None,
    ) -> list[JSON]:
        """Batch poll, a real long poll: returns once a task is ready, or ``[]`` at the timeout."""
        return self._task_calls.poll(
            task_type, count=count, timeout_ms=timeout_ms, worker_id=worker_id, domain=domain
        )

    def poll_data(self, task_type: str | None) -> list[JSON]:
        return self._task_calls.poll_data(task_type)

    def queue_size(self, task_type: str, domain: str | None = None) -> int:
        return self._task_calls.queue_size(task_type, domain)

    def queue_sizes(self) -> dict[str, int]:
        return self._task_calls.queue_sizes()

    def listed_queue_sizes(self) -> dict[str, int]:
        """``GET /api/tasks/queue/all``: only queues something was ever queued in."""
        return self._task_calls.listed_queue_sizes()

    def update_task(self, body: Any) -> str:
        """``POST /api/tasks``: every rule of CONDUCTOR_PROTOCOL.md §3, in order; returns the taskId."""
        task_id, _task = self._task_calls.apply_update(body)
        return task_id

    def update_task_v2(self, body: Any) -> JSON | None:
        """``POST /api/tasks/update-v2``: the update, then (terminal, non-lease) claim the next task."""
        _task_id, task = self._task_calls.apply_update(body)
        if task is None or not task.terminal:
            return None
        worker = body.get("workerId") if isinstance(body, dict) else None
        got = self.poll(
            task.task_type,
            count=1,
            timeout_ms=0,
            worker_id=worker if isinstance(worker, str) else None,
            domain=task.domain,
        )
        return got[0] if got else None

    def get_task(self, task_id: str) -> JSON:
        return self._task_calls.get_task(task_id)

    def add_log(self, task_id: str, text: str) -> None:
        self._task_calls.add_log(task_id, text)

    def get_logs(self, task_id: str) -> list[JSON]:
        return self._task_calls.get_logs(task_id)
