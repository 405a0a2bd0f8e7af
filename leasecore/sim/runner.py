"""A runner in the simulation: stand-in glue that drives the product's real decision objects.

Real, unchanged: ``Lease`` (every heartbeat, check and fence time), ``LeasePolicy.from_task`` (the
numbers, the re-delivery wait), ``judge_ownership`` (inside the lease), ``LeaseBook`` (which lease a
delivery or an update reaches), ``StartGate`` / ``DyingTrees`` / ``YieldHold`` / ``mark_yield`` /
``may_run_elsewhere`` (``leasecore.handover``), ``may_chain`` / ``hand_back`` (update-v2 chaining),
``PollBackoff`` (poll delays) and ``ownership_lost_reason`` (the outbox's check before a late
delivery). Stand-in (this module and ``leasecore.sim.reports``): what the product's main loop, poller,
lease engine threads, reporter and outbox do with those decisions: carrying actions out, slots, the
order of a final update's steps. docs/simulator.md lists what the next step must replace.

Every event a runner handles goes through ``guard``: dropped after a crash (the incarnation moved
on), deferred while the runner is stalled (its trees and fork server go on meanwhile).

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from leasecore.handover import DyingTrees, StartGate, YieldHold, mark_yield, may_run_elsewhere
from leasecore.lease import (
    CheckOwnership,
    FenceReason,
    KillTree,
    Lease,
    LeasePolicy,
    SendHeartbeat,
    TerminateTree,
)
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.leasebook import LeaseBook
from leasecore.runner.upstream.pollpolicy import PollBackoff
from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.setting import Bugs, Run, RunnerConfig, StateDir, TreeProfile
from leasecore.sim.trees import Copies, Copy, SimForkServer, SimTree
from leasecore.sim.world import World

__all__ = ["Bugs", "Run", "RunnerConfig", "SimRunner", "StateDir", "TreeProfile"]  # (values: .setting)


class SimRunner:
    """One runner process (its incarnations) with its fork server and its state directory."""

    def __init__(self, world: World, server: SimConductor, copies: Copies, name: str, config: RunnerConfig,
                 trees: TreeProfile, bugs: Bugs) -> None:
        self.world, self.server, self.copies = world, server, copies
        self.name, self.config, self.profile, self.bugs = name, config, trees, bugs
        self.state = StateDir()
        self.forkserver = SimForkServer(world, name, kill_by=config.kill_by)
        self.incarnation = 0
        self.down = False
        self.stalled_until = 0.0
        self.attempts = 0
        self._boot()

    # ----- life --------------------------------------------------------------------------------

    def _boot(self) -> None:
        from leasecore.sim.reports import Reports  # (the final-update half of the glue)

        self.book = LeaseBook(random=self.world.rng.random)
        self.dying = DyingTrees(gone=_tree_gone)
        self.gate = StartGate(self.dying)
        self.yields = YieldHold(gone=_tree_gone)
        self.backoff = PollBackoff(rand=self.world.rng.random)
        self.runs: dict[str, Run] = {}
        self.next_runs: dict[str, tuple[Task, float]] = {}
        self.in_use = 0
        self.stopping = False
        self.polling = 0
        self.poll_pending = False
        self.gate_at: float | None = None
        self.reports = Reports(self)
        self._poll_soon(0.0)
        self.reports.deliver_outbox()

    def crash(self) -> None:
        """The runner process dies; its fork server sees it and kills every tree; the state dir stays."""
        if self.down:
            return
        self.world.log(f"runner {self.name}: {'exit' if self.stopping else 'CRASH'}")
        self.incarnation += 1
        self.down = True
        self.stalled_until = 0.0
        self.forkserver.kill_all("the runner died")
        self.runs = {}

    def stop(self, within: float) -> None:
        """A graceful stop (SIGTERM): no more polls; every lease fenced for SHUTDOWN (a held delivery
        goes back unstarted); the runner exits once its runs are reported, or after ``within``."""
        if self.down or self.stopping:
            return
        self.world.log(f"runner {self.name}: STOP (graceful)")
        self.stopping = True
        now = self.world.now
        for run in list(self.runs.values()):
            self.act(run, run.lease.on_shutdown(now))
        self.world.after(0.5, "stop-check", self.guard(lambda: self._exit_when_done(now + within)))

    def _exit_when_done(self, deadline: float) -> None:
        if self.runs and self.world.now < deadline:
            self.world.after(0.5, "stop-check", self.guard(lambda: self._exit_when_done(deadline)))
            return
        self.world.log(f"runner {self.name}: exits after its stop ({len(self.runs)} run(s) left)")
        self.crash()

    def restart(self) -> None:
        if not self.down:
            return
        self.world.log(f"runner {self.name}: restarted")
        self.down = False
        self._boot()

    def stall(self, seconds: float) -> None:
        self.world.log(f"runner {self.name}: STALL for {seconds:.1f} s")
        self.stalled_until = max(self.stalled_until, self.world.now + seconds)

    def forkserver_dies(self) -> None:
        """The fork server is killed: the runner kills every tree it held (a new one serves the next
        start)."""
        if self.down:
            return
        self.forkserver.kill_all("the fork server died")

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        inc = self.incarnation

        def run() -> None:
            if self.incarnation != inc or self.down:
                return
            if self.stalled_until > self.world.now:
                self.world.at(self.stalled_until, "deferred", run)
                return
            fn()

        return run

    def reply(self, fn: Callable[[Answer], None]) -> Callable[[Answer], None]:
        """``fn`` as a guarded event of this incarnation (an answer reaching a restarted runner is lost)."""
        inc = self.incarnation

        def got(answer: Answer) -> None:
            if self.incarnation == inc:
                self.guard(lambda: fn(answer))()

        return got

    # ----- polling -----------------------------------------------------------------------------

    def _poll_soon(self, delay: float) -> None:
        if self.poll_pending:
            return
        self.poll_pending = True
        self.world.after(delay, "poll", self.guard(self._poll))

    def _poll(self) -> None:
        self.poll_pending = False
        if self.stopping:
            return
        free = self.config.slots - self.in_use
        if free <= 0:
            return  # a released slot polls again (release)
        count = min(free, 4)
        self.in_use += count
        self.polling = count  # reserved for what the poll brings
        sent = self.world.now

        def got(answer: Answer) -> None:
            self.polling = 0
            if not answer.ok:
                self.release(count)
                self._poll_soon(self.backoff.on_error())
                return
            tasks = [Task.from_json(t) for t in answer.body]
            self.release(count - len(tasks), poll=False)
            for task in tasks:
                self.deliver(task, sent)
            self._poll_soon(self.backoff.on_tasks() if tasks else self.backoff.on_empty())

        self.server.poll(self.name, self.config.task_type, count, self.reply(got), self.config.http_timeout)

    def release(self, n: int = 1, *, poll: bool = True) -> None:
        self.in_use -= n
        if self.in_use < 0:
            self.world.violate("slots", f"runner {self.name} released more slots than it held "
                               f"({self.in_use})")
        if poll and n > 0:
            self._poll_soon(0.0)

    # ----- deliveries and starts ----------------------------------------------------------------

    def policy_for(self, task: Task) -> LeasePolicy:
        c = self.config
        return LeasePolicy.from_task(task, kill_grace_seconds=c.kill_grace,
                                     ownership_check_interval_seconds=c.check_interval,
                                     http_timeout_seconds=c.http_timeout)

    def deliver(self, task: Task, polled_at: float) -> None:
        """A task reached us (a poll, or an update-v2's claim sent at ``polled_at``); it holds a slot."""
        tid = task.task_id
        self.world.log(f"runner {self.name}: got {tid} (pollCount {task.poll_count})")
        current = self.runs.get(tid)
        if current is not None and task.poll_count > current.task.poll_count and (
            current.phase == "reporting" or current.fence is FenceReason.OWNERSHIP_LOST
        ):
            # Its next run (our yield re-polled before the report's ack, or a re-delivery while our
            # copy is killed): it keeps the slot its poll took and is delivered once this run is over.
            if tid in self.next_runs:  # a newer one replaces it: its slot goes back
                self.release()
            self.next_runs[tid] = (task, polled_at)
            return
        if current is not None:  # the same run delivered again: an ack of its lease, no second copy
            entry, actions = self.book.admit(task, current.policy, polled_at, self.world.now)
            if task.poll_count > current.task.poll_count:
                current.task = task
            self.release()
            self.act(current, actions)
            return
        policy = self.policy_for(task)
        entry, actions = self.book.admit(task, policy, polled_at, self.world.now)
        run = Run(task, entry, policy, label=f"{self.name}/{tid}/p{task.poll_count}")
        self.runs[tid] = run
        self.attempts += 1
        now = self.world.now
        wait = 0.0 if self.bugs.no_redelivery_hold else policy.start_delay_seconds
        here = [] if self.bugs.no_dying_wait else [(r.task, r.tree) for r in self.runs.values() if r.tree]
        if self.stopping:  # polled as the stop began (a poll in flight): back, unstarted
            self.gate.hold(task, now + wait, now, here)
            actions += run.lease.on_shutdown(now)
            self.act(run, actions)
            return
        why = self.gate.hold(task, now + wait, now, here)
        if why is not None and self.bugs.no_dying_wait and wait <= 0:
            self.gate.drop(tid)
            why = None
        if why is not None:
            self.world.log(f"runner {self.name}: holds {tid}: {why.split(':')[0]}")
            actions += run.lease.on_start_held(now)
            self._arm_gate()
        elif run.lease.fence_reason is None:
            self._start(run)
        else:  # its lease ran out before we got to it (a stall): never started; the fence ends it
            self.gate.drop(tid)
            why = run.lease.fence_reason.value
            self.world.log(f"runner {self.name}: {tid} came too late to start ({why})")
        self.act(run, actions)

    def _arm_gate(self) -> None:
        at = self.gate.next_at(self.world.now, poll_seconds=0.5)
        if at is None or (self.gate_at is not None and self.gate_at <= at and self.gate_at > self.world.now):
            return
        self.gate_at = at
        self.world.at(at, "gate", self.guard(self._gate_due))

    def _gate_due(self) -> None:
        self.gate_at = None
        for task in self.gate.due(self.world.now):
            run = self.runs.get(task.task_id)
            if run is not None and run.phase == "held" and run.lease.fence_reason is None:
                self._start(run)
        self._arm_gate()

    def _start(self, run: Run) -> None:
        p, rng = self.profile, self.world.rng
        draw = rng.random()
        outcome = "failed" if draw < p.fail else "yield" if draw < p.fail + p.yields else "completed"
        if outcome == "yield" and run.task.poll_count >= p.max_runs:
            outcome = "completed"
        escapees = 1 if rng.random() < p.escapee else 0
        copy = Copy(run.label, run.task.task_id, self.world.now)
        duration = min(rng.expovariate(1.0 / p.mean_seconds), p.max_factor * p.mean_seconds)
        tree = SimTree(self.world, self.copies, _key(run.task), copy, duration=duration, outcome=outcome,
                       obeys_term=rng.random() >= p.ignore_term, die_within=rng.uniform(0.0, p.die_within),
                       escapees=escapees, escapee_life=rng.uniform(0.0, 30.0),
                       on_exit=self._exit_handler(run))
        run.tree, run.phase = tree, "running"
        self.forkserver.add(tree)
        self.act(run, run.lease.on_child_started(self.world.now))
        self._arm_kill_by(run)

    def _exit_handler(self, run: Run) -> Callable[[SimTree], None]:
        inc = self.incarnation

        def on_exit(tree: SimTree) -> None:
            if self.incarnation == inc:
                self.guard(lambda: self._exited(run, tree))()

        return on_exit

    def _arm_kill_by(self, run: Run) -> None:
        if run.tree is not None and run.phase == "running" and run.lease.term_point != float("inf"):
            # (the planted TERM-at-the-deadline bug is in the deadline's arithmetic, which both use)
            late = run.policy.fence_lead_seconds if self.bugs.term_at_deadline else 0.0
            grace = run.policy.effective_kill_grace_seconds
            self.forkserver.arm(run.tree, run.lease.term_point + late, grace)

    # ----- the lease's actions ------------------------------------------------------------------

    def act(self, run: Run, actions: list[Any]) -> None:
        for action in actions:
            if isinstance(action, SendHeartbeat):
                self._beat(run, run.lease, action)
            elif isinstance(action, CheckOwnership):
                self._check(run, run.lease, action)
            elif isinstance(action, TerminateTree | KillTree):
                self._fence(run, action)
        self._arm(run)

    def _arm(self, run: Run) -> None:
        at = run.lease.next_wakeup()
        if at is None or at == run.wake_at:
            return
        run.wake_at = at

        def wake() -> None:
            if run.wake_at == at and self.runs.get(run.task.task_id) is run:
                run.wake_at = None
                self.act(run, run.lease.on_tick(self.world.now))

        self.world.at(at, "wake", self.guard(wake))

    def _beat(self, run: Run, lease: Lease, action: SendHeartbeat) -> None:
        sent = self.world.now
        run.beat_in_flight = True

        def got(answer: Answer) -> None:
            run.beat_in_flight = False
            now = self.world.now
            if answer.ok:
                actions = lease.on_heartbeat_ok(now, sent)
                self._arm_kill_by(run)
            elif answer.status == 404:
                actions = lease.on_heartbeat_not_found(now)
            else:
                if answer.timeout:
                    run.unknown_beat_at = max(run.unknown_beat_at or sent, sent)
                actions = lease.on_heartbeat_failed(now)
            if lease is run.lease:
                self.act(run, actions)

        self.server.extend(self.name, run.task.task_id, run.task.workflow_id, self.reply(got),
                           action.timeout_seconds)

    def _check(self, run: Run, lease: Lease, action: CheckOwnership) -> None:
        def got(answer: Answer) -> None:
            now = self.world.now
            if answer.ok:
                status, poll_count, worker = answer.body
                actions = lease.on_ownership(now, TaskOwnership(TaskStatus(status), poll_count, worker))
                self._arm_kill_by(run)  # a check that found it ours moves the kill-by, as an ack does
            elif answer.status == 404:
                actions = lease.on_ownership(now, None)
            else:
                actions = lease.on_ownership_check_failed(now)
            if lease is run.lease:
                self.act(run, actions)

        self.server.read(self.name, run.task.task_id, self.reply(got), action.timeout_seconds)

    def _fence(self, run: Run, action: TerminateTree | KillTree) -> None:
        run.fence = run.lease.fence_reason
        if run.phase == "held":  # fenced before its command started: no tree
            start_at = self.gate.start_at(run.task.task_id)
            self.gate.drop(run.task.task_id)
            run.phase = "exited"
            self.act(run, run.lease.on_child_exited(self.world.now))
            self.reports.end_unstarted(run, (start_at or 0.0) - self.world.now)
            return
        tree = run.tree
        if tree is None or run.phase != "running":
            return
        self.dying.add(run.task, tree)
        delay = 0.0
        if self.bugs.term_at_deadline and action.reason is FenceReason.LEASE_EXPIRED:
            delay = run.policy.fence_lead_seconds  # the old bug: TERM at the deadline itself
        self.world.log(f"runner {self.name}: fence {run.label} ({action.reason.value}, "
                       f"{'KILL' if isinstance(action, KillTree) else 'TERM'})")
        if isinstance(action, KillTree):
            self.world.after(delay, "fence", tree.kill)
        else:
            at = action.at + delay if action.at is not None else None
            self.world.after(delay, "fence", lambda: self.forkserver.stop(tree, at, action.grace_seconds))

    # ----- exits --------------------------------------------------------------------------------

    def _exited(self, run: Run, tree: SimTree) -> None:
        if self.runs.get(run.task.task_id) is not run:
            return
        now = self.world.now
        run.phase = "exited"
        self.forkserver.disarm(tree)
        self.forkserver.leader_exited(tree, run.policy.fence_lead_seconds)
        self.dying.add(run.task, tree)  # escapees may outlive the leader
        self.act(run, run.lease.on_child_exited(now))
        run.fence = run.lease.fence_reason
        task = run.task
        if run.fence is FenceReason.OWNERSHIP_LOST:
            self.forget(run)
            return
        if tree.signalled is not None or run.fence is not None:
            reason = f"fenced ({run.fence.value if run.fence else tree.signalled})"
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                                reason_for_incompletion=reason, worker_id=self.name)
        elif tree.outcome == "completed":
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.COMPLETED,
                                output_data={"attempt": run.label}, worker_id=self.name)
        elif tree.outcome == "failed":
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.FAILED,
                                reason_for_incompletion="exit 1", worker_id=self.name)
        else:
            callback = self.world.rng.choice((0, 0, 5, 30))
            result = TaskResult(task.task_id, task.workflow_id, TaskStatus.IN_PROGRESS,
                                callback_after_seconds=callback, worker_id=self.name)
            if self.bugs.yield_unheld or tree.gone:
                self.reports.report(run, mark_yield(result, task.poll_count))
            else:
                self.yields.hold(task.task_id, tree, result, now + run.policy.fence_lead_seconds + 0.5)
                self._yield_check()
            return
        if result.status is TaskStatus.FAILED and not tree.gone and not self.bugs.failed_before_tree_gone:
            self.yields.hold(task.task_id, tree, result, now + run.policy.fence_lead_seconds + 0.5)
            self._yield_check()
            return
        self.reports.report(run, result)

    def _yield_check(self) -> None:
        for tid, result, gone in self.yields.due(self.world.now):
            run = self.runs.get(tid)
            if run is not None:
                self.reports.report(run, mark_yield(result, run.task.poll_count) if gone else result)
        if self.yields:
            self.world.after(0.25, "yield-hold", self.guard(self._yield_check))

    def forget(self, run: Run) -> None:
        """The run is over here (reported, or no longer ours): its lease ends, its slot is free."""
        tid = run.task.task_id
        if self.runs.get(tid) is run:
            del self.runs[tid]
        self.book.end(tid, self.world.now, poll_count=run.task.poll_count)
        run.phase = "done"
        if run.slot:
            run.slot = False
            self.release()
        if self.runs.get(tid) is None and (nxt := self.next_runs.pop(tid, None)) is not None:
            self.deliver(*nxt)  # (it holds the slot its poll took)

    def may_run_elsewhere(self, task: Task) -> bool:
        return may_run_elsewhere(task)


def _tree_gone(handle: object) -> bool:
    return isinstance(handle, SimTree) and handle.gone


def _key(task: Task) -> tuple[str, str]:
    return task.workflow_id, task.reference_name
