"""The final-update half of a simulated runner's driver: reports, retries, the outbox.

Owns ``Reports``: a run's result goes out once no heartbeat of the run is in flight, and after a
heartbeat of unknown fate by the product's own plan (``finalcheck.plan_final_update`` on the engine
core's ``late_beats``, as ``FinalUpdates`` does: a terminal result is parked, then sent
at ``parked_send_at``; a yield is read back; the ``no_final_wait`` bug skips the plan); through
update-v2 when the real ``may_chain`` says so (the slot is kept for what it claims); retried while
the lease lasts, kept in the state dir's outbox otherwise and delivered later after a read-back
judged by the real ``ownership_lost_reason``. A run fenced before its command started goes back as
the product's ``_end_unstarted`` does (an unmarked IN_PROGRESS when its previous holder may still run it).

The decisions are the product's (``finalfailure``, ``finalcheck``, ``may_chain``, ``report_check``);
the order they are carried out in is written after ``FinalUpdates.guarded``, the reporter and the
outbox (a change to one must be made in both; docs/simulator.md, the cores and their drivers).

Threads: none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from leasecore.lease import FenceReason, finalcheck
from leasecore.lease.finalcheck import read_back_at
from leasecore.lease.finalfailure import (
    REPORT_BACKOFF,
    Attempt,
    Delivered,
    FallBackToV1,
    GiveUp,
    ReadBack,
    Retry,
    Save,
    SendBare,
    after_read_back,
    decide,
    failure_of_status,
    lost_lease_read,
    saved_result_lost_reason,
    transport_may_resend,
)
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.chain import hand_back, may_chain
from leasecore.runner.leasing.core import BeatWaitOver, BeginFinalUpdate, FinalUpdateFailed, Reported
from leasecore.runner.loop.decisions import ReportCheck, report_check
from leasecore.sim.conductor import Answer
from leasecore.sim.setting import Run, RunnerPort

__all__ = ["HAND_BACK_RETRY_SECONDS", "Reports", "result_body"]

HAND_BACK_RETRY_SECONDS = 5.0  # the product's retry budget of a hand-back (``TaskStarts._hand_back``)


def result_body(result: TaskResult) -> dict[str, object]:
    body: dict[str, object] = {"taskId": result.task_id, "workflowInstanceId": result.workflow_id,
                               "status": result.status.value, "outputData": dict(result.output_data),
                               "callbackAfterSeconds": result.callback_after_seconds}
    if result.reason_for_incompletion:
        body["reasonForIncompletion"] = result.reason_for_incompletion
    if result.worker_id:
        body["workerId"] = result.worker_id
    return body


class Reports:
    """One runner incarnation's final updates."""

    def __init__(self, runner: RunnerPort) -> None:
        self.runner = runner
        self.world = runner.world
        self._outbox_armed = False
        self._attempts: dict[str, int] = {}  # task id -> attempts of its final update (the backoff's)

    def report(self, run: Run, result: TaskResult) -> None:
        r = self.runner
        run.phase = "reporting"
        self._attempts.pop(result.task_id, None)
        chain = r.config.chaining and may_chain(result, stopping=r.stopping, fence=run.fence,
                                                    enabled=True)
        if run.slot:  # the child is gone: its slot is free (or kept for what update-v2 claims)
            run.slot = False
            if chain and r.keep_for_chain():  # (the poller's word: not while paused or stopping)
                run.chain_slot = True
            else:  # free for another task; the report counts against those waiting (Poller.reporting)
                chain = False
                run.report_held = True
                r.reporting_started()
        if report_check(run.fence) is ReportCheck.READ_FIRST:  # the product's read-first, as the reporter's
            self._read_first(run, result, chain)
            return
        self._send(run, result, chain)

    def _read_first(self, run: Run, result: TaskResult, chain: bool) -> None:
        """A result of a lease that ran out goes out only if the task read back is still ours
        (``finalfailure.lost_lease_read``); a failed read keeps it in the outbox (no budget is left
        here after a lost lease, as in ``_send``), which reads back before it sends."""
        r, tid, pc = self.runner, result.task_id, run.task.poll_count

        def got(answer: Answer) -> None:
            if run.phase != "reporting":
                return
            if not (answer.ok or answer.status == 404):
                r.state.outbox[tid] = (result, pc)
                r.forget(run)
                self.arm_outbox()
                return
            own = TaskOwnership(TaskStatus(answer.body[0]), *answer.body[1:3]) if answer.ok else None
            if isinstance(verdict := lost_lease_read(own, pc), GiveUp):
                self.world.log(f"runner {r.name}: {tid}: lease over, not reported: {verdict.reason}")
                r.forget(run)
                return
            self._send(run, result, chain)

        r.server.read(r.name, tid, r.reply(got), r.config.http_timeout)

    def _send(self, run: Run, result: TaskResult, chain: bool) -> None:
        """One attempt of ``result``'s final update, as ``FinalUpdates.guarded`` makes it: the task's
        heartbeats excluded (``BeginFinalUpdate``), then, after a heartbeat of unknown fate the engine
        core knows (``late_beats``), the product's plan: a terminal result parked first and sent at
        ``parked_send_at``, a yield sent at once and read back once the beat can no longer land."""
        r = self.runner
        if run.phase != "reporting":
            return
        tid, poll_count = result.task_id, run.task.poll_count
        nxt = r.next_runs.get(tid)
        if (result.status is TaskStatus.IN_PROGRESS and nxt is not None and nxt[0].poll_count > poll_count
                and not r.bugs.retry_landed_yield):
            self.world.log(f"runner {r.name}: {tid}: its next run was polled, so the yield landed")
            r.state.outbox.pop(tid, None)
            r.step(Reported(tid))
            r.forget(run)
            return
        r.step(BeginFinalUpdate(tid))
        self._attempts[tid] = self._attempts.get(tid, 0) + 1
        self._plan(run, result, chain)

    def _plan(self, run: Run, result: TaskResult, chain: bool) -> None:
        """Once no heartbeat of the task calls (the core said ``AwaitBeat``: its answer or its timeout
        ends it; no new one starts meanwhile), ``BeatWaitOver``, then the product's plan."""
        r, now, tid, poll_count = self.runner, self.world.now, result.task_id, run.task.poll_count
        if run.phase != "reporting":
            return
        if r.engine.beat_calling(tid):
            self.world.after(0.05, "report-wait", r.guard(lambda: self._plan(run, result, chain)))
            return
        r.step(BeatWaitOver(tid))
        # (the planted race: the product's rule is not applied, the result goes out at once)
        late = None if r.bugs.no_final_wait else r.engine.late_beats(tid)
        plan = finalcheck.plan_final_update(result.status, None if late is None else late.until, now)
        if not plan.park:
            self._put(run, result, chain, late)
            return
        self.world.log(f"runner {r.name}: {tid}: a heartbeat of unknown fate may land until "
                       f"{plan.send_at:.3f}: parked, then {result.status.value}")
        park = TaskResult(tid, result.workflow_id, TaskStatus.IN_PROGRESS, output_data=result.output_data,
                          callback_after_seconds=finalcheck.PARK_CALLBACK_SECONDS, worker_id=result.worker_id)
        sent = now

        def parked(answer: Answer) -> None:
            if run.phase != "reporting":
                return
            if not answer.ok:  # as the product's: the park's failure is this attempt's
                self._failed(run, result, chain, answer, sent)
                return
            at = finalcheck.parked_send_at(plan, self.world.now)
            # A parked result goes out through v1 and claims nothing (``ChainUpdates``).
            self.world.at(at, "parked-send", r.guard(lambda: self._put(run, result, False, late)))

        self.server_update(tid, poll_count, park, False, r.reply(parked), park=True)

    def _put(self, run: Run, result: TaskResult, chain: bool, late: finalcheck.LateBeats | None) -> None:
        """The result itself goes out (the heartbeats are already excluded)."""
        r = self.runner
        if run.phase != "reporting":
            return
        tid, poll_count, sent = result.task_id, run.task.poll_count, self.world.now

        def got(answer: Answer) -> None:
            if not answer.ok:
                self._failed(run, result, chain, answer, sent)
                return
            r.state.outbox.pop(tid, None)
            r.step(Reported(tid))
            claimed = answer.body if chain else None
            self._end_chain(run, claimed, sent)
            if (at := read_back_at(None if late is None else late.until, sent)) is not None:
                # The product's rule for a yield a late beat may undo (finalcheck.ReadBack): read
                # back once the beat can no longer land, send again (v1, bounded) while undone.
                self._stick(run, result, poll_count, finalcheck.ReadBack(at, poll_count=poll_count,
                                                                         worker_id=r.name))
                return
            r.forget(run)

        self.server_update(tid, poll_count, result, chain, r.reply(got))

    def _failed(self, run: Run, result: TaskResult, chain: bool, answer: Answer, sent: float) -> None:
        """What a failed attempt (its park or its result) means: the product's table, carried out."""
        r, now, tid, poll_count = self.runner, self.world.now, result.task_id, run.task.poll_count
        self._end_chain(run, None, sent)
        lease = run.lease
        left = 0.0 if run.fence is FenceReason.LEASE_EXPIRED else lease.term_point - now
        decision = decide(failure_of_status(None if answer.timeout else answer.status),
                          Attempt(result.status, number=self._attempts[tid], left=left, v2=chain,
                                  status_code=None if answer.timeout else answer.status))  # fmt: skip
        yielding = result.status is TaskStatus.IN_PROGRESS
        planted = r.bugs.retry_landed_yield if yielding else r.bugs.no_final_wait
        if isinstance(decision, ReadBack) and planted:  # the planted race: sent again, no read-back
            decision = Retry(REPORT_BACKOFF.delay(self._attempts[tid]))
        match decision:
            case Delivered():
                r.state.outbox.pop(tid, None)
                r.step(Reported(tid))
                r.forget(run)
            case GiveUp() | SendBare():  # (the simulated server refuses no body: 404, gone)
                r.state.outbox.pop(tid, None)
                r.forget(run)
            case Save():
                r.state.outbox[tid] = (result, poll_count)
                self.world.log(f"runner {r.name}: {tid}: result kept in the outbox (lease over)")
                r.forget(run)
                self.arm_outbox()
            case ReadBack(after=after):
                # An update of unknown fate may still land: no heartbeat (which could load the task
                # before it lands and write it back after) and no second send until it no longer
                # can (the product's margin after the give-up); then the task is read back, and the
                # update sent again only if it never landed.
                r.state.outbox[tid] = (result, poll_count)
                self.world.at(now + after, "final-confirm", r.guard(lambda: self._confirm(run, result)))
            case FallBackToV1():
                r.step(FinalUpdateFailed(tid))
                self._send(run, result, False)  # the same result through v1, at once
            case Retry(after=after):
                r.state.outbox[tid] = (result, poll_count)
                r.step(FinalUpdateFailed(tid))
                self.world.after(after, "report-retry", r.guard(lambda: self._send(run, result, False)))

    def _confirm(self, run: Run, result: TaskResult, reads: int = 1) -> None:
        r = self.runner
        if run.phase != "reporting":
            return

        def got(answer: Answer) -> None:
            if run.phase != "reporting":
                return
            if not (answer.ok or answer.status == 404):  # the read failed: again, with the backoff
                self.world.after(REPORT_BACKOFF.delay(reads), "final-confirm",
                                 r.guard(lambda: self._confirm(run, result, reads + 1)))
                return
            own = TaskOwnership(TaskStatus(answer.body[0]), answer.body[1]) if answer.ok else None
            decision = after_read_back(own, run.task.poll_count, result.status)
            if isinstance(decision, Retry):  # it never landed (or a late beat undid it)
                r.step(FinalUpdateFailed(result.task_id))
                self._send(run, result, False)
                return
            self.world.log(f"runner {r.name}: {result.task_id}: read back, "
                           + ("the update had landed" if isinstance(decision, Delivered)
                              else f"no longer ours ({decision})"))  # fmt: skip
            r.state.outbox.pop(result.task_id, None)
            r.step(Reported(result.task_id))
            r.forget(run)

        r.server.read(r.name, result.task_id, r.reply(got), r.config.http_timeout)

    def _stick(self, run: Run, result: TaskResult, poll_count: int, check: finalcheck.ReadBack) -> None:
        """Drive the product's read-back machine on the world's clock; the run is over when it is."""
        r, tid = self.runner, result.task_id
        if run.phase != "reporting":
            return
        if check.next_at is None:
            self.world.log(f"runner {r.name}: {tid}: read back after a late beat: {check.outcome}")
            r.forget(run)
            return

        def read() -> None:
            def got(answer: Answer) -> None:
                if run.phase != "reporting":
                    return
                now = self.world.now
                own = TaskOwnership(TaskStatus(answer.body[0]), *answer.body[1:3]) if answer.ok else None
                if not (answer.ok or answer.status == 404):
                    check.on_read_failed(now)
                elif check.on_read(now, own) is finalcheck.ReadStep.RESEND:
                    def resent(again: Answer) -> None:
                        check.on_resent(self.world.now, again.ok)
                        self._stick(run, result, poll_count, check)

                    self.server_update(tid, poll_count, result, False, r.reply(resent))
                    return
                self._stick(run, result, poll_count, check)

            if run.phase == "reporting":
                r.server.read(r.name, tid, r.reply(got), r.config.http_timeout)

        self.world.at(max(check.next_at, self.world.now), "final-readback", r.guard(read))

    def server_update(self, tid: str, poll_count: int, result: TaskResult, v2: bool,
                      reply: Callable[[Answer], None], *, park: bool = False) -> None:
        r = self.runner
        # the client's transport: once more on a reset, v1 only (update-v2 claims work: never twice)
        resend = not v2 and (transport_may_resend(result.status) or r.bugs.resend_in_progress)
        r.server.update(r.name, (tid, poll_count), result_body(result), v2=v2, reply=reply,
                        timeout=r.config.http_timeout, park=park, resend=resend)

    def _end_chain(self, run: Run, claimed: object, sent: float) -> None:
        if not run.chain_slot:
            return
        run.chain_slot = False
        if isinstance(claimed, dict):
            run.slot = False
            self.runner.deliver(Task.from_json(claimed), sent)  # takes over the kept slot
        else:  # claimed nothing: the slot is free, the report still waits (Poller.chain_ended)
            run.report_held = True
            self.runner.chain_ended()

    def end_unstarted(self, run: Run, wait_left: float) -> None:
        r, task = self.runner, run.task
        if run.fence is FenceReason.OWNERSHIP_LOST:
            r.forget(run)
            return
        why = f"fenced ({run.fence.value if run.fence else 'stopped'}) before its command started"
        if r.may_run_elsewhere(task) and not r.bugs.held_reported_failed:
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                                callback_after_seconds=max(0, math.ceil(wait_left)), worker_id=r.name)
        else:
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                                reason_for_incompletion=why, worker_id=r.name)
        self.report(run, result)

    # ----- hand-backs ----------------------------------------------------------------------------

    def hand_back(self, task: Task, attempt: int = 1, deadline: float | None = None) -> None:
        """A task polled beyond the slots goes back unrun as the product's reporter sends it
        (``TaskStarts._hand_back``): no lease, retried for ``HAND_BACK_RETRY_SECONDS`` by the failure
        table, read back after an attempt with no answer, kept in the outbox when time runs out."""
        r = self.runner
        deadline = self.world.now + HAND_BACK_RETRY_SECONDS if deadline is None else deadline
        result = hand_back(task, r.name)

        def got(answer: Answer) -> None:
            if answer.ok:
                return
            decision = decide(failure_of_status(None if answer.timeout else answer.status),
                              Attempt(TaskStatus.IN_PROGRESS, number=attempt, left=deadline - self.world.now,
                                      status_code=None if answer.timeout else answer.status,
                                      has_body=False))  # fmt: skip
            match decision:
                case Retry(after=after):
                    self.world.after(after, "hand-back-retry",
                                     r.guard(lambda: self.hand_back(task, attempt + 1, deadline)))
                case ReadBack(after=after):
                    self.world.after(after, "hand-back-read",
                                     r.guard(lambda: self._hand_back_read(task, attempt, deadline, 1)))
                case Save():
                    self._save_hand_back(task, result)
                case _:  # delivered, gone, refused
                    pass

        self.server_update(task.task_id, task.poll_count, result, False, r.reply(got))

    def _hand_back_read(self, task: Task, attempt: int, deadline: float, reads: int) -> None:
        """The reporter's read-back after a hand-back with no answer (``Reporter._read_back``)."""
        r = self.runner

        def got(answer: Answer) -> None:
            if not (answer.ok or answer.status == 404):  # a failed read: again with the backoff, or saved
                wait = REPORT_BACKOFF.delay(reads)
                if deadline - self.world.now <= wait:
                    self._save_hand_back(task, hand_back(task, r.name))
                    return
                self.world.after(wait, "hand-back-read",
                                 r.guard(lambda: self._hand_back_read(task, attempt, deadline, reads + 1)))
                return
            own = TaskOwnership(TaskStatus(answer.body[0]), answer.body[1]) if answer.ok else None
            if isinstance(after_read_back(own, task.poll_count, TaskStatus.IN_PROGRESS), Retry):
                self.hand_back(task, attempt + 1, deadline)  # it never landed: sent again

        r.server.read(r.name, task.task_id, r.reply(got), r.config.http_timeout)

    def _save_hand_back(self, task: Task, result: TaskResult) -> None:
        r = self.runner
        if task.task_id in r.runs or task.task_id in r.state.outbox:
            return  # (a run's own result is the one to keep)
        r.state.outbox[task.task_id] = (result, task.poll_count)
        self.world.log(f"runner {r.name}: {task.task_id}: hand-back kept in the outbox")
        self.arm_outbox()

    # ----- the outbox ---------------------------------------------------------------------------

    def arm_outbox(self) -> None:
        r = self.runner
        if self._outbox_armed or not r.state.outbox:
            return
        self._outbox_armed = True
        self.world.after(r.config.outbox_every, "outbox", r.guard(self.deliver_outbox))

    def deliver_outbox(self) -> None:
        """Each saved result: read back; dropped when no longer ours, sent otherwise."""
        r = self.runner
        self._outbox_armed = False
        for tid, (result, poll_count) in list(r.state.outbox.items()):
            if tid in r.runs:
                continue

            def read(answer: Answer, tid: str = tid, result: TaskResult = result,
                     pc: int = poll_count) -> None:
                if r.state.outbox.get(tid, (None, 0))[0] is not result:
                    return
                if answer.ok or answer.status == 404:
                    own = TaskOwnership(TaskStatus(answer.body[0]), *answer.body[1:3]) if answer.ok else None
                    why = saved_result_lost_reason(own, pc, result)
                    if why is not None:
                        self.world.log(f"runner {r.name}: outbox drops {tid}: {why}")
                        del r.state.outbox[tid]
                        return
                    self.server_update(tid, pc, result, False, r.reply(functools.partial(sent, tid=tid)))

            def sent(answer: Answer, *, tid: str, result: TaskResult = result) -> None:
                failure = failure_of_status(None if answer.timeout else answer.status)
                if answer.ok or not isinstance(decide(failure, Attempt(result.status, saved=True)), Save):
                    r.state.outbox.pop(tid, None)

            r.server.read(r.name, tid, r.reply(read), r.config.http_timeout)
        self.arm_outbox()
