"""A simulated runner's claims: the product's ``PollCore`` driven by the world's events, and the
operator's pause, resume and drain.

``Claims`` is to the simulation what the ``poll-<type>`` thread (``leasecore.runner.upstream.poller``)
is to the product: it asks the core whether a poll may leave and for how many tasks, sends it through
the simulated server, feeds the answer or the failure back, hands the tasks to the runner's admission
(``SimRunner.deliver``) or back to the server (surplus), and looks again when the core says (the
backoff's end) or when a slot is freed. Every decision is the core's.

The operator's faults (``leasecore.sim.operator``) act here. A pause stops the core's claims; a drain
stops polling for good, hands held deliveries back, lets running trees finish until a timeout, then
fences what is left for SHUTDOWN, and exits once every run is reported. Checked here, from the
simulation's own record of what the operator did: no poll and no update-v2 claim leaves a paused or
stopping runner; a drained runner exits with no slot, lease, held start, next run or poll out, and no
copy of its own started after the drain began (from the trees' own records).

Threads: none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from leasecore.handover import StartGate
from leasecore.lease import FenceReason
from leasecore.models import Task
from leasecore.runner.leasing import core as ec  # the engine core: its events and effects
from leasecore.runner.leasing.core import EngineCore
from leasecore.runner.ports import PollSettings
from leasecore.runner.upstream.pollcore import PollCore, SendPoll
from leasecore.runner.upstream.poller import WorkBudget
from leasecore.sim.conductor import Answer, SimConductor
from leasecore.sim.reports import Reports
from leasecore.sim.setting import Bugs, Run, RunnerConfig
from leasecore.sim.trees import Copies
from leasecore.sim.world import World

__all__ = ["Claims", "ClaimsRunner"]


class ClaimsRunner(Protocol):
    """What ``Claims`` uses of its runner (``leasecore.sim.runner.SimRunner``)."""

    world: World
    server: SimConductor
    copies: Copies
    name: str
    config: RunnerConfig
    bugs: Bugs
    engine: EngineCore
    gate: StartGate
    reports: Reports
    runs: dict[str, Run]
    next_runs: dict[str, tuple[Task, float]]
    stopping: bool

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]: ...
    def reply(self, fn: Callable[[Answer], None]) -> Callable[[Answer], None]: ...
    def step(self, event: ec.Event) -> None: ...
    def _engine(self, event: ec.Event) -> list[ec.Effect]: ...
    def carry_out(self, effects: list[ec.Effect]) -> None: ...
    def deliver(self, task: Task, polled_at: float) -> None: ...
    def crash(self) -> None: ...


class Claims:
    """One runner incarnation's poller (its ``PollCore``) and the operator's hold on it."""

    def __init__(self, runner: ClaimsRunner) -> None:
        self.r = runner
        self.world = runner.world
        c = runner.config
        self.core = PollCore(PollSettings(c.task_type, concurrency=c.slots, worker_id=runner.name),
                             WorkBudget(None), rand=self.world.rng.random)
        self.look_at: float | None = None  # the next look at the core armed
        self.paused = False  # the operator's pause (a restart forgets it, as the product's runner does)
        self.drain_began: float | None = None

    # ----- polling ------------------------------------------------------------------------------

    def look(self, at: float | None = None) -> None:
        """Look at the core again in an event of its own at ``at`` (default: now), as the product's
        poll thread wakes up once the handler that freed a slot is done; one such event at a time,
        the earliest."""
        at = self.world.now if at is None else at
        if self.look_at is not None and self.look_at <= at:
            return
        self.look_at = at
        self.world.at(at, "poll", self.r.guard(lambda: self._due(at)))

    def _due(self, at: float) -> None:
        if self.look_at != at:  # an earlier look replaced this one
            return
        self.look_at = None
        now = self.world.now
        self._see_stop()
        request = self.core.take_poll(now)
        if request is None:
            due = self.core.next_wakeup(now)  # the backoff; else room, a resume or an answer wakes it
            if due is not None:
                self.look(due)
            return
        self._poll(request)

    def _see_stop(self) -> None:
        if self.r.stopping and not self.core.stopped:
            self.core.stop()

    def _poll(self, request: SendPoll) -> None:
        r, sent = self.r, self.world.now
        if self.paused or r.stopping:
            self.world.violate("claim while paused", f"runner {r.name} polls while "
                               f"{'paused' if self.paused else 'stopping'}")

        def got(answer: Answer) -> None:
            now = self.world.now
            if not answer.ok:
                self.core.on_failure("timed out" if answer.timeout else f"status {answer.status}",
                                     "unreachable", now)
            else:
                answered = self.core.on_answer([Task.from_json(t) for t in answer.body], now)
                for task in answered.run:
                    r.deliver(task, sent)
                for task in answered.surplus:
                    self._surplus(task, sent)
                self.core.taken_up(len(answered.run) + len(answered.surplus))
            self.look()

        r.server.poll(r.name, request.task_type, request.count, r.reply(got), r.config.http_timeout)

    def release(self, n: int, *, poll: bool) -> None:
        if n > self.core.in_use:
            self.world.violate("slots", f"runner {self.r.name} released more slots than it held "
                               f"({self.core.in_use - n})")
        self.core.release(n)
        if poll and n > 0:
            self.look()

    def reporting_started(self) -> None:
        """A run's child is gone and its result goes out: its slot is free, its report counts against
        the reports that may wait (the product's ``Poller.reporting``)."""
        self._slot_freed()
        self.core.reporting_started()
        self.look()

    def reported(self) -> None:
        """A result counted by ``reporting_started`` (or ``chain_ended``) is over: sent, saved or dropped."""
        self.core.reported()
        self.look()

    def chain_ended(self) -> None:
        """The update-v2 a slot was kept for claimed nothing: its slot is free, its report still counts."""
        self._slot_freed()
        self.core.chain_ended()
        self.look()

    def _slot_freed(self) -> None:
        if self.core.in_use < 1:
            self.world.violate("slots", f"runner {self.r.name} released more slots than it held "
                               f"({self.core.in_use - 1})")

    def keep_for_chain(self) -> bool:
        """The core's word on keeping a reporting run's slot for what its update-v2 claims."""
        self._see_stop()
        kept = self.core.keep_for_chain()
        if kept and (self.paused or self.r.stopping):
            self.world.violate("claim while paused", f"runner {self.r.name} keeps a slot for an update-v2 "
                               f"claim while {'paused' if self.paused else 'stopping'}")
        return kept

    # ----- surplus: what a poll brought that may not run ------------------------------------------

    def _surplus(self, task: Task, polled_at: float) -> None:
        """As the product's admission takes a surplus task: a delivery of a run here acks that run's
        lease (it takes no slot); a next run of one here waits for that run to be over; any other goes
        back unrun."""
        r = self.r
        current = r.runs.get(task.task_id)
        if current is None:
            self._hand_back(task)
        elif task.poll_count > current.task.poll_count and (
            current.phase == "reporting" or current.fence is FenceReason.OWNERSHIP_LOST
        ):
            self._hand_back_after(task, current)
        else:
            effects = r._engine(ec.Track(task, current.policy, polled_at))
            if task.poll_count > current.task.poll_count:
                current.task = task
            r.carry_out(effects)

    def _hand_back_after(self, task: Task, run: Run) -> None:
        if self.r.runs.get(task.task_id) is run:
            self.world.after(0.5, "surplus-wait", self.r.guard(lambda: self._hand_back_after(task, run)))
        else:
            self._hand_back(task)

    def _hand_back(self, task: Task) -> None:
        """Back to the server unrun, no lease here (``hand_back``: IN_PROGRESS, callbackAfterSeconds
        0; unmarked when a previous holder may still run it), sent and retried as the product's
        reporter does (``Reports.hand_back``)."""
        r = self.r
        self.world.log(f"runner {r.name}: hands {task.task_id} (pollCount {task.poll_count}) back unrun")
        r.reports.hand_back(task)

    # ----- the operator -----------------------------------------------------------------------

    def pause(self, seconds: float) -> None:
        """``conductor-run pause``, and a resume ``seconds`` later (unless the runner restarts first)."""
        r = self.r
        self.world.log(f"runner {r.name}: PAUSE for {seconds:.1f} s (operator)")
        self.paused = True
        if not r.bugs.pause_ignored:
            self.core.set_paused(True)
        self.world.after(seconds, "resume", r.guard(self.resume))

    def resume(self) -> None:
        self.world.log(f"runner {self.r.name}: RESUME (operator)")
        self.paused = False
        if self.core.set_paused(False):
            self.look()

    def drain(self, timeout: float) -> None:
        """``conductor-run drain --timeout``: no more polls nor update-v2 claims; a held delivery goes
        back unstarted; running trees go on, heartbeating, until ``timeout``, then are fenced for
        SHUTDOWN; the runner exits once every run is reported and no poll is out."""
        r = self.r
        if r.stopping:
            return
        now = self.world.now
        self.world.log(f"runner {r.name}: DRAIN (timeout {timeout:.0f} s)")
        r.stopping = True
        self.drain_began = now
        self.core.stop()
        for run in list(r.runs.values()):
            if r.engine.entry(run.task.task_id) is None:  # its lease is over (a report still out): as
                continue  # the product's drain, which shuts down the leases the engine holds
            held = run.phase == "held" and not r.bugs.drain_starts_held  # (held: back unstarted now)
            r.step(ec.Shutdown(run.task.task_id, drain_deadline=None if held else now + timeout))
        # (A tree ignoring TERM past the deadline is killed a grace later; then it is reported, or its
        # result saved once its lease is over.)
        hard = now + timeout + r.config.kill_grace + 120.0
        self.world.after(0.5, "drain-check", r.guard(lambda: self._drained(hard)))

    def _drained(self, hard: float) -> None:
        r = self.r
        if (r.runs or self.core.in_flight) and self.world.now < hard:
            self.world.after(0.5, "drain-check", r.guard(lambda: self._drained(hard)))
            return
        self._check_drained(clean=not (r.runs or self.core.in_flight))
        if r.runs or self.core.in_flight:  # (reports still retried: exits as a stop's deadline does)
            self.world.log(f"runner {r.name}: drain deadline passed, exits ({len(r.runs)} run(s) left)")
        else:
            self.world.log(f"runner {r.name}: drained, exits")
        r.crash()

    def _check_drained(self, *, clean: bool) -> None:
        r = self.r
        began = self.drain_began if self.drain_began is not None else self.world.now
        late = [c.label for copies in r.copies.by_key.values() for c in copies
                if c.label.startswith(f"{r.name}/") and c.start > began]
        if late:
            self.world.violate("drain", f"runner {r.name} started {late} after its drain began")
        left = {"slots": self.core.in_use, "leases": r.engine.tracked(), "held": len(r.gate.held()),
                "next runs": len(r.next_runs)}
        if clean and any(left.values()):
            self.world.violate("drain", f"runner {r.name} exits its drain with {left}")
