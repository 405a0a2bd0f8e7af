"""A runner in the simulation: the simulated driver of the product's decision cores.

The product's own code decides: the lease engine's core (``EngineCore``: which lease is ticked when,
its requests, one beat in flight, a final update's exclusion of beats, fences, kill-by times),
``Lease``, ``LeasePolicy.from_task``, ``LeaseBook`` (inside the core), the loop's decisions
(``decisions.admit``, ``held_start``, ``exit_meaning``, ``report_meaning``, ``hold_over``),
``StartGate`` / ``DyingTrees`` / ``YieldHold`` / ``mark_yield`` / ``may_run_elsewhere``
(``leasecore.handover``), ``may_chain`` and ``PollCore`` (driven by ``leasecore.sim.claims``). This
module carries their effects out on the world's clock, as the product's main loop and engine threads
do (the order of a start, an exit, a forget is written after ``loop/task_start.py`` and
``task_end.py``: a change to one must be made in both); only the I/O is simulated.

Every event a runner handles goes through ``guard``: dropped after a crash (the incarnation moved
on), deferred while the runner is stalled (its trees and fork server go on meanwhile).

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable

from leasecore.handover import DyingTrees, StartGate, YieldHold, logical_key, mark_yield, may_run_elsewhere
from leasecore.lease import FenceAction, FenceReason, KillTree, LeasePolicy
from leasecore.lease.finalcheck import unknown_fate
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.fdbudget import handed_back
from leasecore.runner.leasing import core as ec  # the engine core: its events and effects
from leasecore.runner.leasing.core import EngineCore
from leasecore.runner.leasing.schedule import (
    beat_acked,
    beat_failed,
    beat_not_found,
    check_failed,
    ownership_read,
)
from leasecore.runner.loop import decisions as d
from leasecore.sim.claims import Claims
from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.held import held_step, lease_now
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

        # The product's lease engine core, driven by this runner's events (``step``): every heartbeat,
        # check, tick, fence and kill-by time. Senders without limit: each request goes when it may.
        self.engine = EngineCore(random_source=self.world.rng.random, capacity=_SENDERS, kill_by=True)
        self.kill_bys: dict[str, tuple[float, float]] = {}  # the latest KillBy of each task
        self.wake_at: float | None = None
        self.dying = DyingTrees(gone=_tree_gone)
        self.gate = StartGate(self.dying)
        self.yields = YieldHold(gone=_tree_gone)
        self.claims = Claims(self)
        self.runs: dict[str, Run] = {}
        self.next_runs: dict[str, tuple[Task, float]] = {}
        self.stopping = False
        self.gate_at: float | None = None
        self.held_reads: dict[str, tuple[d.Read, TaskOwnership | None]] = {}  # held runs read back at start
        self.reports = Reports(self)
        self.claims.look()
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
        self.step(ec.Shutdown())
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

    # ----- polling: the product's PollCore, driven by leasecore.sim.claims ---------------------

    @property
    def in_use(self) -> int:
        """Slots taken: reserved for the poll out, running or held runs, kept for update-v2."""
        return self.claims.core.in_use

    @property
    def polling(self) -> int:
        """Slots reserved by the poll out now (0: none out)."""
        return self.claims.core.in_flight

    def release(self, n: int = 1, *, poll: bool = True) -> None:
        self.claims.release(n, poll=poll)

    def keep_for_chain(self) -> bool:
        return self.claims.keep_for_chain()

    def reporting_started(self) -> None:
        self.claims.reporting_started()

    def chain_ended(self) -> None:
        self.claims.chain_ended()

    def pause(self, seconds: float) -> bool:
        """The operator pauses the task type here for ``seconds`` (False: the runner is down)."""
        if self.down:
            return False
        self.guard(lambda: self.claims.pause(seconds))()
        return True

    def drain(self, timeout: float) -> bool:
        """The operator drains this runner (False: it is down or already stopping)."""
        if self.down or self.stopping:
            return False
        self.guard(lambda: self.claims.drain(timeout))()
        return True

    # ----- deliveries and starts ----------------------------------------------------------------

    def policy_for(self, task: Task) -> LeasePolicy:
        c = self.config
        return LeasePolicy.from_task(task, kill_grace_seconds=c.kill_grace,
                                     ownership_check_interval_seconds=c.check_interval,
                                     http_timeout_seconds=c.http_timeout)

    def deliver(self, task: Task, polled_at: float) -> None:
        """A task reached us (a poll, or an update-v2's claim sent at ``polled_at``); it holds a slot.
        What it means is the product's ``decisions.admit``; this carries it out."""
        tid, now = task.task_id, self.world.now
        self.world.log(f"runner {self.name}: got {tid} (pollCount {task.poll_count})")
        if (current := self.runs.get(tid)) is not None:
            lost = current.fence is FenceReason.OWNERSHIP_LOST
            decision = d.admit(d.Delivery(task.poll_count, d.Earlier(
                current.task.poll_count, current.phase == "reporting", lost, tid in self.yields)))
            if isinstance(decision, d.WaitBehind):  # its next run: it keeps its poll's slot meanwhile
                if tid in self.next_runs:  # a newer one replaces it: its slot goes back
                    self.release()
                self.next_runs[tid] = (task, polled_at)
                return
            assert isinstance(decision, d.AckDuplicate)  # the same run again: an ack of its lease
            effects = self._engine(ec.Track(task, current.policy, polled_at))
            current.task = task if decision.newer else current.task
            self.release()
            self.carry_out(effects)
            return
        policy = self.policy_for(task)
        effects = self._engine(ec.Track(task, policy, polled_at))
        entry = self.engine.entry(tid)
        assert entry is not None  # (just tracked)
        run = Run(task, entry, policy, label=f"{self.name}/{tid}/p{task.poll_count}")
        self.runs[tid] = run
        self.attempts += 1
        # The planted races switch the harness's inputs to the decision, never the decision itself.
        wait = 0.0 if self.bugs.no_redelivery_hold else policy.start_delay_seconds
        key = logical_key(task)
        for other in () if self.bugs.no_dying_wait else self.runs.values():  # another attempt here: dying
            if key and other.tree and other.task.task_id != tid and logical_key(other.task) == key:
                self.dying.add(other.task, other.tree)
        dying = not self.bugs.no_dying_wait and self.dying.still_dying(task)
        decision = d.admit(d.Delivery(task.poll_count, stopping=self.stopping,
                                      lease=lease_now(run.lease, now), start_delay=wait, dying_here=dying))
        if isinstance(decision, d.BackUnstarted | d.ChainedBack):  # polled as the stop began: back unstarted
            self.gate.hold(task, now + wait, now)
            effects += self._engine(ec.Shutdown(tid))
        elif isinstance(decision, d.Hold):
            why = self.gate.hold(task, now + wait, now) or "a dying tree"
            self.world.log(f"runner {self.name}: holds {tid}: {why.split(':')[0]}")
            effects += self._engine(ec.StartHeld(tid))
            self.arm_gate()
        elif isinstance(decision, d.Start):
            self.start(run)
        else:  # its lease ran out before we got to it (a stall): never started; the fence ends it
            assert isinstance(decision, d.EndUnstarted)
            self.world.log(f"runner {self.name}: {tid} came too late to start ({decision.why})")
        self.carry_out(effects)

    def arm_gate(self) -> None:
        at = self.gate.next_at(self.world.now, poll_seconds=0.5)
        if at is None or (self.gate_at is not None and self.gate_at <= at and self.gate_at > self.world.now):
            return
        self.gate_at = at
        self.world.at(at, "gate", self.guard(self._gate_due))

    def _gate_due(self) -> None:
        self.gate_at = None
        for task in self.gate.due(self.world.now):
            run = self.runs.get(task.task_id)
            if run is not None and run.phase == "held":
                held_step(self, run)
        self.arm_gate()

    def start(self, run: Run) -> None:
        p, rng = self.profile, self.world.rng
        if p.short_of_fds and rng.random() < p.short_of_fds:  # as TaskStarts/TaskEnds on EMFILE:
            self.world.log(f"tree {run.label}: no fd for its pipes, nothing started, handed back")
            self.step(ec.ChildExited(run.task.task_id))  # the engine hears the end, the task goes back
            self.reports.report(run, handed_back(run.task, self.name))
            return
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
        self.step(ec.ChildStarted(run.task.task_id))
        self._arm_kill_by(run)

    def _exit_handler(self, run: Run) -> Callable[[SimTree], None]:
        inc = self.incarnation

        def on_exit(tree: SimTree) -> None:
            if self.incarnation == inc:
                self.guard(lambda: self._exited(run, tree))()

        return on_exit

    def _arm_kill_by(self, run: Run) -> None:
        """The fork server's switch for the run's tree: the engine's latest kill-by times (``KillBy``)."""
        times = self.kill_bys.get(run.task.task_id)
        if run.tree is not None and run.phase == "running" and times is not None:
            # (the planted TERM-at-the-deadline bug shifts the switch as it shifts the fence)
            late = run.policy.fence_lead_seconds if self.bugs.term_at_deadline else 0.0
            self.forkserver.arm(run.tree, times[0] + late, times[1] - times[0])

    # ----- the lease engine core's driver -------------------------------------------------------

    def step(self, event: ec.Event) -> None:
        """Step the engine core at the world's now and carry its effects out."""
        self.carry_out(self._engine(event))

    def _engine(self, event: ec.Event) -> list[ec.Effect]:
        """The core's effects of ``event``, then every request a sender may take now (no pool limit;
        the core says when there are some: ``WakeSenders``)."""
        now = self.world.now
        effects = self.engine.step(event, now)
        if any(isinstance(effect, ec.WakeSenders) for effect in effects):
            while more := self.engine.step(ec.SenderFree(), now):
                effects += more
        return effects

    def carry_out(self, effects: list[ec.Effect]) -> None:
        """The effects' I/O: requests to the simulated server, fences and kill-by times to the simulated
        fork server (every request goes at once: ``WakeSenders`` and ``AwaitBeat`` need nothing)."""
        for effect in effects:
            if isinstance(effect, ec.SendBeat):
                self._beat(effect)
            elif isinstance(effect, ec.SendCheck):
                self._check(effect)
            elif isinstance(effect, ec.Fence):
                self._fence(effect.task_id, effect.action)
            elif isinstance(effect, ec.KillBy):
                self._kill_by(effect)
        self._arm()

    def _arm(self) -> None:
        at = self.engine.next_wakeup(self.world.now)
        if at is None or (self.wake_at is not None and self.world.now < self.wake_at <= at):
            return
        self.wake_at = at

        def wake() -> None:
            if self.wake_at == at:
                self.wake_at = None
                self.step(ec.Tick())

        self.world.at(at, "wake", self.guard(wake))

    def _beat(self, send: ec.SendBeat) -> None:
        def got(answer: Answer) -> None:
            if answer.ok:
                event = ec.Answered(send.call_id, beat_acked(send.sent_at))
            elif answer.status == 404 and not answer.timeout:
                event = ec.Answered(send.call_id, beat_not_found())
            else:
                fate = unknown_fate(None if answer.timeout else answer.status)
                event = ec.Answered(send.call_id, beat_failed(unknown_fate=fate))
            self.step(event)

        self.server.extend(self.name, send.task_id, send.workflow_id, self.reply(got), send.timeout_seconds)

    def _check(self, send: ec.SendCheck) -> None:
        def got(answer: Answer) -> None:
            if answer.ok:
                status, poll_count, worker = answer.body
                event = ec.Answered(send.call_id, ownership_read(TaskOwnership(TaskStatus(status), poll_count,
                                                                            worker)))  # fmt: skip
            elif answer.status == 404 and not answer.timeout:
                event = ec.Answered(send.call_id, ownership_read(None))
            else:
                event = ec.Answered(send.call_id, check_failed())
            self.step(event)

        self.server.read(self.name, send.task_id, self.reply(got), send.timeout_seconds)

    def _kill_by(self, effect: ec.KillBy) -> None:
        if effect.times is None:
            self.kill_bys.pop(effect.task_id, None)
            return
        self.kill_bys[effect.task_id] = effect.times
        run = self.runs.get(effect.task_id)
        if run is not None:
            self._arm_kill_by(run)

    def _fence(self, task_id: str, action: FenceAction) -> None:
        """What the runner does with a fence: a held start ends unstarted; a tree is stopped."""
        run = self.runs.get(task_id)
        if run is None or run.entry is not self.engine.entry(task_id):
            return
        run.fence = run.lease.fence_reason
        if run.phase == "held":  # fenced before its command started: no tree
            start_at = self.gate.start_at(task_id)
            self.gate.drop(task_id)
            run.phase = "exited"
            self.step(ec.ChildExited(task_id))
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
        self.step(ec.ChildExited(run.task.task_id))
        run.fence = run.lease.fence_reason
        task = run.task
        if d.exit_meaning(ownership_lost=run.fence is FenceReason.OWNERSHIP_LOST,
                        start_error=False) is d.ExitMeaning.FORGET:
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
        # What the result means is the product's; the planted races tell it the tree is gone early.
        gone = tree.gone or (self.bugs.yield_unheld if result.status is TaskStatus.IN_PROGRESS
                             else self.bugs.failed_before_tree_gone)
        step = d.report_meaning(result.status, tree_gone=gone)
        if step is d.ReportMeaning.HOLD:
            self.yields.hold(task.task_id, tree, result, now + run.policy.fence_lead_seconds + 0.5)
            self._yield_check()
        elif step is d.ReportMeaning.REPORT_YIELD:
            self.reports.report(run, mark_yield(result, task.poll_count))
        else:
            self.reports.report(run, result)

    def _yield_check(self) -> None:
        for tid, result, gone in self.yields.due(self.world.now):
            run = self.runs.get(tid)
            if run is not None:
                over = d.hold_over(result.status, tree_gone=gone)
                self.reports.report(run, mark_yield(result, run.task.poll_count)
                                    if over is d.HoldOver.REPORT_YIELD else result)
        if self.yields:
            self.world.after(0.25, "yield-hold", self.guard(self._yield_check))

    def forget(self, run: Run) -> None:
        """The run is over here (reported, or no longer ours): its lease ends, its slot is free."""
        tid = run.task.task_id
        if self.runs.get(tid) is run:
            del self.runs[tid]
            self.held_reads.pop(tid, None)  # a read-back still in flight is its, not the next run's
        self.step(ec.Reported(tid, run.task.poll_count))
        run.phase = "done"
        if run.slot:
            run.slot = False
            self.release()
        if run.report_held:  # its report is over: no longer among those waiting (PollCore.reported)
            run.report_held = False
            self.claims.reported()
        if self.runs.get(tid) is None and (nxt := self.next_runs.pop(tid, None)) is not None:
            self.deliver(*nxt)  # (it holds the slot its poll took)

    def may_run_elsewhere(self, task: Task) -> bool:
        return may_run_elsewhere(task)


_SENDERS = 1_000_000  # the simulated runner's senders: as many as its requests (checks: half)


def _tree_gone(handle: object) -> bool:
    return isinstance(handle, SimTree) and handle.gone


def _key(task: Task) -> tuple[str, str]:
    return task.workflow_id, task.reference_name
