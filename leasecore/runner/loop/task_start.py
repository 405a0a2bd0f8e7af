"""The start of a task on the runner's main thread: a polled (or chained) task up to its running child.

Part of ``Runner`` (``leasecore.runner.loop.runner_base``). The pollers' threads and the reporter's sender
threads start a task's lease (``engine.track``: from the poll's send time, or the update-v2's for a task
claimed with a final update, ``leasecore.runner.chain``) and put a ``TaskPolled`` on the queue; here
the main thread decides: a second delivery of a task running here is not started twice; a next run
polled while the previous run's result is reported waits for that report; a surplus task, or one
claimed while stopping, goes straight back; a re-delivery whose previous holder may still run it,
or a retry whose earlier attempt's tree is dying here, is held (``leasecore.handover.StartGate``,
lease heartbeated); the rest start a child through the supervisor without waiting for its exec.
Ending tasks is ``task_end``'. Main thread only, except the ``_on_*`` callbacks named above.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable

from leasecore.errors import ProcessError
from leasecore.handover import may_run_elsewhere
from leasecore.lease import FenceReason, LeasePolicy
from leasecore.masking import MIN_MASKED_CHARS, Masker
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.secretenv import missing_metadata, missing_reason
from leasecore.process.spec import CommandSpec
from leasecore.runner.chain import hand_back
from leasecore.runner.loop.checkpoints import child_deadline, open_watch, resume_retry, start_line
from leasecore.runner.loop.events import ChainEnded, ChildExited, TaskPolled
from leasecore.runner.loop.status import InFlight, NextRun, Phase
from leasecore.runner.loop.task_end import SHUTDOWN_REASON, TaskEnds, _failed, fence_text
from leasecore.runner.ports import ChildPort, TaskTypePlan
from leasecore.snapshot import MAX_OUTPUT_LINES

log = logging.getLogger("conductor_run.runner")


class TaskStarts(TaskEnds):
    """Polled and chained tasks up to their running child (see the module docstring)."""

    def _on_surplus(self, task: Task, polled_at: float, *, poller: str) -> None:
        self._events.put(TaskPolled(task, polled_at, surplus=True, poller=poller))

    def _on_polled(self, task: Task, polled_at: float, *, poller: str = "") -> None:
        # On the poller's thread, for every task of the batch before any is spawned: the lease starts
        # at the poll's send time, so a task waiting for its spawn behind others (1000 at once) is
        # already heartbeated. A task delivered again while it runs here is re-tracked the same way
        # (the new poll reset the server's clock, and its pollCount is ours).
        policy = self._track_at_poll(task, polled_at)
        task = resume_retry(task, self._resume_port)  # (heartbeated meanwhile: tracked above)
        self._events.put(TaskPolled(task, polled_at, policy, poller=poller))

    def _on_chained(self, task: Task | None, sent_at: float, *, from_task: str, poller: str) -> None:
        # On a reporter's sender thread, once the update-v2 of ``from_task`` is answered (or failed):
        # the task it claimed is tracked from the update's send time, as a polled one from its poll's,
        # then handed to the main thread with the slot that task kept; none: the slot is freed.
        if task is None:
            self._events.put(ChainEnded(from_task))
            return
        policy = self._track_at_poll(task, sent_at)
        task = resume_retry(task, self._resume_port)
        self._events.put(TaskPolled(task, sent_at, policy, poller=poller, chained_from=from_task))

    def _track_at_poll(self, task: Task, polled_at: float) -> LeasePolicy | None:
        try:
            plan = self._plans.get(task.task_type) or next(iter(self._plans.values()))
            policy = plan.make_policy(task)
            self._engine.track(task, policy, polled_at=polled_at)
        except Exception:  # never lose the task: the main thread tracks it (or reports the failure)
            log.exception("task %s: could not start its lease at poll time", task.task_id)
            return None
        return policy

    def _on_task(
        self, task: Task, polled_at: float, policy: LeasePolicy | None = None, *, surplus: bool = False,
        chained: bool = False,
    ) -> None:
        """Run ``task`` (polled at ``polled_at``, or claimed by an update-v2 sent then: ``chained``),
        or hold it, queue it behind its previous run, or hand it back; its slot is held either way."""
        plan = self._plans.get(task.task_type) or next(iter(self._plans.values()))
        if (entry := self._tasks.get(task.task_id)) is not None and entry.phase is Phase.REPORTING and (
            task.poll_count > entry.task.poll_count
        ):
            # Its next run (a yield re-queued at once), polled before its report was acknowledged: it
            # starts once that report is done; its own lease (engine.track) holds it meanwhile.
            log.info("task %s polled again (pollCount %d) while its result is reported: running it "
                     "once that report is done", task.task_id, task.poll_count)
            self._keep_next_run(plan, task, polled_at, policy, surplus, chained)
            return
        if (
            entry is not None
            and task.poll_count > entry.task.poll_count
            and task.task_id not in self._yields
            and self._engine.fence_reason(task.task_id) is FenceReason.OWNERSHIP_LOST
        ):
            # Handed to us again while our copy is being killed for a lost ownership (say re-queued,
            # then polled by us): a new run, which starts once the dying copy is forgotten, and then
            # only once its tree is gone (StartGate). Dropping it left the server waiting on us till R.
            # (Not while a yield of the copy still waits to go out: that report would reach this
            # delivery; such a task is left to the branch below, as before.) No heartbeats meanwhile:
            # the copy's lease is fenced for good; the next run's own lease counts from its poll.
            log.info("task %s polled again (pollCount %d) while its earlier copy here is killed (no "
                     "longer ours): running it once that copy is gone", task.task_id, task.poll_count)
            self._keep_next_run(plan, task, polled_at, policy, surplus, chained)
            return
        if entry is None and policy is not None and task.poll_count != 1:
            # Tracked at poll time while an earlier run of it was still here (a next run replayed by
            # _forget, or a delivery whose event came after that run was forgotten): that track acked
            # the earlier run's lease, which may have ended with it. Without a lease of its own it
            # would run with no heartbeats and no fences. (pollCount 1: no earlier run.)
            try:
                self._engine.view(task.task_id)
            except KeyError:
                policy = None
        if task.task_id in self._tasks:
            # Delivered again while it runs here (a re-queue, a server hiccup): the running child
            # keeps the lease; starting a second copy would run one task twice at once.
            log.warning("task %s delivered again while it runs here: not starting it twice", task.task_id)
            entry = self._tasks[task.task_id]
            if task.poll_count > entry.task.poll_count:
                entry.task = task  # its pollCount is ours now (kept with a result saved for later)
            if policy is None and entry.tracked and entry.policy is not None:  # not re-tracked at poll
                self._engine.track(task, entry.policy, polled_at=polled_at)
            if not surplus:  # a surplus task took no slot and no budget
                self._pollers[plan.poll.task_type].release()
                self._budget.give_back(1)
            return
        if surplus:
            self._hand_back(task, plan)
            return
        entry = InFlight(task, plan, index=len(self._statuses), started_at=self._clock.now())
        entry.masker = self._secrets.for_task(plan.masker, task.runtime_metadata)
        self._secrets.enter(task.task_id, task.runtime_metadata.values())  # (left in _forget)
        if short := self._secrets.too_short(task.task_type, task.runtime_metadata):
            log.warning("task type %s: the runtime metadata value of %s is shorter than %d characters and "
                        "is not masked in what the runner writes", task.task_type, ", ".join(short),
                        MIN_MASKED_CHARS)
        self._tasks[task.task_id] = entry
        self._statuses.append(None)
        if policy is not None:  # tracked at poll time
            entry.policy, entry.tracked = policy, True
        if self._stopping_since is not None and chained:
            # Claimed by an update-v2 that was in flight when the stop began: back at once, unrun.
            log.warning("task %s (%s): claimed with a final update as the runner began to stop; handing "
                        "it back (re-queued at once)", task.task_id, task.task_type)
            if entry.tracked:
                self._engine.child_exited(task.task_id)
            self._report(entry, hand_back(task, plan.worker_id))
            return
        if self._stopping_since is not None:
            # Polled while stopping (a long poll was in flight): hand it straight back for a retry.
            self._end_unstarted(entry, (entry.policy or plan.make_policy(task)).start_delay_seconds,
                                held=False)
            return
        if entry.policy is None:
            entry.policy = plan.make_policy(task)
            self._engine.track(task, entry.policy, polled_at=polled_at)
            entry.tracked = True
        elif self._engine.fence_reason(task.task_id) is not None:  # fenced while in _next_runs
            self._end_unstarted(entry, entry.policy.start_delay_seconds, held=False)
            return
        here = ((e.task, e.child) for e in self._tasks.values() if e.child is not None)  # earlier attempts?
        # From now, not from the poll's send time (a long poll may have waited 5 s before the server
        # handed it out): the previous holder's fence counts from the hand-out, which is before now.
        now = self._clock.monotonic()
        why = self._gate.hold(task, now + entry.policy.start_delay_seconds, now, here)
        if why is not None:  # its lease is held (heartbeats) meanwhile
            entry.phase = Phase.WAITING
            self._engine.start_held(task.task_id)  # its exec timeout counts from the command's start
            self._metrics.on_task_held(task.task_type, True)  # it holds its slot meanwhile
            log.warning("task %s: not starting it yet: %s", task.task_id, why)
            return
        self._start_child(entry)

    def _keep_next_run(
        self, plan: TaskTypePlan, task: Task, polled_at: float, policy: LeasePolicy | None, surplus: bool,
        chained: bool,
    ) -> None:
        """Keep ``task`` as the next run of the entry it waits behind. One kept already (the task was
        delivered yet again meanwhile) is the same run: the newer delivery (by pollCount) replaces it
        and holds one slot; a second slot and budget taken go back (else each such delivery would keep
        a slot for ever)."""
        kept = NextRun(task, polled_at, policy, surplus, chained)
        older = self._next_runs.get(task.task_id)
        if older is not None:
            if older.task.poll_count > task.poll_count:  # (arrived out of order)
                kept, older = older, kept
            if not older.surplus and not kept.surplus:  # both took a slot and budget: one goes back
                self._pollers[plan.poll.task_type].release()
                self._budget.give_back(1)
            elif not older.surplus:  # the kept one took none: it takes over the other's
                kept = kept._replace(surplus=False)
        self._next_runs[task.task_id] = kept

    def _start_child(self, entry: InFlight) -> None:
        task, plan = entry.task, entry.plan
        task_id = task.task_id
        missing = missing_metadata(task.declared_metadata, plan.required_metadata, task.runtime_metadata)
        if missing:  # fail closed: without its secrets the command is not run, and a retry would not help
            self._refuse_unresolved(entry, missing)
            return

        def on_started(child: ChildPort) -> None:  # on the supervisor's reader thread, once the exec is done
            log.info("task %s (%s, workflow %s) started: pid %d", task_id, task.task_type,
                     task.workflow_id, child.pid)

        self._metrics.on_task_started(task.task_type)
        try:  # returns without waiting for the exec: the next event is handled meanwhile
            entry.child = self._supervisor.start(
                task, _spawn_spec(plan.spec, entry.policy, entry.masker), worker_id=plan.worker_id,
                on_lines=self._lines_sink(entry),
                on_done=lambda exit_: self._events.put(ChildExited(task_id, exit_)), on_started=on_started,
                deadline=self._child_deadline(entry),
            )  # fmt: skip
        except ProcessError as exc:  # known before asking the fork server (no such command, say)
            self._metrics.on_task_exited(task.task_type, exc, None, None)
            self._engine.child_exited(task.task_id)
            self._logs.close(task.task_id)
            self._report_not_started(entry, exc)
            return
        self._engine.child_started(task.task_id)
        entry.checkpoint = open_watch(task, entry.child)
        if (line := start_line(entry.checkpoint)) is not None and entry.log_lines is not None:
            # this run's log names what it resumed from (masked: the checkpoint is the child's data)
            entry.log_lines("stdout", [entry.masker.mask(line) if entry.masker else line])

    def _child_deadline(self, entry: InFlight) -> float | None:
        """CONDUCTOR_DEADLINE for a child started now: the earliest fence known in advance (the exec
        timeout from now; the task's timeoutSeconds, whose fence TERMs ahead of the server's deadline
        by the tree's grace + margin), as epoch seconds; None when there is none."""
        if entry.policy is None:
            return None
        hard = None
        if entry.tracked:
            try:
                hard = self._engine.view(entry.task.task_id).hard_deadline
            except KeyError:  # (forgotten meanwhile: no deadline to tell)
                hard = None
        return child_deadline(entry.policy, hard, self._clock.monotonic(), self._clock.now().timestamp())

    def _refuse_unresolved(self, entry: InFlight, missing: list[str]) -> None:
        """A task whose declared (or required) runtime metadata the server did not resolve: its
        command is not run; it ends FAILED_WITH_TERMINAL_ERROR naming what is missing (no value)."""
        task = entry.task
        reason = missing_reason(missing, task.declared_metadata)
        log.error("task %s (%s): %s", task.task_id, task.task_type, reason)
        if entry.tracked:
            self._engine.child_exited(task.task_id)
        self._logs.close(task.task_id)
        self._report(entry, TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED_WITH_TERMINAL_ERROR,
                                       reason_for_incompletion=reason, worker_id=entry.plan.worker_id))

    def _start_released(self) -> None:
        for task in self._gate.due(self._clock.monotonic()):
            entry = self._tasks.get(task.task_id)
            if entry is not None and entry.phase is Phase.WAITING:
                entry.phase = Phase.RUNNING
                self._metrics.on_task_held(task.task_type, False)
                log.info("task %s: its previous holder must have stopped by now: starting it", task.task_id)
                self._start_child(entry)

    def _end_unstarted(self, entry: InFlight, wait_left: float, *, held: bool = True) -> None:
        """A task fenced (or stopped) before its command started: report it, or nothing if lost.

        One whose previous holder may still run it (``may_run_elsewhere``) goes back as an unmarked
        IN_PROGRESS, re-queued no sooner than ``wait_left`` (the hold time left): FAILED would make
        the server create a retry at once that nobody waits for (two copies, and a retry spent)."""
        task = entry.task
        if entry.tracked:
            self._engine.child_exited(task.task_id)
            entry.fence = self._engine.fence_reason(task.task_id)
        if held:  # its fence (if any) counts: conductor_run_fences_total
            self._metrics.on_task_held(task.task_type, False, entry.fence)
        if entry.fence is FenceReason.OWNERSHIP_LOST:
            log.warning("task %s: no longer ours before it started; nothing is reported", task.task_id)
            self._forget(entry, None)
            return
        why = fence_text(entry.fence, task, entry) or SHUTDOWN_REASON
        if may_run_elsewhere(task):
            seconds = max(0, math.ceil(wait_left))
            log.warning("task %s: %s before its command started; its previous holder may still run it: "
                        "handing it back (re-queued in %d s, its next holder waits too)", task.task_id,
                        why, seconds)
            self._report(entry, TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                                           callback_after_seconds=seconds, worker_id=entry.plan.worker_id))
            return
        self._report(entry, _failed(task, entry.plan, f"{why} (before its command started)" if held else why))

    def _hand_back(self, task: Task, plan: TaskTypePlan) -> None:
        """A task polled beyond our slots and budget: never dropped (the server counts it as ours until
        R), but re-queued at once for any worker (``leasecore.runner.chain.hand_back``: IN_PROGRESS
        with callbackAfterSeconds 0, no retry spent). Not tracked: no lease, no entry."""
        log.warning("task %s (%s): polled beyond this runner's slots and task budget; handing it back "
                    "to the server (re-queued at once)", task.task_id, task.task_type)
        self._handing_back.add(task.task_id)
        self._reporter.submit(hand_back(task, plan.worker_id), retry_seconds=5.0, poll_count=task.poll_count,
                              task_type=task.task_type)

    def _lines_sink(self, entry: InFlight) -> Callable[[str, list[str]], None]:
        send = entry.log_lines = self._logs.open_lines(entry.task.task_id)
        tail = entry.tail

        def on_lines(stream: str, lines: list[str]) -> None:  # on a reader thread: no blocking here
            for line in lines[-MAX_OUTPUT_LINES:]:  # the tail keeps no more
                tail.append(line)
            send(stream, lines)

        return on_lines


def _spawn_spec(spec: CommandSpec, policy: LeasePolicy | None, masker: Masker | None = None) -> CommandSpec:
    """``spec`` with the policy's effective (capped) kill grace: the fork server's own TERM -> KILL of
    a tree's escapees, after its leader exits, follows the cap the lease's fences do; and with the
    task's ``masker`` (its secret values masked in the child's output)."""
    if masker and spec.masker is not masker:  # the task's own values
        spec = dataclasses.replace(spec, masker=masker)
    grace = spec.kill_grace_seconds
    if policy is None:
        return spec
    capped = min(grace, policy.effective_kill_grace_seconds)
    return spec if capped == grace else dataclasses.replace(spec, kill_grace_seconds=capped)
