"""The final-update half of a simulated runner's stand-in glue: reports, retries, the outbox.

Owns ``Reports``: a run's result goes out once no heartbeat of the run is in flight and (unless the
``no_final_wait`` bug is planted) once no heartbeat of unknown fate can still land on the server
(``LAND_BOUND_SECONDS`` after it was sent: the lost update of CONDUCTOR_PROTOCOL.md §3 needs a beat
loaded before the final update and written after it); through update-v2 when the real ``may_chain``
says so (the slot is kept for what it claims); retried while the lease lasts, kept in the state
dir's outbox otherwise and delivered later after a read-back judged by the real
``ownership_lost_reason``. A run fenced before its command started goes back as the product's
``_end_unstarted`` does (an unmarked IN_PROGRESS when its previous holder may still run it).

This is stand-in glue for the product's reporter, outbox and ``ends``/``starts`` modules, which run on
threads today; docs/simulator.md says what replaces it.

Threads: none.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

from leasecore.lease import FenceReason, finalcheck, ownership_lost_reason
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
)
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.chain import may_chain
from leasecore.runner.leasing.core import BeginFinalUpdate, FinalUpdateFailed, Reported
from leasecore.runner.loop.decisions import ReportCheck, report_check
from leasecore.sim.conductor import LAND_BOUND_SECONDS, Answer
from leasecore.sim.setting import Run, RunnerPort

__all__ = ["Reports", "result_body"]


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
            else:
                chain = False
                r.release()
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
        r, now = self.runner, self.world.now
        if run.phase != "reporting":
            return
        wait = 0.0
        late_until = None  # when a heartbeat of unknown fate can no longer land (this world's bound)
        if run.unknown_beat_at is not None and not r.bugs.no_final_wait:
            late_until = run.unknown_beat_at + LAND_BOUND_SECONDS
        if r.engine.beat_calling(result.task_id):
            wait = 0.05
        elif late_until is not None and result.status.is_terminal:
            wait = late_until - now  # (the product parks the task meanwhile; a yield goes out at once)
        if wait > 0:
            self.world.after(wait, "report-wait", r.guard(lambda: self._send(run, result, chain)))
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
        sent = now
        self._attempts[tid] = self._attempts.get(tid, 0) + 1

        def got(answer: Answer) -> None:
            now = self.world.now
            if answer.ok:
                r.state.outbox.pop(tid, None)
                r.step(Reported(tid))
                claimed = answer.body if chain else None
                self._end_chain(run, claimed, sent)
                if (at := read_back_at(late_until, sent)) is not None:
                    # The product's rule for a yield a late beat may undo (finalcheck.ReadBack): read
                    # back once the beat can no longer land, send again (v1, bounded) while undone.
                    self._stick(run, result, poll_count, finalcheck.ReadBack(at, poll_count=poll_count,
                                                                             worker_id=r.name))
                    return
                r.forget(run)
                return
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
                    # can (this world's bound: a request travels and is held up to LAND_BOUND_SECONDS);
                    # then the task is read back, and the update sent again only if it never landed.
                    r.state.outbox[tid] = (result, poll_count)
                    at = max(now + after, sent + LAND_BOUND_SECONDS)
                    self.world.at(at, "final-confirm", r.guard(lambda: self._confirm(run, result)))
                case FallBackToV1():
                    r.step(FinalUpdateFailed(tid))
                    self._send(run, result, False)  # the same result through v1, at once
                case Retry(after=after):
                    r.state.outbox[tid] = (result, poll_count)
                    r.step(FinalUpdateFailed(tid))
                    self.world.after(after, "report-retry", r.guard(lambda: self._send(run, result, False)))

        self.server_update(tid, poll_count, result, chain, r.reply(got))

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
                      reply: Callable[[Answer], None]) -> None:
        r = self.runner
        r.server.update(r.name, (tid, poll_count), result_body(result), v2=v2, reply=reply,
                        timeout=r.config.http_timeout)

    def _end_chain(self, run: Run, claimed: object, sent: float) -> None:
        if not run.chain_slot:
            return
        run.chain_slot = False
        if isinstance(claimed, dict):
            run.slot = False
            self.runner.deliver(Task.from_json(claimed), sent)  # takes over the kept slot
        else:
            self.runner.release()

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
                    own = TaskOwnership(TaskStatus(answer.body[0]), answer.body[1]) if answer.ok else None
                    why = ownership_lost_reason(own, pc)
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
