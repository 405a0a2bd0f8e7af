"""The start of a task on the runner's main thread: a polled (or chained) task up to its running child.

``TaskStarts``, one of the runner's parts (``runner.Runner`` builds them, handing each the shared
``table.TaskTable`` and the ports it needs). The pollers' threads and the reporter's sender threads
start a task's lease (``engine.track``: from the poll's send time, or the update-v2's for a task
claimed with a final update, ``leasecore.runner.chain``) and put a ``TaskPolled`` on the queue; the
main thread then asks ``decisions.admit`` what the delivery means (a second delivery of a task
running here is not started twice; a next run polled while the previous run ends waits for it; a
surplus task, or one claimed while stopping, goes straight back; a delivery whose lease is fenced or
past its TERM point never starts; a re-delivery whose previous holder may still run it, or a retry
whose earlier attempt's tree is dying here, is held in ``leasecore.handover.StartGate``, lease
heartbeated) and carries it out. A held task whose hold is over is read back first
(``decisions.held_start``: started only while the server still has it IN_PROGRESS with our
pollCount). The rest start a child through the supervisor without waiting for its exec. Ending
tasks is ``task_end``'. Main thread only, except ``on_polled``/``on_surplus``/``on_chained`` (poller
and sender threads) and the read-backs (a small pool, answering through the queue).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from leasecore.clock import Clock
from leasecore.errors import ProcessError
from leasecore.handover import StartGate, logical_key
from leasecore.lease import FenceReason, LeasePolicy
from leasecore.masking import MIN_MASKED_CHARS, Masker
from leasecore.metrics import Observer
from leasecore.models import Task, TaskResult, TaskStatus
from leasecore.process.secretenv import missing_metadata, missing_reason
from leasecore.process.spec import CommandSpec
from leasecore.runner.chain import hand_back
from leasecore.runner.loop.checkpoints import ResumePort, child_deadline, open_watch, resume_retry, start_line
from leasecore.runner.loop.decisions import (
    READ_AGAIN_SECONDS,
    AckDuplicate,
    BackUnstarted,
    ChainedBack,
    Delivery,
    Earlier,
    EndUnstarted,
    HandBack,
    HeldStart,
    HeldView,
    Hold,
    LeaseNow,
    Read,
    Start,
    WaitBehind,
    admit,
    held_start,
)
from leasecore.runner.loop.events import ChainEnded, ChildExited, Event, HeldRead, TaskPolled
from leasecore.runner.loop.status import InFlight, NextRun, Phase
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.loop.task_end import TaskEnds
from leasecore.runner.ports import ChildPort, EnginePort, SupervisorPort, TaskReader, TaskTypePlan
from leasecore.runner.secretbook import SecretBook
from leasecore.runner.upstream.logsink import LogStreamer
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.reporter import Reporter
from leasecore.snapshot import MAX_OUTPUT_LINES

log = logging.getLogger("conductor_run.runner")

_READERS = 2  # threads reading held tasks back (each read is bounded by the lease's HTTP timeout)


class TaskStarts:
    """Polled and chained tasks up to their running child (see the module docstring)."""

    def __init__(
        self, table: TaskTable, ends: TaskEnds, *, events: queue.SimpleQueue[Event], clock: Clock,
        metrics: Observer, engine: EnginePort, supervisor: SupervisorPort, reporter: Reporter,
        logs: LogStreamer, pollers: dict[str, Poller], budget: WorkBudget, gate: StartGate,
        secrets: SecretBook, resume: ResumePort | None, reader: TaskReader | None,
    ) -> None:
        """``resume``: where a retry's earlier checkpoint is looked up (None: nowhere); ``reader``:
        reads a held task back before its start (None: the port cannot; it starts unread)."""
        self._t, self._ends, self._events, self._clock, self._metrics = table, ends, events, clock, metrics
        self._engine, self._supervisor, self._reporter, self._logs = engine, supervisor, reporter, logs
        self._pollers, self._budget, self._gate, self._secrets = pollers, budget, gate, secrets
        self._resume_port, self._reader = resume, reader
        self._read_pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the read-back threads (a read in flight ends by its own timeout)."""
        if self._read_pool is not None:
            self._read_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ other threads

    def on_surplus(self, task: Task, polled_at: float, *, poller: str) -> None:
        self._events.put(TaskPolled(task, polled_at, surplus=True, poller=poller))

    def on_polled(self, task: Task, polled_at: float, *, poller: str = "") -> None:
        # On the poller's thread, for every task of the batch before any is spawned: the lease starts
        # at the poll's send time, so a task waiting for its spawn behind others (1000 at once) is
        # already heartbeated. A task delivered again while it runs here is re-tracked the same way
        # (the new poll reset the server's clock, and its pollCount is ours).
        policy = self._track_at_poll(task, polled_at)
        task = resume_retry(task, self._resume_port)  # (heartbeated meanwhile: tracked above)
        self._events.put(TaskPolled(task, polled_at, policy, poller=poller))

    def on_chained(self, task: Task | None, sent_at: float, *, from_task: str, poller: str) -> None:
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
            policy = self._t.plan_for(task.task_type).make_policy(task)
            self._engine.track(task, policy, polled_at=polled_at)
        except Exception:  # never lose the task: the main thread tracks it (or reports the failure)
            log.exception("task %s: could not start its lease at poll time", task.task_id)
            return None
        return policy

    # ------------------------------------------------------------------ admission

    def replay(self, run: NextRun) -> None:
        """A next run whose earlier run was just forgotten: admitted as if delivered now."""
        self.admit(run.task, run.polled_at, run.policy, surplus=run.surplus, chained=run.chained)

    def admit(
        self, task: Task, polled_at: float, policy: LeasePolicy | None = None, *, surplus: bool = False,
        chained: bool = False,
    ) -> None:
        """Run ``task`` (polled at ``polled_at``, or claimed by an update-v2 sent then: ``chained``),
        or hold it, queue it behind its previous run, or hand it back, as ``decisions.admit`` says;
        its slot is held either way. ``policy``: tracked at poll time with it."""
        plan = self._t.plan_for(task.task_type)
        entry = self._t.tasks.get(task.task_id)
        if entry is None and policy is not None and task.poll_count != 1 and not self._tracked(task.task_id):
            # Tracked at poll time while an earlier run of it was still here (a next run replayed by
            # forget, or a delivery whose event came after that run was forgotten): that track acked
            # the earlier run's lease, which may have ended with it. (pollCount 1: no earlier run.)
            policy = None
        now = self._clock.monotonic()
        fresh = policy or plan.make_policy(task)  # (its lease starts with it when not tracked at poll)
        start_delay = fresh.start_delay_seconds
        earlier = _earlier(entry, self._engine, self._ends)
        lease = self._lease_now(task.task_id, policy, now)
        dying_here = (earlier is None and not surplus and lease in (LeaseNow.LIVE, LeaseNow.UNTRACKED)
                      and self._dying_here(task))
        stopping = self._t.stopping_since is not None
        decision = admit(Delivery(task.poll_count, earlier, surplus, chained, stopping, lease, start_delay,
                                  dying_here))
        if isinstance(decision, WaitBehind):
            if decision.why == "reporting":  # its own lease (tracked at poll) holds it meanwhile
                log.info("task %s polled again (pollCount %d) while its result is reported: running it "
                         "once that report is done", task.task_id, task.poll_count)
            else:  # no heartbeats meanwhile: the copy's lease is fenced for good
                log.info("task %s polled again (pollCount %d) while its earlier copy here is killed (no "
                         "longer ours): running it once that copy is gone", task.task_id, task.poll_count)
            if self._t.next_runs.keep(NextRun(task, polled_at, policy, surplus, chained)):
                self._give_back(plan)
            return
        if isinstance(decision, AckDuplicate):
            assert entry is not None
            log.warning("task %s delivered again while it runs here: not starting it twice", task.task_id)
            if decision.newer:
                entry.task = task  # its pollCount is ours now (kept with a result saved for later)
            if policy is None and entry.tracked and entry.policy is not None:  # not re-tracked at poll
                self._engine.track(task, entry.policy, polled_at=polled_at)
            if decision.give_back:  # a surplus task took no slot and no budget
                self._give_back(plan)
            return
        if isinstance(decision, HandBack):
            self._hand_back(task, plan)
            return
        entry = self._enter(task, plan, policy)
        if isinstance(decision, ChainedBack):
            log.warning("task %s (%s): claimed with a final update as the runner began to stop; handing "
                        "it back (re-queued at once)", task.task_id, task.task_type)
            if entry.tracked:
                self._engine.child_exited(task.task_id)
            self._ends.report(entry, hand_back(task, plan.worker_id))
            return
        if isinstance(decision, BackUnstarted):  # polled while stopping (a long poll was in flight)
            self._ends.end_unstarted(entry, start_delay, held=False)
            return
        if isinstance(decision, EndUnstarted):
            log.warning("task %s: not starting it: %s", task.task_id, decision.why)
            self._ends.end_unstarted(entry, start_delay, held=False, why=decision.why)
            return
        assert isinstance(decision, Hold | Start)
        if decision.track:
            entry.policy = fresh
            self._engine.track(task, entry.policy, polled_at=polled_at)
            entry.tracked = True
        if isinstance(decision, Start):
            self._start_child(entry)
            return
        assert entry.policy is not None
        # From now, not from the poll's send time (a long poll may have waited 5 s before the server
        # handed it out): the previous holder's fence counts from the hand-out, which is before now.
        why = self._gate.hold(task, now + entry.policy.start_delay_seconds, now)
        entry.phase = Phase.WAITING
        self._engine.start_held(task.task_id)  # its exec timeout counts from the command's start
        self._metrics.on_task_held(task.task_type, True)  # it holds its slot meanwhile
        log.warning("task %s: not starting it yet: %s", task.task_id, why)

    def _enter(self, task: Task, plan: TaskTypePlan, policy: LeasePolicy | None) -> InFlight:
        entry = InFlight(task, plan, index=self._t.tally.start(), started_at=self._clock.now())
        entry.masker = self._secrets.for_task(plan.masker, task.runtime_metadata)
        self._secrets.enter(task.task_id, task.runtime_metadata.values())  # (left in forget)
        metadata = task.runtime_metadata  # (none, the usual task: no names to look at)
        if metadata and (short := self._secrets.too_short(task.task_type, metadata)):
            log.warning("task type %s: the runtime metadata value of %s is shorter than %d characters and "
                        "is not masked in what the runner writes", task.task_type, ", ".join(short),
                        MIN_MASKED_CHARS)
        self._t.tasks[task.task_id] = entry
        if policy is not None:  # tracked at poll time
            entry.policy, entry.tracked = policy, True
        return entry

    def _give_back(self, plan: TaskTypePlan) -> None:
        self._pollers[plan.poll.task_type].release()
        self._budget.give_back(1)

    def _tracked(self, task_id: str) -> bool:
        return self._engine.lease_times(task_id) is not None

    def _lease_now(self, task_id: str, policy: LeasePolicy | None, now: float) -> LeaseNow:
        """Its lease when handled: fenced, past its TERM point (the engine's timer has not fenced it
        yet: say the process was stalled between the poll's answer and now), live, or not tracked."""
        if policy is None:
            return LeaseNow.UNTRACKED
        times = self._engine.lease_times(task_id)  # (one look: its fence and its deadlines)
        if times is None:
            return LeaseNow.UNTRACKED
        fence, lease_deadline, hard_deadline = times
        if fence is not None:
            return LeaseNow.FENCED
        first = _earliest(lease_deadline, hard_deadline)
        if first is not None and now >= first - policy.fence_lead_seconds:
            return LeaseNow.PAST_TERM
        return LeaseNow.LIVE

    def _dying_here(self, task: Task) -> bool:
        """A tree of an earlier attempt of ``task``'s logical task is dying here (one still in flight
        here under another task id, say one the server gave up on, counts too)."""
        key = logical_key(task)
        if key is not None:  # (none: no other attempt can be told apart, nothing to look for)
            workflow_id, reference_name = key
            for entry in self._t.tasks.values():  # every start: one pass, no tuple made per task
                other, child = entry.task, entry.child
                if (child is not None and other.workflow_id == workflow_id
                        and other.reference_name == reference_name and other.task_id != task.task_id):
                    self._gate.dying.add(other, child)
        return self._gate.dying.still_dying(task)

    # ------------------------------------------------------------------ held tasks

    def start_released(self) -> None:
        """Held tasks whose hold is over: read back, then started (or forgotten) by ``held_start``."""
        if not self._gate:  # (the usual turn: none held)
            return
        for task in self._gate.due(self._clock.monotonic()):
            entry = self._t.tasks.get(task.task_id)
            if entry is not None and entry.phase is Phase.WAITING:
                self._held_step(entry)

    def on_held_read(self, event: HeldRead) -> None:
        entry = self._t.tasks.get(event.task_id)
        if entry is None or entry.phase is not Phase.WAITING:
            return  # (ended meanwhile: fenced, stopped)
        if entry.task.poll_count != event.poll_count:
            # Delivered to us again while the read was in flight: its answer says nothing about the
            # delivery held now. Read again (else the task would wait for ever on a read marked sent).
            if entry.read is Read.IN_FLIGHT:
                entry.read = Read.NOT_SENT
                self._held_step(entry)
            return
        entry.read = Read.ANSWERED if event.ok else Read.FAILED
        entry.ownership = event.ownership
        self._held_step(entry)

    def _held_step(self, entry: InFlight) -> None:
        task = entry.task
        now = self._clock.monotonic()
        read = entry.read if self._reader is not None else Read.NO_READER
        step, why = held_start(HeldView(task.poll_count, self._lease_now(task.task_id, entry.policy, now),
                                        read, entry.ownership))
        if step is HeldStart.READ_BACK:
            entry.read = Read.IN_FLIGHT
            self._read_back(entry)
        elif step is HeldStart.READ_AGAIN:
            entry.read = Read.NOT_SENT
            self._gate.hold(task, now + READ_AGAIN_SECONDS, now)
        elif step is HeldStart.NOT_OURS:
            log.warning("task %s: no longer ours once its hold was over (%s): not starting it; nothing is "
                        "reported", task.task_id, why)
            self._metrics.on_task_held(task.task_type, False)
            if entry.tracked:
                self._engine.child_exited(task.task_id)
            self._ends.forget(entry, None)
        elif step is HeldStart.START:
            entry.phase = Phase.RUNNING
            self._metrics.on_task_held(task.task_type, False)
            log.info("task %s: its previous holder must have stopped by now: starting it%s", task.task_id,
                     "" if read is Read.NO_READER else " (read back: still ours)")
            self._start_child(entry)
        # WAIT: a read-back is in flight, or the lease's fence is on its way (it ends the task)

    def _read_back(self, entry: InFlight) -> None:
        reader, task = self._reader, entry.task
        assert reader is not None
        timeout = entry.policy.http_timeout_seconds if entry.policy is not None else 10.0
        if self._read_pool is None:
            self._read_pool = ThreadPoolExecutor(_READERS, thread_name_prefix="held-read")

        def read() -> None:  # on a read-back thread
            try:
                ownership = reader.get_task_ownership(task.task_id, timeout_seconds=timeout)
            except Exception as exc:  # any failure: read again later (the lease bounds the wait)
                log.info("task %s: could not read it back before its start: %s", task.task_id, exc)
                self._events.put(HeldRead(task.task_id, task.poll_count, ok=False))
                return
            self._events.put(HeldRead(task.task_id, task.poll_count, ok=True, ownership=ownership))

        self._read_pool.submit(read)

    # ------------------------------------------------------------------ the child

    def _start_child(self, entry: InFlight) -> None:
        task, plan = entry.task, entry.plan
        task_id = task.task_id
        missing = (missing_metadata(task.declared_metadata, plan.required_metadata, task.runtime_metadata)
                   if task.declared_metadata or plan.required_metadata else None)  # (none: the usual task)
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
            self._ends.report_not_started(entry, exc)
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
        if entry.tracked:  # (None: forgotten meanwhile, no deadline to tell)
            times = self._engine.lease_times(entry.task.task_id)
            hard = None if times is None else times[2]
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
        self._ends.report(entry, TaskResult(task.task_id, task.workflow_id,
                                            TaskStatus.FAILED_WITH_TERMINAL_ERROR,
                                            reason_for_incompletion=reason, worker_id=entry.plan.worker_id))

    def _hand_back(self, task: Task, plan: TaskTypePlan) -> None:
        """A task polled beyond our slots and budget: never dropped (the server counts it as ours until
        R), but re-queued at once for any worker (``leasecore.runner.chain.hand_back``: IN_PROGRESS
        with callbackAfterSeconds 0, no retry spent). Not tracked: no lease, no entry."""
        log.warning("task %s (%s): polled beyond this runner's slots and task budget; handing it back "
                    "to the server (re-queued at once)", task.task_id, task.task_type)
        self._t.handing_back.add(task.task_id)
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


def _earliest(lease_deadline: float | None, hard_deadline: float | None) -> float | None:
    """The earlier of a lease's server deadlines (None: it has neither)."""
    if lease_deadline is None:
        return hard_deadline
    return lease_deadline if hard_deadline is None else min(lease_deadline, hard_deadline)


def _earlier(entry: InFlight | None, engine: EnginePort, ends: TaskEnds) -> Earlier | None:
    """The run of the same task id still here, as admission sees it."""
    if entry is None:
        return None
    lost = entry.tracked and engine.fence_reason(entry.task.task_id) is FenceReason.OWNERSHIP_LOST
    return Earlier(entry.task.poll_count, reporting=entry.phase is Phase.REPORTING, ownership_lost=lost,
                   yield_waiting=ends.held_for_tree(entry.task.task_id))


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
    if capped == grace:
        return spec
    # A lease shorter than 4 x kill_grace caps every task of its type alike: the capped spec is made
    # once per spec and cap (a replace is ~8 us), not per task; main thread only, bounded.
    kept = _CAPPED.get((id(spec), capped))
    if kept is not None and kept[0] is spec:
        return kept[1]
    if len(_CAPPED) >= _CAPPED_MAX:
        _CAPPED.clear()
    made = dataclasses.replace(spec, kill_grace_seconds=capped)
    _CAPPED[(id(spec), capped)] = (spec, made)  # (the spec is kept with it: its id stays its own)
    return made


_CAPPED: dict[tuple[int, float], tuple[CommandSpec, CommandSpec]] = {}
_CAPPED_MAX = 64
