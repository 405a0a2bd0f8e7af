"""Timer-driven checks of the embedded server: one due time per running workflow, in a heap.

:meth:`StoreTimers.run_due` evaluates the workflows whose time has come; :meth:`StoreTimers.timer_loop`
is what the server's single timer thread runs (woken when an earlier due time appears). In ``coarse``
sweep mode every check after a workflow's first timer-driven one lands on the next 60 s "unack sweep"
tick more than 60 s past its time, like the SQLite-backed real server.
"""

from __future__ import annotations

import heapq
import math

from leasecore.server.records import COARSE_UNACK_PERIOD_SECONDS, WorkflowRecord, as_int
from leasecore.server.views import StoreViews


class StoreTimers(StoreViews):
    """The due-time heap and the timer loop."""

    def _next_check(self, wf: WorkflowRecord) -> float | None:
        if wf.terminal:
            return None
        times: list[float] = []
        wf_timeout = as_int(wf.definition.get("timeoutSeconds"), 0)
        if wf_timeout > 0 and not wf.alerted:
            times.append(wf.create_time + wf_timeout)
        if wf.tasks:
            t = wf.tasks[-1]
            if not t.terminal:
                td = t.task_def
                total = as_int(td.get("totalTimeoutSeconds"), 0)
                if total > 0 and "total" not in t.alerted:
                    times.append(t.first_scheduled_time + total)
                timeout = as_int(td.get("timeoutSeconds"), 0)
                if timeout > 0 and t.start_time is not None and "task" not in t.alerted:
                    times.append(t.start_time + t.start_delay_seconds + timeout)
                poll_timeout = as_int(td.get("pollTimeoutSeconds"), 0)
                if t.status == "SCHEDULED" and poll_timeout > 0 and "poll" not in t.alerted:
                    times.append(
                        t.scheduled_time + t.start_delay_seconds + poll_timeout + t.callback_after_seconds
                    )
                r = t.response_timeout_seconds
                if t.status == "IN_PROGRESS" and r != 0 and t.update_time is not None:
                    times.append(t.update_time + r + t.callback_after_seconds)
        return min(times) if times else None

    def _coarse(self, requested: float) -> float:
        """SQLite's re-delivery time: the first 60 s unack tick more than 60 s after ``requested``."""
        period = COARSE_UNACK_PERIOD_SECONDS
        k = math.floor((requested + period - self._mono0) / period) + 1
        return self._mono0 + k * period

    def _reschedule(self, wf: WorkflowRecord, now: float) -> None:
        due = self._next_check(wf)
        if due is None:
            self._due.pop(wf.workflow_id, None)
            return
        if self.sweep_mode == "coarse" and wf.timer_fired:
            due = self._coarse(due)
        current = self._due.get(wf.workflow_id)
        if current is not None and current[0] == due:
            return
        seq = next(self._due_seq)
        self._due[wf.workflow_id] = (due, seq)
        earliest = self._due_heap[0][0] if self._due_heap else math.inf
        heapq.heappush(self._due_heap, (due, seq, wf.workflow_id))
        if due < earliest:
            self._timer_cond.notify_all()

    def _purge_due(self) -> None:
        while self._due_heap:
            due, seq, wf_id = self._due_heap[0]
            if self._due.get(wf_id) == (due, seq):
                return
            heapq.heappop(self._due_heap)

    def next_due(self) -> float | None:
        """The store time of the next timer-driven check, or None."""
        with self._lock:
            self._purge_due()
            return self._due_heap[0][0] if self._due_heap else None

    def run_due(self) -> int:
        """Evaluate every workflow whose check time has come; return how many were evaluated."""
        with self._lock:
            return self._run_due_locked()

    def _run_due_locked(self) -> int:
        now = self._now()
        ran = 0
        while True:
            self._purge_due()
            if not self._due_heap or self._due_heap[0][0] > now:
                return ran
            _, _, wf_id = heapq.heappop(self._due_heap)
            del self._due[wf_id]
            wf = self._workflows[wf_id]
            wf.timer_fired = True
            self._decide(wf, now)
            ran += 1

    def timer_loop(self) -> None:
        """Body of the server's timer thread: sleep until the next due check, run it; until closed."""
        with self._lock:
            while not self._closed:
                self._run_due_locked()
                self._purge_due()
                if self._due_heap:
                    self._timer_cond.wait(max(self._due_heap[0][0] - self._now(), 0.0005))
                else:
                    self._timer_cond.wait()

    def wake(self) -> None:
        """Wake the timer thread and every long poll (after a fake clock moved, or to shut down)."""
        with self._lock:
            self._timer_cond.notify_all()
            for q in self._queues.values():
                q.cond.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.wake()
