"""Who may still be running a task handed to us, and when its command may start. Pure.

Two copies of one task never run at once (DESIGN.md §4). The lease (``leasecore.lease``) makes sure
our tree is dead before the server may hand the task to someone else; this module covers the other
side, a task handed to *us* whose previous holder may still run it:

* **A re-delivery** (``pollCount`` > 1) that does not follow a yield of ours. The server hands a task
  out again after a re-queue while it still runs elsewhere (a bare IN_PROGRESS update, an operator's
  requeue, a queue repair, a double delivery). Its previous holder's heartbeats still succeed (the
  server extends any task that is not terminal); what ends its copy is its own ownership checks.
  Counting on one of them getting through (a check interval, a confirmation, the grace) left a gap: a
  holder whose checks are lost, partitioned or stalled ran on. So the holder's lease also ends one
  *ownership window* after the newest check that found the task its own was started
  (``LeasePolicy.ownership_window_seconds``: the lease timeout, plus twice the longest its runner's
  check budget may hold a due check, ``check_queue_seconds``), and its fork server's kill-by follows
  that deadline too. Such a check was started before the re-poll that reached us, so that holder's
  tree is dead by the window after our poll's answer: the command starts only then
  (``redelivery_wait_seconds``); the lease is held with heartbeats meanwhile.
* **A yield of ours** (an IN_PROGRESS update: ``in_progress_exit_code`` with ``callbackAfterSeconds``,
  or a surplus task handed back) ends that delivery on purpose, with nothing left running: the update
  carries the pollCount it ended (``mark_yield``), and the next delivery, pollCount + 1, on any host,
  starts at once (``follows_our_yield``). No marker, or a stale one (the task was re-queued again
  since), means wait. "Nothing left running" is checked, not assumed: a child's IN_PROGRESS result
  waits in ``YieldHold`` until its whole tree is gone (escapees included), and goes out marked only
  then; a tree still alive at the hold's bound goes out unmarked (its next holder waits).
* **A held delivery handed back unstarted** (fenced, or the runner stops, while it waits): when its
  previous holder may still run it, it goes back as an *unmarked* IN_PROGRESS (never FAILED, which
  would make the server create a retry at once that nobody waits for), so its next holder waits again.
* **A retry of the same logical task on this host** (a new taskId, same workflow and reference name)
  polled while the previous attempt's tree is still dying here starts once that tree is gone
  (``DyingTrees``; the runner asks it).

A delivery of the same taskId while it still runs here is not this module's: the runner keeps the
running child (never started twice).

Threads: the runner's main thread alone (it owns per-task state); ``DyingTrees`` too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from leasecore.models import Task, TaskResult, TaskStatus

__all__ = [
    "YIELD_MARKER",
    "DyingTrees",
    "StartGate",
    "YieldHold",
    "follows_our_yield",
    "logical_key",
    "mark_yield",
    "may_run_elsewhere",
    "redelivery_wait_seconds",
]

# outputData key of an IN_PROGRESS update of ours: the pollCount of the delivery it ends.
YIELD_MARKER = "conductorRunYieldedAtPollCount"
_PRUNE_AT = 256  # logical tasks with a dying tree kept before the gone ones are swept


def mark_yield(result: TaskResult, poll_count: int) -> TaskResult:
    """``result`` with the yield marker when it is an IN_PROGRESS update (else unchanged)."""
    if result.status is not TaskStatus.IN_PROGRESS or poll_count <= 0:
        return result
    return dataclasses.replace(result, output_data={**result.output_data, YIELD_MARKER: poll_count})


def with_checkpoint(result: TaskResult, value: Any) -> TaskResult:
    """``result`` carrying ``value`` as ``outputData.checkpoint`` (None: unchanged). An update replaces
    the task's whole output: one without it would lose the checkpoint for the task's next run."""
    if value is None:
        return result
    return dataclasses.replace(result, output_data={**result.output_data, "checkpoint": value})


def follows_our_yield(task: Task) -> bool:
    """True when this delivery is the one right after a yield of ours (marker = pollCount - 1)."""
    output = task.raw.get("outputData")
    marker = output.get(YIELD_MARKER) if isinstance(output, dict) else None
    return type(marker) is int and marker == task.poll_count - 1


def may_run_elsewhere(task: Task) -> bool:
    """True when a previous holder may still be running this delivery's task (see the module doc)."""
    return task.poll_count > 1 and not follows_our_yield(task)


def redelivery_wait_seconds(
    task: Task,
    *,
    ownership_check_interval_seconds: float,
    redelivery_grace_seconds: float,
    kill_grace_seconds: float,
    fence_margin_seconds: float,
    check_queue_seconds: float = 0.0,
    lease_timeout_seconds: float = 0.0,
) -> float:
    """How long after the poll the command of ``task`` may start: 0, or (a re-delivery that may still
    run elsewhere) until its previous holder's tree must be dead whatever became of its checks: its
    ownership window, the task's R (the longest any holder's lease timeout may be; without R, ours,
    ``lease_timeout_seconds``) plus twice ``check_queue_seconds`` (the most a runner's ownership-check
    budget holds a due check, ``leasecore.checkbudget.max_queue_seconds``). See the module doc.

    Without a lease deadline the wait is the old one, which counts on the previous holder's checks
    getting through: check interval + confirmation + grace + margin (+ twice the budget's hold).
    Without ownership checks nothing bounds it; the wait is still the grace + margin."""
    if not may_run_elsewhere(task):
        return 0.0
    window = task.response_timeout_seconds or lease_timeout_seconds
    if ownership_check_interval_seconds > 0 and window > 0:
        return window + 2 * check_queue_seconds
    check = 0.0
    if ownership_check_interval_seconds > 0:
        check = ownership_check_interval_seconds + redelivery_grace_seconds + 2 * check_queue_seconds
    return check + kill_grace_seconds + fence_margin_seconds


def logical_key(task: Task) -> tuple[str, str] | None:
    """What the attempts of one logical task share: its workflow and reference name (None: unknown)."""
    if not task.workflow_id or not task.reference_name:
        return None
    return task.workflow_id, task.reference_name


class DyingTrees:
    """Trees of this host whose task is over (reported, or no longer ours) but which are not gone yet,
    by logical task. ``gone(handle)`` tells whether a handle's tree is gone (every process reaped).
    Bounded: a handle is dropped as soon as its tree is seen gone. Main thread only."""

    def __init__(self, gone: Callable[[object], bool]) -> None:
        self._gone = gone
        self._trees: dict[tuple[str, str], list[object]] = {}

    def add(self, task: Task, handle: object) -> None:
        key = logical_key(task)
        if len(self._trees) >= _PRUNE_AT:  # bounded: forget the trees gone meanwhile
            self.prune()
        if key is not None and not self._gone(handle):
            trees = self._trees.setdefault(key, [])
            if handle not in trees:
                trees.append(handle)

    def still_dying(self, task: Task) -> bool:
        """True while a tree of an earlier attempt of ``task``'s logical task is not gone."""
        key = logical_key(task)
        return key is not None and self._still_dying(key)

    def prune(self) -> None:
        """Forget every tree that is gone."""
        for key in list(self._trees):
            self._still_dying(key)

    def _still_dying(self, key: tuple[str, str]) -> bool:
        alive = [h for h in self._trees.get(key, ()) if not self._gone(h)]
        if alive:
            self._trees[key] = alive
            return True
        self._trees.pop(key, None)
        return False

    def __len__(self) -> int:
        return sum(len(v) for v in self._trees.values())


@dataclasses.dataclass(eq=False)
class _Held:
    """A held task and when it may start."""

    task: Task
    start_at: float  # monotonic; the re-delivery wait (or the poll time: no wait)


class StartGate:
    """Polled tasks whose command may not start yet, by task id: until ``start_at`` (a re-delivery that
    may still run elsewhere) and while an earlier attempt's tree is dying here (``DyingTrees``).
    Pure: the caller passes the time. Main thread only."""

    def __init__(self, dying: DyingTrees) -> None:
        self.dying = dying
        self._held: dict[str, _Held] = {}

    def hold(
        self, task: Task, start_at: float, now: float, here: Iterable[tuple[Task, object]] = ()
    ) -> str | None:
        """Hold ``task`` if it may not start at ``now``; returns why (for the log), None: start now.

        ``here``: the tasks in flight on this host with their trees; one of another attempt of the
        same logical task (the server gave up on it) counts as a dying tree.
        """
        key = logical_key(task)
        for other, handle in here:
            if key is not None and other.task_id != task.task_id and logical_key(other) == key:
                self.dying.add(other, handle)
        waits = start_at > now
        dying = self.dying.still_dying(task)
        if not waits and not dying:
            return None
        self._held[task.task_id] = _Held(task, start_at)
        reasons = []
        if waits:
            reasons.append(f"it was handed out before (pollCount {task.poll_count}) and not after a yield "
                           f"of ours, so its previous holder may still run it: starting it in "
                           f"{start_at - now:.1f} s, once that holder must have stopped it")
        if dying:
            reasons.append("an earlier attempt of the same task (workflow and reference name) is still "
                           "being killed here: starting it once that tree is gone")
        return "; ".join(reasons)

    def due(self, now: float) -> list[Task]:
        """The held tasks that may start now (removed from the gate)."""
        held = self._held.values()
        ready = [h.task for h in held if h.start_at <= now and not self.dying.still_dying(h.task)]
        for task in ready:
            del self._held[task.task_id]
        return ready

    def next_at(self, now: float, *, poll_seconds: float) -> float | None:
        """When ``due`` should next be asked: the earliest ``start_at`` to come, or ``now + poll_seconds``
        while a task waits for a dying tree (None: nothing is held)."""
        if not self._held:
            return None
        times = [h.start_at for h in self._held.values() if h.start_at > now]
        if any(h.start_at <= now for h in self._held.values()):  # held by a dying tree only
            times.append(now + poll_seconds)
        return min(times)

    def start_at(self, task_id: str) -> float | None:
        """When held ``task_id`` may start at the earliest (None: not held)."""
        held = self._held.get(task_id)
        return held.start_at if held is not None else None

    def drop(self, task_id: str) -> bool:
        """Stop holding ``task_id``; True when it was held."""
        return self._held.pop(task_id, None) is not None

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._held

    def held(self) -> list[str]:
        return list(self._held)

    def __bool__(self) -> bool:  # (the loop asks at every turn: nothing held, nothing to look at)
        return bool(self._held)


class YieldHold:
    """Results of children whose tree is not gone yet, by task id: IN_PROGRESS (a yield is marked only
    once nothing of ours runs any more, ``mark_yield``) and FAILED (the server creates the retry at
    once, for any host: it goes out once the tree is gone). Each waits until its tree is gone or its bound
    passes (``until``: the effective kill grace + margin after the leader's exit, when the fork server
    must have killed every escapee). Pure: the caller passes the time. Main thread only."""

    def __init__(self, gone: Callable[[object], bool]) -> None:
        self._gone = gone
        self._held: dict[str, tuple[object, TaskResult, float]] = {}

    def hold(self, task_id: str, handle: object, result: TaskResult, until: float) -> None:
        self._held[task_id] = (handle, result, until)

    def due(self, now: float) -> list[tuple[str, TaskResult, bool]]:
        """The results that may go out now, with whether their tree is gone (removed from the hold)."""
        out = []
        for task_id, (handle, result, until) in list(self._held.items()):
            gone = self._gone(handle)
            if gone or now >= until:
                del self._held[task_id]
                out.append((task_id, result, gone))
        return out

    def __bool__(self) -> bool:
        return bool(self._held)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._held
