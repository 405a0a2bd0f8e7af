"""The simulated Conductor: the embedded server's real store, driven in-process, behind a faulty network.

Owns ``SimConductor``: a ``leasecore.server.store.Store`` on the world's clock (ideal or coarse sweeps,
ids from a per-seed counter), its timer (``run_due`` scheduled as world events at ``next_due``), the
network between the runners and the store (``call``: a request may be dropped before it is applied,
applied with its answer lost, answered 500, delayed and so reordered, or black-holed by a partition
of its runner or of all runners; a request its sender gave up on arrives within
``RESET_REACH_SECONDS`` of the give-up or never: the sender reset its connection), the real server's
lost update in extendLease as a switch
(``lost_update``: a heartbeat loads the task when it arrives and writes the whole copy back a moment
later, undoing a final update applied in between, CONDUCTOR_PROTOCOL.md §3), and the server-side
facts the invariants need: every final update applied, per attempt, and what it wrote.

Must not: talk HTTP, read the wall clock, draw randomness other than the world's.

Threads: none (the store's lock is taken and released by the one simulation thread).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leasecore.server.records import TERMINAL_TASK, ApiError, TaskRecord
from leasecore.server.store import Store
from leasecore.sim.world import World

__all__ = ["LAND_BOUND_SECONDS", "Answer", "NetFaults", "SimConductor"]

# The longest a request may travel before the store applies it, plus the longest the store holds a
# heartbeat between loading the task and writing it back. A runner that knows it (the stand-in's
# final update, ``leasecore.sim.runner``) waits that long after a beat of unknown fate.
MAX_TRAVEL_SECONDS = 6.0
MAX_HOLD_SECONDS = 1.5
LAND_BOUND_SECONDS = MAX_TRAVEL_SECONDS + MAX_HOLD_SECONDS
# A share of the final updates whose answer is lost lose it to a connection reset (a middlebox that
# held the answer, then cut the connection), within the sender's timeout, rather than to silence: the
# product's transport may then send the update once more at once, on a new connection (the lean
# transport's resend on a kept-alive connection that died under the request), if the update is one
# it may resend (``finalfailure.transport_may_resend``; the caller says). Found that way: a yield sent
# again after its next run was polled (the jar's lost-yield test, 2 of 4 CI runs).
RESET_SHARE = 0.5
# A client resets the connection of a request it gave up on: a delayed request still arrives up to
# this long after its sender's give-up (held by a middlebox that had taken it), else never. This is
# the network the product assumes (``finalcheck.LATE_ARRIVAL_SECONDS``), not one the simulator checks.
RESET_REACH_SECONDS = 2.0


@dataclass(frozen=True)
class Answer:
    """What a runner gets back: ``ok`` with ``body``, or ``status`` (404, 500) / ``timeout``."""

    ok: bool
    body: Any = None
    status: int = 200
    timeout: bool = False


@dataclass
class NetFaults:
    """Per-request fault probabilities of one seed (all 0: a perfect network)."""

    drop_before: float = 0.0
    drop_after: float = 0.0
    error_500: float = 0.0
    slow: float = 0.0  # a request delayed by up to MAX_TRAVEL_SECONDS (reordered past later ones)
    hold_beat: float = 0.0  # a heartbeat held between load and write-back (lost-update window)
    reliable_reads: bool = False  # reads (ownership checks) pass every fault and partition
    # A final update applied with its answer lost (a gateway's timeout after the server did it): the
    # case the read-back before a second send is for; on top of ``drop_after``, for updates only.
    lose_update_answer: float = 0.0


@dataclass
class ServerFacts:
    """What the store did, for the invariants."""

    applied: dict[tuple[str, int], int] = field(default_factory=dict)  # (taskId, pollCount) -> finals
    written: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # last final write
    parked: dict[tuple[str, int], int] = field(default_factory=dict)  # (taskId, pollCount) -> parks
    undone: int = 0  # final updates a lost-update write-back undid


class SimConductor:
    """The store, its timer and the network in front of it."""

    def __init__(self, world: World, *, sweep_mode: str = "ideal", lost_update: bool = False) -> None:
        self.world = world
        ids = itertools.count(1)
        self.store = Store(clock=world.clock, sweep_mode="coarse" if sweep_mode == "coarse" else "ideal",
                           id_factory=lambda: f"id{next(ids)}")
        self.lost_update = lost_update
        self.faults = NetFaults()
        self.partitioned: dict[str, bool] = {}  # runner name -> cut off (key "*": all runners)
        self.facts = ServerFacts()
        self.fault_count = 0
        self._sweep_at: float | None = None
        self.on_final: Callable[[str, str, dict[str, Any]], None] = lambda tid, status, output: None

    # ----- the store's timer ------------------------------------------------------------------

    def arm_timer(self) -> None:
        """Schedule ``run_due`` at the store's next due time (if earlier than the one armed)."""
        due = self.store.next_due()
        if due is None or (self._sweep_at is not None and self._sweep_at <= due):
            return
        self._sweep_at = due
        self.world.at(due, "sweep", self._sweep)

    def _sweep(self) -> None:
        if self._sweep_at is None or self._sweep_at > self.world.now:
            return
        self._sweep_at = None
        before = self._statuses()
        ran = self.store.run_due()
        if ran:
            self._log_changes(before, "sweep")
        self.arm_timer()

    def _statuses(self) -> dict[str, str]:
        return {tid: t.status for tid, t in self.store.state.tasks.items() if not t.terminal}

    def _log_changes(self, before: dict[str, str], why: str) -> None:
        for tid, status in before.items():
            now_status = self.store.state.tasks[tid].status
            if now_status != status:
                self.world.log(f"server {why}: task {tid} {status} -> {now_status}")

    def requeue(self, task_id: str) -> bool:
        """A queue repair or an operator's requeue: the running task's message is pushed back, so the
        next poll hands it out again (pollCount + 1) while its holder still runs it."""
        store = self.store
        with store.state.lock:
            task = store.state.tasks.get(task_id)
            if task is None or task.status != "IN_PROGRESS":
                return False
            store.state.queue(task.queue_name).push(task_id, self.world.now)
            store.state.notify_queue(task.queue_name)
        self.world.log(f"fault: task {task_id} pushed back to its queue while IN_PROGRESS")
        return True

    # ----- what a runner reads directly (the record, no JSON) ------------------------------------

    def record(self, task_id: str) -> TaskRecord | None:
        return self.store.state.tasks.get(task_id)

    # ----- the network -------------------------------------------------------------------------

    def cut_off(self, runner: str) -> bool:
        return self.partitioned.get(runner, False) or self.partitioned.get("*", False)

    def call(self, runner: str, what: str, apply: Callable[[], Answer], reply: Callable[[Answer], None],
             timeout: float, *, reliable: bool = False, lose_answer: float = 0.0,
             reset: Callable[[Callable[[Answer], None], float], None] | None = None) -> None:
        """Send one request from ``runner``; ``reply`` gets its answer (or a timeout) later."""
        self.send(runner, what, self._sync(apply), reply, timeout, reliable=reliable, lose_answer=lose_answer,
                  reset=reset)

    def _sync(self, apply: Callable[[], Answer]) -> Callable[[Callable[[Answer], None]], None]:
        def serve(respond: Callable[[Answer], None]) -> None:
            try:
                a = apply()
            except ApiError as exc:
                a = Answer(False, status=exc.status)
            self.arm_timer()
            respond(a)

        return serve

    def send(self, runner: str, what: str, serve: Callable[[Callable[[Answer], None]], None],
             reply: Callable[[Answer], None], timeout: float, *, reliable: bool = False,
             lose_answer: float = 0.0,
             reset: Callable[[Callable[[Answer], None], float], None] | None = None) -> None:
        """As ``call``, for a request the store serves over simulated time (``serve(respond)``);
        ``lose_answer``: a chance of losing the answer added to the network's ``drop_after``;
        ``reset(answer, seconds_left)``: called for a share (``RESET_SHARE``) of the lost answers, at a
        connection reset before the sender's timeout, to answer (or send again) as its transport does."""
        world, rng, f = self.world, self.world.rng, self.faults
        if reliable:
            f = NetFaults()
        sent = world.now
        deadline = sent + max(timeout, 0.001)
        done = [False]

        def answer(a: Answer) -> None:
            if done[0]:
                return
            done[0] = True
            reply(a)

        def on_timeout() -> None:
            if not done[0]:
                world.log(f"net {runner} {what}: no answer within {timeout:.2f} s")
            answer(Answer(False, timeout=True))

        world.at(deadline, "timeout", on_timeout)
        if self.cut_off(runner) and not reliable:
            world.log(f"net {runner} {what}: black-holed (partition)")
            return
        draw = rng.random()
        if draw < f.drop_before:
            self.fault_count += 1
            world.log(f"net {runner} {what}: FAULT dropped before the server")
            return
        if draw < f.drop_before + f.error_500:
            self.fault_count += 1
            def refuse() -> None:
                world.log(f"net {runner} {what}: FAULT 500")
                answer(Answer(False, status=500))

            world.after(rng.uniform(0.001, 0.05), "reply", refuse)
            return
        travel = rng.uniform(0.0005, 0.02)
        if rng.random() < f.slow:
            self.fault_count += 1
            travel = rng.uniform(0.5, MAX_TRAVEL_SECONDS)
            world.log(f"net {runner} {what}: FAULT delayed {travel:.2f} s")
        lost = rng.random() < f.drop_after + lose_answer
        back = rng.uniform(0.0005, 0.02)

        def arrive() -> None:
            if world.now > deadline + RESET_REACH_SECONDS:
                world.log(f"net {runner} {what}: reset by its sender before it arrived")
                return

            def respond(a: Answer) -> None:
                if lost:
                    self.fault_count += 1
                    world.log(f"net {runner} {what}: FAULT answer lost ({'ok' if a.ok else a.status})")
                    if reset is not None and world.now < deadline and rng.random() < RESET_SHARE:
                        cut = rng.uniform(0.0, deadline - world.now)
                        world.after(cut, "reset", lambda: reset(answer, deadline - world.now))
                    return
                world.after(back, "reply", lambda: answer(a))

            serve(respond)

        world.after(travel, "arrive", arrive)

    # ----- requests -----------------------------------------------------------------------------

    def extend(self, runner: str, task_id: str, workflow_id: str, reply: Callable[[Answer], None],
               timeout: float) -> None:
        """A heartbeat: extendLease, with the real server's load-then-write-back when switched on."""
        body = {"taskId": task_id, "workflowInstanceId": workflow_id, "extendLease": True}
        rng = self.world.rng

        def apply() -> Answer:
            self.store.update_task(body)
            return Answer(True)

        def held(respond: Callable[[Answer], None]) -> None:
            task = self.record(task_id)
            if task is None:
                respond(Answer(False, status=404))
                return
            loaded = _snapshot(task)
            hold = rng.uniform(0.05, MAX_HOLD_SECONDS)
            self.fault_count += 1
            self.world.log(f"server extendLease {task_id}: loaded ({loaded['status']}), "
                           f"written in {hold:.2f} s")

            def write_back() -> None:
                if loaded["status"] not in TERMINAL_TASK:
                    if task.status != loaded["status"] and task.status in TERMINAL_TASK:
                        self.facts.undone += 1
                        self.world.log(f"server extendLease {task_id}: LOST UPDATE, {task.status} "
                                       f"written back to {loaded['status']}")
                        _restore(task, loaded)
                    task.update_time = self.world.now
                self.arm_timer()
                respond(Answer(True))

            self.world.after(hold, "write-back", write_back)

        if self.lost_update and rng.random() < self.faults.hold_beat:
            self.send(runner, f"extendLease {task_id}", held, reply, timeout)
        else:
            self.call(runner, f"extendLease {task_id}", apply, reply, timeout)

    def update(self, runner: str, attempt: tuple[str, int], result: dict[str, Any], *, v2: bool,
               reply: Callable[[Answer], None], timeout: float, park: bool = False,
               resend: bool = False) -> None:
        """A final update (v1 or update-v2), noting what it changed on the server. ``park``: the
        product's park before a result (IN_PROGRESS with a long callback), one more update of the
        same attempt and not a result of its own: counted apart (``ServerFacts.parked``). ``resend``:
        the sender's transport sends it once more when its connection is reset under it (else that
        reset is an update with no answer)."""
        task_id = str(result["taskId"])

        def apply() -> Answer:
            task = self.record(task_id)
            before = task.status if task is not None else None
            claimed = self.store.update_task_v2(result) if v2 else (self.store.update_task(result), None)[1]
            task = self.record(task_id)
            changed = task is not None and before is not None and task.status != before
            if task is not None and changed and before not in TERMINAL_TASK and park:
                self.facts.parked[attempt] = self.facts.parked.get(attempt, 0) + 1
                self.world.log(f"server park {task_id} (pollCount {attempt[1]}): {before} -> {task.status}")
            elif task is not None and changed and before not in TERMINAL_TASK:
                self.facts.applied[attempt] = self.facts.applied.get(attempt, 0) + 1
                if task.terminal:
                    self.facts.written[task_id] = (task.status, dict(task.output_data))
                    self.on_final(task_id, task.status, task.output_data)
                self.world.log(f"server update {task_id} (pollCount {attempt[1]}): {before} -> {task.status}")
            return Answer(True, body=claimed)

        what = f"update{'-v2' if v2 else ''} {task_id} {'park' if park else result.get('status')}"

        def reset(answer: Callable[[Answer], None], left: float) -> None:
            if resend:
                self.world.log(f"net {runner} {what}: connection reset under it; sent once more")
                self.call(runner, f"{what} (sent again)", apply, answer, left)
            else:
                self.world.log(f"net {runner} {what}: connection reset under it: no answer")
                answer(Answer(False, timeout=True))

        self.call(runner, what, apply, reply, timeout, lose_answer=self.faults.lose_update_answer,
                  reset=reset)

    def poll(self, runner: str, task_type: str, count: int, reply: Callable[[Answer], None],
             timeout: float) -> None:
        def apply() -> Answer:
            return Answer(True, body=self.store.poll(task_type, count=count, timeout_ms=0, worker_id=runner))

        self.call(runner, f"poll {task_type} x{count}", apply, reply, timeout)

    def read(self, runner: str, task_id: str, reply: Callable[[Answer], None], timeout: float) -> None:
        """GET /api/tasks/{id}, reduced to what an ownership check reads: (status, pollCount, workerId)."""
        def apply() -> Answer:
            task = self.record(task_id)
            if task is None:
                return Answer(False, status=404)
            return Answer(True, body=(task.status, task.poll_count, task.worker_id))

        self.call(runner, f"read {task_id}", apply, reply, timeout, reliable=self.faults.reliable_reads)


def _snapshot(task: TaskRecord) -> dict[str, Any]:
    return {"status": task.status, "output_data": dict(task.output_data), "reason": task.reason,
            "end_time": task.end_time, "worker_id": task.worker_id,
            "callback_after_seconds": task.callback_after_seconds}


def _restore(task: TaskRecord, loaded: dict[str, Any]) -> None:
    task.status = loaded["status"]
    task.output_data = loaded["output_data"]
    task.reason = loaded["reason"]
    task.end_time = loaded["end_time"]
    task.worker_id = loaded["worker_id"]
    task.callback_after_seconds = loaded["callback_after_seconds"]
