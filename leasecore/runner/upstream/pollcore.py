"""The poller's decisions as a pure core: when a poll may go out and for how many tasks, what its
answer or failure means, and the slots and work budget behind it.

``PollCore`` keeps one task type's counts: slots in use (running tasks, tasks claimed and not yet
started, a slot kept for the task an update-v2 may claim), tasks handed to the runner and not yet
taken up, results being reported, whether the type is paused or polling has stopped, the poll in
flight, and the earliest instant the next poll may leave (from ``PollBackoff``). Each method is an
event its driver observes (a slot freed, a result reporting, a poll answered or failed, pause or
resume, a reload, the stop) and returns what to do: ``take_poll`` a ``SendPoll`` (its slots and
budget reserved) or nothing; ``on_answer`` the tasks to run, the surplus to hand back and the delay;
``on_failure`` the delay, the reachability line and whether to give up. ``next_wakeup`` is the
instant a poll becomes due by time alone; ``waiting_for`` says what else it waits for.

A claimed task is never dropped: the server counts every task of a poll's answer as ours until R,
even past the count asked. Such extras run too (a slot overshoot of at most the count asked, within
the work budget); any beyond that are surplus, handed back. Tasks answered to a poll that left
before a pause are all surplus.

No I/O, no threads, no clock reads (``now`` is an argument): the ``poll-<type>`` thread of
``leasecore.runner.upstream.poller`` drives it under its lock with HTTP and sleeps; the simulator
(``leasecore.sim.runner``) drives it from its world's events and clock. The budget is the one
collaborator shared between task types (``Budget``: the poller's thread-safe ``WorkBudget``).
Must not: log (lines to log are returned), read a clock, call the server.
Threads: none of its own; not thread-safe (its driver serialises the calls).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from leasecore.models import Task
from leasecore.runner.ports import PollSettings
from leasecore.runner.upstream.pollpolicy import BackoffPolicy, FailureKind, PollBackoff, Reachability

__all__ = [
    "REPORTS_WAITING_MIN",
    "Answered",
    "Budget",
    "Failed",
    "PollCore",
    "SendPoll",
    "WaitingFor",
    "backoff_policy",
]

# Results being reported hold no slot, but at most max(concurrency, 8) of them may wait, or a server
# refusing updates while it hands out tasks would have us claim its whole queue (each lease held,
# each result kept). Not fewer than 8: with one slot, the next poll must not wait for each report's
# round trip.
REPORTS_WAITING_MIN = 8

# What keeps the next poll from leaving: the stop (or a refusal at start), the poll still out, a pause,
# no room (every slot taken, too many tasks not taken up or reporting), the work budget, the backoff.
WaitingFor = Literal["stop", "in flight", "pause", "room", "budget", "backoff"]


Tasks = tuple[Task, ...]


class Budget(Protocol):
    """How many more tasks this run may start, shared by every task type (``WorkBudget``)."""

    def reserve(self, want: int) -> int: ...
    def give_back(self, count: int) -> None: ...
    @property
    def exhausted(self) -> bool: ...


@dataclass(frozen=True)
class SendPoll:
    """Effect: poll ``task_type`` for up to ``count`` tasks (its slots and budget are reserved)."""

    task_type: str
    count: int
    timeout_ms: int
    worker_id: str | None
    domain: str | None


@dataclass(frozen=True, eq=False)
class Answered:
    """What a poll's answer means: hand ``run`` to the runner, hand ``surplus`` back to the server
    (both taken up later, one by one), poll again not before ``delay``; log ``note`` (the server is
    reachable again) and ``lines`` (level name, text)."""

    run: tuple[Task, ...]
    surplus: tuple[Task, ...]
    delay: float
    note: str | None = None
    lines: tuple[tuple[Literal["info", "warning"], str], ...] = ()


@dataclass(frozen=True, eq=False)
class Failed:
    """What a failed poll means: poll again not before ``delay``; log ``note`` (a change of the
    server's reachability) at warning level; ``give_up``: the server refused the very first polls
    (no or wrong credentials), and polling ends here."""

    delay: float
    note: str | None = None
    give_up: bool = False


def backoff_policy(settings: PollSettings) -> BackoffPolicy:
    """The delays between polls for ``settings``: an empty poll waits the poll interval, doubling
    while polls stay empty, up to 1 s (or the interval, when longer)."""
    base = max(0.01, settings.interval_seconds)
    return BackoffPolicy(empty_base_seconds=base, empty_cap_seconds=max(1.0, base))


class PollCore:
    """One task type's claims: slots, unstarted and reporting counts, pause, stop, the next poll."""

    def __init__(
        self,
        settings: PollSettings,
        budget: Budget,
        *,
        backoff: PollBackoff | None = None,
        rand: Callable[[], float] = random.random,
        end_on_refusal_at_start: bool = False,
    ) -> None:
        """``end_on_refusal_at_start``: when the server refuses the polls (401/403) before any poll was
        answered, ``on_failure`` gives up instead of backing off: an auth failure at start must never
        look like an idle queue. Once a poll was answered, refusals are an outage: backed off."""
        self.settings = settings
        self._budget = budget
        self._backoff = backoff or PollBackoff(backoff_policy(settings), rand=rand)
        self._end_on_refusal = end_on_refusal_at_start
        self.paused = settings.paused  # then set_paused (the runner's pause/resume/reload)
        self.stopped = False
        self.in_use = 0  # slots taken: reserved for the poll out, running, or kept for an update-v2
        self.unstarted = 0  # handed to the runner (to run or hand back), not yet taken up
        self.reporting = 0  # results being reported after their child is gone (no slot held)
        self.in_flight = 0  # slots reserved by the poll that is out now (0: none is out)
        self.not_before = float("-inf")  # the backoff: no poll before this instant
        self.backoff_seconds = 0.0  # the last delay decided
        self.answered = False  # some poll was answered
        self.reachability = Reachability()

    @property
    def consecutive_errors(self) -> int:
        return self._backoff.consecutive_errors

    # ------------------------------------------------------------------ when to poll

    def waiting_for(self, now: float) -> WaitingFor | None:
        """What keeps a poll from leaving at ``now``; None: ``take_poll`` sends one (unless another
        task type took the last of the budget meanwhile)."""
        if self.stopped:
            return "stop"
        if self.in_flight:
            return "in flight"
        if self.paused:
            return "pause"
        if self.full:
            return "room"
        if now < self.not_before:
            return "backoff"
        if self._budget.exhausted:
            return "budget"
        return None

    def next_wakeup(self, now: float) -> float | None:
        """The instant a poll becomes due by time alone (the backoff's end); None when it waits for
        an event instead (a slot, a task taken up, a result reported, a resume, an answer, another
        type's budget given back, the stop) or is due now."""
        if self.waiting_for(now) == "backoff":
            return self.not_before
        return None

    @property
    def full(self) -> bool:
        """No claim may be made: every slot taken, or too many tasks not taken up or reporting."""
        s = self.settings
        return (
            self.in_use >= s.concurrency
            or self.unstarted >= max(1, s.max_unstarted)
            or self.reporting >= max(s.concurrency, REPORTS_WAITING_MIN)
        )

    def take_poll(self, now: float) -> SendPoll | None:
        """A poll for as many tasks as there is room for (free slots, at most ``max_unstarted`` not
        taken up) and budget: its slots and budget are reserved until ``on_answer``/``on_failure``.
        None: not now (``waiting_for`` says why)."""
        if self.waiting_for(now) is not None:
            return None
        s = self.settings
        room = min(s.concurrency - self.in_use, max(1, s.max_unstarted) - self.unstarted)
        granted = self._budget.reserve(room)
        if granted == 0:  # another task type took the last of the budget
            return None
        self.in_use += granted
        self.in_flight = granted
        return SendPoll(s.task_type, granted, s.timeout_ms, s.worker_id, s.domain)

    # ------------------------------------------------------------------ a poll's outcome

    def on_answer(self, tasks: Sequence[Task], now: float) -> Answered:
        """The poll out was answered at ``now`` with ``tasks``."""
        count, self.in_flight = self.in_flight, 0
        self.answered = True
        lines: list[tuple[Literal["info", "warning"], str]] = []
        if self.paused and tasks:  # paused while this poll was out: nothing it claimed runs here
            self._unreserve(count)
            run: Tasks = ()
            surplus = tuple(tasks)
            lines.append(("info", f"task type {self.settings.task_type} was paused during a poll: handing "
                                  f"its {len(tasks)} task(s) back"))
        else:
            run, surplus, line = self._split(tasks, count)
            if line is not None:
                lines.append(("warning", line))
        self.unstarted += len(run) + len(surplus)
        self.reachability, note = self.reachability.on_success()
        delay = self._backoff.on_tasks() if tasks else self._backoff.on_empty()
        self._wait(now, delay)
        return Answered(run, surplus, delay, note, tuple(lines))

    def on_failure(self, error: str, kind: FailureKind, now: float) -> Failed:
        """The poll out failed at ``now`` (unreachable, 5xx, refused...): its reservation goes back."""
        count, self.in_flight = self.in_flight, 0
        self._unreserve(count)
        if kind in ("auth", "no_credentials") and self._end_on_refusal and not self.answered:
            self.stopped = True
            return Failed(0.0, give_up=True)
        self.reachability, note = self.reachability.on_failure(error, kind)
        delay = self._backoff.on_error()
        self._wait(now, delay)
        return Failed(delay, note)

    def _wait(self, now: float, delay: float) -> None:
        self.backoff_seconds = delay
        self.not_before = now + delay

    def _split(self, tasks: Sequence[Task], count: int) -> tuple[Tasks, Tasks, str | None]:
        """The tasks to run and the surplus to hand back; slots and budget follow the tasks run."""
        extra = len(tasks) - count
        if extra <= 0:
            self._unreserve(count - len(tasks))
            return tuple(tasks), (), None
        granted = self._budget.reserve(min(extra, count))  # overshoot: up to `count` more
        self.in_use += granted
        kind = self.settings.task_type
        line = (f"the server returned {len(tasks)} task(s) for a poll of {count} ({kind}): running "
                f"{granted} more than asked, handing {extra - granted} back")
        return tuple(tasks[: count + granted]), tuple(tasks[count + granted :]), line

    def _unreserve(self, count: int) -> None:
        if count:
            self._budget.give_back(count)
            self.release(count)

    # ------------------------------------------------------------------ the runner's side

    def release(self, count: int = 1) -> None:
        """``count`` tasks are finished (or were never started): their slots are free again."""
        self.in_use = max(0, self.in_use - count)

    def reporting_started(self) -> None:
        """A task's child is gone and its result is being reported: its slot is free for another task,
        and it counts against the reports that may wait (``REPORTS_WAITING_MIN``)."""
        self.in_use = max(0, self.in_use - 1)
        self.reporting += 1

    def reported(self) -> None:
        """A result counted by ``reporting_started`` is delivered, saved for later or dropped."""
        self.reporting = max(0, self.reporting - 1)

    def keep_for_chain(self) -> bool:
        """A task's child is gone and its final update may claim the next task (update-v2): keep its
        slot for that task, with one unit of the work budget. False (nothing kept: call
        ``reporting_started``) when the type is paused, polling stopped or the budget is spent. The
        claimed task then takes the slot over (no call); if nothing comes, ``chain_ended``."""
        if self.paused or self.stopped:
            return False
        return self._budget.reserve(1) == 1

    def chain_ended(self) -> None:
        """The update-v2 of a task kept by ``keep_for_chain`` claimed nothing: its budget unit goes
        back, and its slot is free while its result is still reported (as ``reporting_started``)."""
        self._budget.give_back(1)
        self.reporting_started()

    def taken_up(self, count: int = 1) -> None:
        """The runner has dealt with ``count`` handed-over tasks (started, refused or handed back)."""
        self.unstarted = max(0, self.unstarted - count)

    # ------------------------------------------------------------------ the operator's side

    def set_paused(self, paused: bool) -> bool:
        """Stop (or restart) claiming: no poll leaves while paused, whatever the poll out brings is
        surplus, and no slot is kept for update-v2; running tasks are not touched. Returns whether
        that changed anything."""
        changed = self.paused != paused
        self.paused = paused
        return changed

    def reconfigure(self, settings: PollSettings) -> None:
        """Poll with ``settings`` from the next poll on (a reload: concurrency, poll timeout, domain,
        interval...); the paused state is ``set_paused``'s, not ``settings.paused``."""
        if settings.task_type != self.settings.task_type:
            raise ValueError("a poller's task type cannot change")
        if settings.interval_seconds != self.settings.interval_seconds:
            self._backoff.policy = backoff_policy(settings)
        self.settings = settings

    def stop(self) -> None:
        """Polling ends (the runner stops): no poll leaves, no slot is kept for update-v2."""
        self.stopped = True
