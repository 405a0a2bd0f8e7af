"""The end of a task on the runner's main thread: fences, the child's exit, its result and report.

``TaskEnds``, one of the runner's parts (``runner.Runner`` builds them, handing each the shared
``table.TaskTable`` and the ports it needs): a fence from the lease engine stops the tree (or ends a
task held before its command started); the child's exit becomes a result, by what it means
(``decisions.exit_meaning``/``report_meaning``: forget, report now, or hold a yield or a FAILED in
``YieldHold`` until its tree is gone); the result goes to the reporter; the reporter's outcome
forgets the task (its heartbeats stop only then) and hands its next run, if one was polled
meanwhile, back to admission. A final update that may claim the next task (``leasecore.runner.chain``)
keeps its slot for it: the claimed task arrives as a ``TaskPolled`` with ``chained_from`` before the
report's outcome, or ``ChainEnded`` frees the slot. ``ChainUpdates`` is the reporter's port for it.
Main thread only, except ``ChainUpdates`` (sender threads). Starting tasks is ``task_start``'.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ProcessError
from leasecore.handover import StartGate, YieldHold, mark_yield, may_run_elsewhere, with_checkpoint
from leasecore.lease import FenceAction, FenceReason, KillTree, TerminateTree
from leasecore.lease.finalfailure import report_budget
from leasecore.masking import mask_result
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.results.reasons import exit_rule
from leasecore.process.spec import ChildExit, CommandSpec
from leasecore.runner.chain import may_chain
from leasecore.runner.fdbudget import FD_SHORT_REQUEUE_SECONDS, handed_back, out_of_fds
from leasecore.runner.leasing.finalupdates import FinalUpdates
from leasecore.runner.loop.decisions import (
    ExitMeaning,
    HoldOver,
    ReportCheck,
    ReportMeaning,
    Unstarted,
    exit_meaning,
    hold_over,
    report_check,
    report_meaning,
    unstarted_meaning,
)
from leasecore.runner.loop.status import InFlight, NextRun, Phase, undelivered_snapshot
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.ports import ChainPort, EnginePort, TaskReader, TaskTypePlan
from leasecore.runner.secretbook import SecretBook
from leasecore.runner.upstream.logsink import ENTRY_STREAM, LogStreamer
from leasecore.runner.upstream.poller import Poller
from leasecore.runner.upstream.reporter import OnChained, Reporter, ReportOutcome

log = logging.getLogger("conductor_run.runner")

SHUTDOWN_REASON = "worker shutting down"
_UNDELIVERED_SHOWN = 100  # results waiting in the outbox that status lists (the newest)
_YIELD_SLACK_SECONDS = 1.0  # a yield's tree is waited for up to its grace + margin + this (YieldHold)
# A server deadline's fence first decided this long past its TERM point: the runner did not run then
# (its timer fences within milliseconds when it runs), it was stalled.
_STALL_SECONDS = 1.0
_SERVER_FENCES = (FenceReason.LEASE_EXPIRED, FenceReason.HARD_TIMEOUT)


class ToResult(Protocol):
    """``leasecore.process.to_task_result`` as the runner calls it (``exit_``: a ChildExit)."""

    def __call__(
        self, task: Task, exit_: ChildExit, spec: CommandSpec, worker_id: str, *, timed_out: bool = False
    ) -> TaskResult: ...


class ChainedHook(Protocol):
    """``TaskStarts.on_chained``: the task an update-v2 claimed (None: nothing), on a sender thread."""

    def __call__(self, task: Task | None, sent_at: float, *, from_task: str, poller: str) -> None: ...


class ChainUpdates:
    """The reporter's update port with update-v2: ``FinalUpdates``' guard around either endpoint, so
    no heartbeat of the task overlaps or follows its final update, whichever carries it. It holds a
    ``FinalUpdates`` (not a subclass of it). On the reporter's sender threads."""

    def __init__(self, port: ChainPort, engine: EnginePort, *, reader: TaskReader | None = None,
                 clock: Clock | None = None, sleep: Callable[[float], None] = time.sleep,
                 observer: Observer = NO_METRICS) -> None:  # fmt: skip
        self._clock = clock or SystemClock()
        self._final = FinalUpdates(port, engine, reader=reader, clock=self._clock, sleep=sleep,
                                   observer=observer)  # fmt: skip
        self._port = port

    @property
    def reader(self) -> TaskReader | None:
        """What reads a task back: the reporter reads an update of unknown fate back with it before it
        sends it again (the guard keeps the task's beats held until then)."""
        return self._final.reader

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self._final.update(result, timeout_seconds=timeout_seconds)

    def update_v2(self, result: TaskResult, *, timeout_seconds: float | None = None) -> Task | None:
        return self.update_v2_timed(result, timeout_seconds=timeout_seconds)[0]

    def update_v2_timed(self, result: TaskResult, *, timeout_seconds: float | None = None
                        ) -> tuple[Task | None, float]:  # fmt: skip
        """``update_v2`` and when it went out: after the wait for a heartbeat in flight, which must not
        come off the claimed task's lease. A parked result goes out through v1 and claims nothing."""
        def send() -> tuple[Task | None, float]:
            sent_at = self._clock.monotonic()
            return self._port.update_v2(result, timeout_seconds=timeout_seconds), sent_at

        return self._final.guarded(result, send, timeout_seconds=timeout_seconds,
                                   send_parked=lambda: self._v1(result, timeout_seconds))  # fmt: skip

    def _v1(self, result: TaskResult, timeout_seconds: float | None) -> tuple[None, float]:
        sent_at = self._clock.monotonic()
        self._port.update(result, timeout_seconds=timeout_seconds)
        return None, sent_at


class TaskEnds:
    """Fences, exits, results and reports of the runner's tasks (see the module docstring)."""

    def __init__(
        self, table: TaskTable, *, clock: Clock, metrics: Observer, engine: EnginePort, reporter: Reporter,
        logs: LogStreamer, pollers: dict[str, Poller], gate: StartGate, to_result: ToResult, chaining: bool,
        secrets: SecretBook, chained: ChainedHook, replay: Callable[[NextRun], None],
    ) -> None:
        """``chained(task, sent_at, from_task=, poller=)``: called on a reporter's sender thread with
        the task an update-v2 claimed (``TaskStarts.on_chained``); ``replay(run)``: a next run whose
        earlier run was just forgotten is admitted again (``TaskStarts.admit``)."""
        self._t = table
        self._clock, self._metrics, self._engine, self._reporter = clock, metrics, engine, reporter
        self._logs, self._pollers, self._gate, self._to_result = logs, pollers, gate, to_result
        self._chaining, self._secrets, self._on_chained, self._replay = chaining, secrets, chained, replay
        self._yields = YieldHold(_tree_gone)  # yields and FAILEDs waiting for their tree to be gone

    def holding(self) -> bool:
        """Results wait for their tree to be gone (the loop looks again soon)."""
        return bool(self._yields)

    def held_for_tree(self, task_id: str) -> bool:
        """The result of ``task_id`` waits for its tree to be gone."""
        return task_id in self._yields

    def on_fence(self, task_id: str, action: FenceAction) -> None:
        entry = self._t.tasks.get(task_id)
        start_at = self._gate.start_at(task_id)
        held = self._gate.drop(task_id)
        if entry is not None and (held or (entry.phase is Phase.WAITING and entry.child is None)):
            # fenced before its command started (held, or its hold over and its read-back in flight)
            self.end_unstarted(entry, (start_at or 0.0) - self._clock.monotonic())
            return
        if entry is None or entry.child is None:
            return
        if isinstance(action, TerminateTree) and action.reason in _SERVER_FENCES and action.at is not None:
            late = self._clock.monotonic() - action.at  # (its timer fences within milliseconds when it runs)
            if late > _STALL_SECONDS and entry.stalled_seconds is None:
                entry.stalled_seconds = late  # it did not run at the TERM point: it was stalled
        if entry.phase is Phase.REPORTING:
            return
        self._gate.dying.add(entry.task, entry.child)  # a retry polled meanwhile waits for this tree
        if entry.child.ended_by_switch:  # resumed after a stall: the switch did it
            entry.phase = Phase.STOPPING
            return
        kill = isinstance(action, KillTree)
        log.warning("task %s: %s the process tree (%s)", task_id, "killing" if kill else "terminating",
                    action.reason.value.replace("_", " "))
        entry.phase = Phase.STOPPING
        try:
            if isinstance(action, TerminateTree):  # its KILL counts from the fence's own time
                since = action.at if isinstance(self._clock, SystemClock) else None  # a shared clock
                entry.child.terminate_tree(since=since, grace_seconds=action.grace_seconds)
            else:
                entry.child.kill_tree()
        except ProcessError as exc:
            log.error("task %s: could not signal the process tree: %s", task_id, exc)

    def on_child_exited(self, task_id: str, exit_: ChildExit | None) -> None:
        entry = self._t.tasks.get(task_id)
        if entry is None:
            return
        times = self._engine.lease_times(task_id)  # (one look: its fence and deadlines before the exit)
        fenced_before = None if times is None else times[0]
        late = None if times is None else self._past_term_point(entry, times[1], times[2])
        entry.fence = self._engine.child_exited(task_id)  # (its fence, read in the same step)
        if entry.child is not None:
            self._gate.dying.add(entry.task, entry.child)  # escapees may outlive the child
        if fenced_before is None and entry.fence in _SERVER_FENCES and (late or 0.0) > _STALL_SECONDS:
            # Its TERM point passed long ago and this process never fenced it: it did not run then.
            entry.stalled_seconds = late
        entry.ended_by_switch = entry.child is not None and entry.child.ended_by_switch
        if entry.child is not None and entry.ended_by_switch:  # the fork server fenced it alone: this
            late = entry.child.switch_late_seconds  # process did not run in time
            log.warning("task %s: the lease ran out while the runner was stalled; the fork server's "
                        "dead-man's switch ended the tree on time%s", task_id,
                        "" if late is None else f" (it acted {late * 1000:.0f} ms after its point)")
            self._metrics.on_switch_fenced(entry.task.task_type, entry.fence)
        self._metrics.on_task_exited(entry.task.task_type, exit_, entry.fence,
                                     _success_code(entry.plan.spec, exit_))
        start_error = None if exit_ is None else exit_.start_error  # the command never ran (an exec failed)
        meaning = exit_meaning(ownership_lost=entry.fence is FenceReason.OWNERSHIP_LOST,
                               start_error=start_error is not None)
        if meaning is ExitMeaning.NOT_STARTED:
            self._logs.close(task_id)
            self.report_not_started(entry, start_error)
            return
        if meaning is ExitMeaning.FORGET:
            self._logs.close(task_id)
            log.warning("task %s: no longer ours on the server (cancelled, timed out or re-assigned); "
                        "its tree was killed and nothing is reported", task_id)
            self.forget(entry, None)
            return
        result = self._stream_result_logs(entry, _masked(entry, self._result_for(entry, exit_)))
        self._take_final_checkpoint(entry, exit_)
        self._logs.close(task_id)
        why = f" ({result.reason_for_incompletion})" if result.reason_for_incompletion else ""
        log.info("task %s: child exited; reporting %s%s", task_id, result.status.value, why)
        # A yield is marked (its next holder starts at once) only once the whole tree is gone; a FAILED
        # makes the server create the retry at once, for any worker on any host: both wait meanwhile,
        # lease heartbeated, up to the tree's grace + margin (escapees die kill_grace after the exit).
        gone = entry.child is None or _tree_gone(entry.child)
        step = report_meaning(result.status, tree_gone=gone)
        if step is ReportMeaning.HOLD:
            self._hold_until_gone(entry, result)
        elif step is ReportMeaning.REPORT_YIELD:
            self.report(entry, mark_yield(result, entry.task.poll_count))
        else:
            self.report(entry, result)

    def _past_term_point(self, entry: InFlight, lease_deadline: float | None,
                         hard_deadline: float | None) -> float | None:
        """How long ago the lease's earliest server deadline's TERM point passed (None: not known)."""
        if entry.policy is None or (lease_deadline is None and hard_deadline is None):
            return None
        first = min(d for d in (lease_deadline, hard_deadline) if d is not None)
        return self._clock.monotonic() - (first - entry.policy.fence_lead_seconds)

    def _hold_until_gone(self, entry: InFlight, result: TaskResult) -> None:
        """Keep ``result`` (a yield, or a FAILED the server retries at once) until the tree is gone, lease
        heartbeated, up to the tree's effective grace + margin (the fork server kills escapees by then)."""
        lead = entry.policy.fence_lead_seconds if entry.policy else entry.plan.kill_grace_seconds
        until = self._clock.monotonic() + lead + _YIELD_SLACK_SECONDS
        log.info("task %s: its tree is not gone yet: reporting %s once it is", entry.task.task_id,
                 result.status.value)
        self._yields.hold(entry.task.task_id, entry.child, result, until)

    def report_yields(self) -> None:
        if not self._yields:
            return
        for task_id, result, gone in self._yields.due(self._clock.monotonic()):
            entry = self._t.tasks.get(task_id)
            if entry is None:
                continue
            step = hold_over(result.status, tree_gone=gone)
            if step is HoldOver.REPORT_ANYWAY:
                log.warning("task %s: its tree outlived its grace; reporting %s anyway", task_id,
                            result.status.value)
            elif step is HoldOver.REPORT_YIELD:
                result = mark_yield(result, entry.task.poll_count)
            elif step is HoldOver.REPORT_UNMARKED:
                log.warning("task %s: its tree outlived its grace; reporting IN_PROGRESS without the yield "
                            "marker, so its next holder waits", task_id)
            self.report(entry, result)

    def report_not_started(self, entry: InFlight, why: object) -> None:
        if out_of_fds(why):  # this runner's shortage, not the task's: it goes back, no retry spent
            log.warning("task %s: could not start the command: %s; handing it back (re-queued in %d s)",
                        entry.task.task_id, why, FD_SHORT_REQUEUE_SECONDS)
            self.report(entry, handed_back(entry.task, entry.plan.worker_id))
            return
        log.error("task %s: could not start the command: %s", entry.task.task_id, why)
        self.report(entry, _failed(entry.task, entry.plan, f"could not start the command: {why}"))

    def _result_for(self, entry: InFlight, exit_: ChildExit | None) -> TaskResult:
        task, plan = entry.task, entry.plan
        if exit_ is None:
            return _failed(task, plan, "lost track of the child process")
        # An exec timeout is the process layer's own wording ("exec timeout after Ns"), with the
        # child's output kept; any other fence overrides the status and reason.
        timed_out = entry.fence is FenceReason.EXEC_TIMEOUT
        result = self._to_result(task, exit_, plan.spec, plan.worker_id, timed_out=timed_out)
        reason = None if timed_out else fence_text(entry.fence, task, entry)
        if reason is None:
            return result
        return dataclasses.replace(result, status=TaskStatus.FAILED, reason_for_incompletion=reason,
                                   callback_after_seconds=0)

    def _stream_result_logs(self, entry: InFlight, result: TaskResult) -> TaskResult:
        """A result's own log lines (the stdio protocol's ``logs``) go to the task log the way the
        child's stderr went, after it: an update keeps only its first 10 (CONDUCTOR_PROTOCOL.md §6)."""
        if not result.logs:
            return result
        if entry.log_lines is not None:
            # One entry of the task's log per item, as written (no prefix), as conductor-cli sends them.
            entry.log_lines(ENTRY_STREAM, [line.log for line in result.logs])
        return dataclasses.replace(result, logs=())

    def _take_final_checkpoint(self, entry: InFlight, exit_: ChildExit | None) -> None:
        """What the checkpoint file held at the exit: the last word (logged if new; an unusable file
        is said in the log and the last valid checkpoint stands)."""
        read = None if exit_ is None else exit_.checkpoint
        if entry.checkpoint is None or read is None:
            return
        line = entry.checkpoint.take(read)
        if line is not None and entry.log_lines is not None:  # masked: the checkpoint is the child's data
            entry.log_lines("stdout", [entry.masker.mask(line) if entry.masker else line])

    def report(self, entry: InFlight, result: TaskResult) -> None:
        if result.task_id == entry.task.task_id:  # every update for it carries its last checkpoint
            watch = entry.checkpoint
            result = with_checkpoint(result, watch.value if watch is not None and watch.text is not None
                                     else entry.task.checkpoint)
        result = _masked(entry, result)  # whatever made it: no known secret goes out or to the outbox
        chain: OnChained | None = None
        if entry.slot_held:  # the child is gone: another may start while this one reports
            entry.slot_held = False
            poller = self._pollers[entry.plan.poll.task_type]
            if self._may_chain(entry, result) and poller.keep_for_chain():
                entry.chain_slot = True  # kept for the task its update-v2 claims (ChainEnded: none)
                chain = functools.partial(self._on_chained, from_task=entry.task.task_id,
                                          poller=entry.plan.poll.task_type)
            else:
                entry.report_held = True
                poller.reporting()
        entry.phase = Phase.REPORTING  # (a yield was marked by _yield, once its tree was gone)
        entry.result_status = result.status
        opts = self._t.options
        seconds = report_budget(forced=self._t.forced, lease_expired=entry.fence is FenceReason.LEASE_EXPIRED,
                                stopping=self._t.stopping_since is not None,
                                retry_seconds=opts.report_retry_seconds,
                                shutdown_retry_seconds=opts.shutdown_report_retry_seconds)  # fmt: skip
        self._metrics.on_result(entry.task.task_type, result)
        # after a lease that ran out, only if the task is still ours (not another runner's delivery now)
        read_first = report_check(entry.fence) is ReportCheck.READ_FIRST
        self._reporter.submit(result, retry_seconds=seconds, poll_count=entry.task.poll_count,
                              task_type=entry.task.task_type, on_chained=chain, read_first=read_first)

    def _may_chain(self, entry: InFlight, result: TaskResult) -> bool:
        enabled = self._chaining and bool(getattr(self._reporter, "chaining", False))
        return may_chain(result, stopping=self._t.stopping_since is not None or self._t.forced,
                         fence=entry.fence, enabled=enabled)

    def on_chain_ended(self, task_id: str) -> None:
        """The update-v2 of ``task_id`` claimed nothing: its kept slot is free, its report waits."""
        entry = self._t.tasks.get(task_id)
        if entry is not None and entry.chain_slot:
            entry.chain_slot = False
            entry.report_held = True
            self._pollers[entry.plan.poll.task_type].chain_ended()

    def take_chain_slot(self, task_id: str) -> None:
        """The task claimed by the update-v2 of ``task_id`` takes over its kept slot."""
        entry = self._t.tasks.get(task_id)
        if entry is not None:
            entry.chain_slot = False

    def on_reported(self, outcome: ReportOutcome) -> None:
        if outcome.task_id in self._t.handing_back:
            self._t.handing_back.discard(outcome.task_id)
            return
        entry = self._t.tasks.get(outcome.task_id)
        if entry is None:
            return
        status = outcome.sent_status or entry.result_status  # a bare FAILED if the result was refused
        if outcome.delivered and status is not None:
            log.debug("task %s: reported %s", outcome.task_id, status.value)  # INFO: start, result
        if outcome.saved_to is not None:
            self._t.undelivered[outcome.task_id] = (outcome.saved_to, undelivered_snapshot(entry))
            while len(self._t.undelivered) > _UNDELIVERED_SHOWN:
                del self._t.undelivered[next(iter(self._t.undelivered))]
        self.forget(entry, status if outcome.delivered else None)

    def forget(self, entry: InFlight, status: TaskStatus | None) -> None:
        if entry.tracked:
            # Only now do this run's heartbeats stop (never those of the task's next delivery).
            self._engine.reported(entry.task.task_id, poll_count=entry.task.poll_count)
        self._release_slot(entry)
        self._metrics.on_task_done(entry.task.task_type, status, entry.fence)
        del self._t.tasks[entry.task.task_id]
        self._secrets.leave(entry.task.task_id)  # (entered when its entry was made)
        self._t.tally.end(entry.index, status)
        if (run := self._t.next_runs.pop(entry.task.task_id)) is not None:
            self._replay(run)  # (its lease may have ended with this run's: admission tracks it again then)

    def end_unstarted(self, entry: InFlight, wait_left: float, *, held: bool = True,
                      why: str | None = None) -> None:
        """A task fenced (or stopped) before its command started: report it, or nothing if lost.

        One whose previous holder may still run it (``may_run_elsewhere``) goes back as an unmarked
        IN_PROGRESS, re-queued no sooner than ``wait_left`` (the hold time left): FAILED would make
        the server create a retry at once that nobody waits for (two copies, and a retry spent).
        ``why``: the reason when its lease was not fenced (yet); else the stop's."""
        task = entry.task
        if entry.tracked:
            entry.fence = self._engine.child_exited(task.task_id)
        if held:  # its fence (if any) counts: conductor_run_fences_total
            self._metrics.on_task_held(task.task_type, False, entry.fence)
        meaning = unstarted_meaning(ownership_lost=entry.fence is FenceReason.OWNERSHIP_LOST,
                                    may_run_elsewhere=may_run_elsewhere(task))
        if meaning is Unstarted.FORGET:
            log.warning("task %s: no longer ours before it started; nothing is reported", task.task_id)
            self.forget(entry, None)
            return
        why = fence_text(entry.fence, task, entry) or why or SHUTDOWN_REASON
        if meaning is Unstarted.HAND_BACK:
            seconds = max(0, math.ceil(wait_left))
            log.warning("task %s: %s before its command started; its previous holder may still run it: "
                        "handing it back (re-queued in %d s, its next holder waits too)", task.task_id,
                        why, seconds)
            self.report(entry, TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                                          callback_after_seconds=seconds, worker_id=entry.plan.worker_id))
            return
        self.report(entry, _failed(task, entry.plan, f"{why} (before its command started)" if held else why))

    def _release_slot(self, entry: InFlight) -> None:
        if entry.slot_held:
            entry.slot_held = False
            self._pollers[entry.plan.poll.task_type].release()
        if entry.chain_slot:  # (never: the chain ends before the report's outcome; kept for safety)
            entry.chain_slot = False
            self._pollers[entry.plan.poll.task_type].chain_ended()
            entry.report_held = True
        if entry.report_held:
            entry.report_held = False
            self._pollers[entry.plan.poll.task_type].reported()


def _success_code(spec: CommandSpec, exit_: ChildExit | None) -> int | None:
    """The non-zero exit code that is no execute error for the metrics: the exit's own when the
    exit-code policy maps it to COMPLETED or IN_PROGRESS, else the spec's ``in_progress_exit_code``."""
    code = None if exit_ is None else exit_.exit_code
    rule = exit_rule(spec, code)
    if rule is not None and rule.status in (TaskStatus.COMPLETED, TaskStatus.IN_PROGRESS):
        return code
    return spec.in_progress_exit_code
def _masked(entry: InFlight, result: TaskResult) -> TaskResult:
    """``result`` with the task's secret values masked: output values (keys too), reason, logs."""
    masker = entry.masker
    if not masker:
        return result
    return mask_result(masker, result)


def _tree_gone(child: Any) -> bool:  # a ChildPort, held by leasecore.handover as an opaque object
    return bool(child.wait_gone(0))


def _failed(task: Task, plan: TaskTypePlan, reason: str) -> TaskResult:
    return TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                      reason_for_incompletion=reason, worker_id=plan.worker_id)


def fence_text(fence: FenceReason | None, task: Task, entry: InFlight) -> str | None:
    """The reasonForIncompletion for a task whose tree was fenced (None: not fenced)."""
    if fence is None:
        return None
    if fence is FenceReason.SHUTDOWN:
        return SHUTDOWN_REASON
    if fence is FenceReason.EXEC_TIMEOUT:
        seconds = entry.policy.exec_timeout_seconds if entry.policy else 0
        return f"exec timeout after {seconds:g}s" if seconds else "exec timeout"
    what = (f"hard timeout: the task's timeoutSeconds ({task.timeout_seconds}s) passed"
            if fence is FenceReason.HARD_TIMEOUT else "lease expired")
    # not the runner: its fork server, on its own (leasecore.process.forkserver.deadman)
    if entry.ended_by_switch:
        return (f"{what} while the runner was stalled (its process did not run): the fork server's "
                "dead-man's switch ended the tree by the lease's deadline")
    if entry.stalled_seconds is not None:  # nor its switch (the fork server was gone or stopped too)
        return (f"{what} while the runner was stalled (its process did not run until "
                f"{entry.stalled_seconds:.1f}s past the lease's TERM point); the tree was killed then")
    if fence is FenceReason.HARD_TIMEOUT:
        return f"hard timeout: the task's timeoutSeconds ({task.timeout_seconds}s) passed"
    if fence is FenceReason.LEASE_EXPIRED:
        return "lease expired: no heartbeat was acknowledged within the heartbeat timeout"
    return f"fenced: {fence.value}"
