"""Timer-driven checks of the embedded server: one due time per running workflow, in a heap.

:class:`DueSchedule` keeps the heap (when each running workflow must next be looked at, and in
``coarse`` sweep mode the 60 s "unack sweep" tick that look lands on); :class:`Sweeper` runs the
looks whose time has come (:meth:`Sweeper.run_due`), and is what the server's single timer thread
runs (:meth:`Sweeper.loop`, woken when an earlier due time appears). In ``coarse`` mode every check
after a workflow's first timer-driven one lands on the next 60 s tick more than 60 s past its time,
like the SQLite-backed real server.

Must not: decide anything about a workflow (the decider does, handed in). Threads: the request
threads and the timer thread, under the store's lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

from leasecore.server.records import COARSE_UNACK_PERIOD_SECONDS, SweepMode, WorkflowRecord, as_int, due_at
from leasecore.server.storestate import StoreState


def next_check(wf: WorkflowRecord) -> float | None:
    """The store time a timeout of ``wf`` (or of its running task) is next due; None: nothing to time.
    Each time is ``due_at`` of the same terms the decider's ``passed`` tests (records.due_at)."""
    if wf.terminal:
        return None
    times: list[float] = []
    wf_timeout = as_int(wf.definition.get("timeoutSeconds"), 0)
    if wf_timeout > 0 and not wf.alerted:
        times.append(due_at(wf.create_time, wf_timeout))
    if wf.tasks:
        t = wf.tasks[-1]
        if not t.terminal:
            td = t.task_def
            total = as_int(td.get("totalTimeoutSeconds"), 0)
            if total > 0 and "total" not in t.alerted:
                times.append(due_at(t.first_scheduled_time, total))
            timeout = as_int(td.get("timeoutSeconds"), 0)
            if timeout > 0 and t.start_time is not None and "task" not in t.alerted:
                times.append(due_at(t.start_time, t.start_delay_seconds, timeout))
            poll_timeout = as_int(td.get("pollTimeoutSeconds"), 0)
            if t.status == "SCHEDULED" and poll_timeout > 0 and "poll" not in t.alerted:
                times.append(
                    due_at(t.scheduled_time, t.start_delay_seconds, poll_timeout, t.callback_after_seconds)
                )
            r = t.response_timeout_seconds
            if t.status == "IN_PROGRESS" and r != 0 and t.update_time is not None:
                times.append(due_at(t.update_time, r, t.callback_after_seconds))
    return min(times) if times else None


def coarse_tick(requested: float, origin: float) -> float:
    """SQLite's re-delivery time: the first 60 s unack tick (counted from ``origin``) more than 60 s
    after ``requested``."""
    period = COARSE_UNACK_PERIOD_SECONDS
    k = math.floor((requested + period - origin) / period) + 1
    return origin + k * period


class DueSchedule:
    """The due-time heap: at most one live entry per workflow, stale ones dropped lazily."""

    def __init__(self, sweep_mode: SweepMode, origin: float, on_earlier: Callable[[], None]) -> None:
        """``origin``: the store time the coarse ticks count from; ``on_earlier``: called (lock held)
        when a due time earlier than every other appears, to wake the timer thread."""
        self.sweep_mode: SweepMode = sweep_mode
        self._origin = origin
        self._on_earlier = on_earlier
        self._heap: list[tuple[float, int, str]] = []
        self._due: dict[str, tuple[float, int]] = {}
        self._seq = itertools.count()

    def reschedule(self, wf: WorkflowRecord) -> None:
        """Set ``wf``'s due time from its state now (none once it is finished)."""
        due = next_check(wf)
        if due is None:
            self._due.pop(wf.workflow_id, None)
            return
        if self.sweep_mode == "coarse" and wf.timer_fired:
            due = coarse_tick(due, self._origin)
        current = self._due.get(wf.workflow_id)
        if current is not None and current[0] == due:
            return
        seq = next(self._seq)
        self._due[wf.workflow_id] = (due, seq)
        earliest = self._heap[0][0] if self._heap else math.inf
        heapq.heappush(self._heap, (due, seq, wf.workflow_id))
        if due < earliest:
            self._on_earlier()

    def forget(self, workflow_id: str) -> None:
        self._due.pop(workflow_id, None)

    def _purge(self) -> None:
        while self._heap:
            due, seq, wf_id = self._heap[0]
            if self._due.get(wf_id) == (due, seq):
                return
            heapq.heappop(self._heap)

    def earliest(self) -> float | None:
        """The store time of the next due check, or None."""
        self._purge()
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now: float) -> str | None:
        """The id of a workflow whose check time has come (taken off the schedule), or None."""
        self._purge()
        if not self._heap or self._heap[0][0] > now:
            return None
        _, _, wf_id = heapq.heappop(self._heap)
        del self._due[wf_id]
        return wf_id


class Sweeper:
    """Runs the due checks: the decider's look at each workflow whose time has come."""

    def __init__(
        self, state: StoreState, schedule: DueSchedule, decide: Callable[[WorkflowRecord, float], None]
    ) -> None:
        self._state = state
        self._schedule = schedule
        self._decide = decide

    def run_due(self) -> int:
        """Evaluate every workflow whose check time has come; return how many were evaluated (lock held)."""
        now = self._state.now()
        ran = 0
        while (wf_id := self._schedule.pop_due(now)) is not None:
            wf = self._state.workflows[wf_id]
            wf.timer_fired = True
            self._decide(wf, now)
            ran += 1
        return ran

    def loop(self) -> None:
        """Body of the server's timer thread: sleep until the next due check, run it; until closed.

        Takes the lock itself; waiting on the timer condition releases it."""
        state = self._state
        with state.lock:
            while not state.closed:
                self.run_due()
                due = self._schedule.earliest()
                if due is not None:
                    state.timer_cond.wait(max(due - state.now(), 0.0005))
                else:
                    state.timer_cond.wait()
