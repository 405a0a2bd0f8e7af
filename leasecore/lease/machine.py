"""One task's lease as a pure state machine: (state, event, now) -> actions.

Owns every timing decision about a polled task while it runs: when to heartbeat, when to retry a
failed beat, when to check ownership, when to fence (TERM, then KILL, the child's tree) and why, and
when the lease is over. Events are ``on_*`` methods carrying ``now`` (monotonic seconds); each returns
the actions now due (``leasecore.lease.actions``), and ``next_wakeup()`` says when to ``on_tick``.
The numbers come from its ``LeasePolicy`` (``leasecore.lease.policy``), the meaning of an ownership
answer from ``leasecore.lease.ownership``. The rules are in ``Lease``'s docstring.

Must not touch: a clock (never read: every event carries ``now``), I/O, threads, processes, or the
server. Carrying the actions out is the caller's: the lease engine (``leasecore.runner.leasing.engine``) in
the product, a test with a ``FakeClock`` otherwise.

Threads: none of its own, and not thread-safe: the lease engine calls a lease only under its one
lock (from its timer thread, its senders and the runner's loop); ``_enter`` keeps time monotonic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from leasecore.lease.actions import (
    FINAL_FENCES,
    Action,
    CheckOwnership,
    FenceReason,
    KillTree,
    LeaseState,
    LeaseView,
    SendHeartbeat,
    TerminateTree,
)
from leasecore.lease.ownership import judge_ownership
from leasecore.lease.policy import MIN_RETRY_GAP_SECONDS, LeasePolicy
from leasecore.models import TaskOwnership

__all__ = ["Lease"]

_NEVER = math.inf
# After the child exited, a beat waits for the final update; if none starts, the beat goes this long
# before the last moment an attempt may start (room for it and a retry: MIN_RETRY_GAP_SECONDS).
EXITED_BEAT_ROOM_SECONDS = 1.0


def _finite(value: float) -> float | None:
    return value if value != _NEVER else None


def _no_jitter() -> float:
    return 0.0


class Lease:
    """The lease of one task, from its poll to its final report. Not thread-safe.

    Rules (DESIGN.md §4 and §6, CONDUCTOR_PROTOCOL.md §3, §4, §10; the deadlines' arithmetic is
    ``LeasePolicy``'s):

    * **Heartbeats** are due one interval after the *send* time of the newest acknowledged beat (or of
      the poll). A beat that went out late (its sender was busy) keeps the cadence: the next is due one
      interval after the late beat was *planned*, but at least half an interval after it was sent, so
      the gaps the server sees stay near the interval (the deadline still counts from the send time).
      A failed beat is retried after the ``retry_backoff`` delays, each at most half the time left to
      the TERM point (at least ``MIN_RETRY_GAP_SECONDS``), for as long as the lease lasts. The first
      beat and check come after (1 - ``first_attempt_spread`` x random()) of their interval.
    * **No attempt outlives the lease:** its timeout is ``min(http cap, TERM point - now)``, and none
      starts with less than ``min_attempt_seconds`` left. One beat and one check at most in flight.
    * **Fencing at the TERM point is unconditional.** An ack *processed* after it is ignored (it cannot
      cancel the fence or move the deadline), even if its beat was sent in time. An expired lease stays
      expired (no more beats or checks), also after the child has exited. Our own deadlines (exec
      timeout, shutdown) TERM at the deadline and KILL a grace later, never past a server deadline's
      KILL point. The exec timeout counts from ``on_child_started`` (else the poll; with a start delay
      or after ``on_start_held``, only from the start).
    * **Ownership** is checked every ``ownership_check_every_seconds`` and right after the first
      failed beat of a streak; what an answer means is ``leasecore.lease.ownership``'s. A lost task is
      fenced with OWNERSHIP_LOST (report nothing). A check that finds the task ours keeps the lease
      for ``ownership_window_seconds`` from when it was started (as an ack does for the lease
      timeout), until the child exits: the lease deadline is the earlier of the two. A failed check
      is retried like a beat (sooner, within the time left).
    * After ``on_child_exited`` nothing is terminated or killed any more, and no heartbeat starts
      before the first final update does, unless the lease would run out first (then one goes as late
      as the lease allows: ``EXITED_BEAT_ROOM_SECONDS`` before the last moment an attempt may start).
      From ``on_final_update_started`` no beat or check starts (a check answered
      meanwhile is ignored: our own update changes the status); ``on_final_update_failed`` resumes them
      (an overdue beat goes out at once) so the lease outlives a slow report. After ``on_reported`` no
      action is ever returned.
    """

    def __init__(
        self,
        policy: LeasePolicy,
        polled_at: float,
        *,
        poll_count: int = 0,
        random: Callable[[], float] = _no_jitter,
    ):
        self.policy = policy
        self._random = random
        self._poll_count = poll_count  # the newest pollCount delivered to us (0: unknown, never compared)
        self._unconfirmed_poll_count: int | None = None  # a higher pollCount seen once, to be confirmed
        self._lost_reason: str | None = None
        self._final_update = False  # a final update is in flight: no heartbeat or check may start
        self._final_tried = False  # a final update was started once (its retries may need beats)
        self._interval = policy.heartbeat_interval_seconds
        self._polled_at = self._now = polled_at
        self._acked_sent_at = polled_at  # send time of the newest ack, or the poll
        self._beat_planned_at: float | None = None  # when the beat in flight was due
        self._failures = 0
        self._beat_in_flight = self._check_in_flight = False
        early = 1.0 - policy.first_attempt_spread * random() if policy.first_attempt_spread else 1.0
        self._next_beat_at = polled_at + self._interval * early if self._interval else _NEVER
        check_every = policy.ownership_check_every_seconds
        self._next_check_at = polled_at + check_every * early if check_every > 0 else _NEVER
        self._confirmed_at = self._check_started_at = polled_at  # newest check that found it ours; in flight
        self._exec_started_at: float | None = None
        self._start_held = False  # the runner holds the command: the exec timeout waits for its start
        self._shutdown_at = self._kill_at = _NEVER
        self._fence_reason: FenceReason | None = None
        self._killed = self._child_exited = self._reported = False
        self._expired = False  # the deadline passed once: no ack processed later revives the lease
        # Derived times, worked out when what they depend on changes (``_reckon``), not on each read.
        lead = policy.fence_lead_seconds
        hard = policy.hard_timeout_seconds
        self._hard_at = polled_at + hard - policy.hard_elapsed_seconds if hard > 0 else _NEVER
        self._hard_term = self._hard_at - lead  # its fence's TERM point
        self._deadline = self._term = self._last_start = _NEVER  # (_last_start: an attempt starts by then)
        self._kill_by: tuple[float, float] | None = None
        self._reckon()

    # ----- derived times -------------------------------------------------------------------------

    @property
    def lease_deadline(self) -> float:
        """When the lease ends unless a newer ack (or, while the child may run, a check that finds
        the task ours) arrives (inf: never)."""
        return self._deadline

    @property
    def term_point(self) -> float:
        """When the tree is TERMed unless a newer ack arrives: lease deadline - grace - margin (inf:
        never). The lease is lost from here: an ack processed later cannot revive it."""
        return self._term

    def _reckon(self) -> None:
        """Work out the lease deadline and its TERM point again: after every change of what they
        depend on (the newest ack, the newest check that found the task ours, the child's exit)."""
        timeout, window = self.policy.lease_timeout_seconds, self.policy.ownership_window_seconds
        if timeout <= 0:
            deadline = _NEVER
        elif window > 0 and not self._child_exited:
            deadline = min(self._acked_sent_at + timeout, self._confirmed_at + window)
        else:
            deadline = self._acked_sent_at + timeout
        self._deadline = deadline
        self._term = deadline - self.policy.fence_lead_seconds
        self._last_start = self._term - self.policy.min_attempt_seconds
        kill_at = min(deadline, self._hard_at) - self.policy.fence_margin_seconds  # (_server_kill_point)
        self._kill_by = None if kill_at == _NEVER else (min(self._term, self._hard_term), kill_at)

    def _server_kill_point(self) -> float:
        """The latest moment the tree may still be KILLed: margin before the earliest server deadline."""
        return min(self._deadline, self._hard_at) - self.policy.fence_margin_seconds

    def _kill_due_at(self) -> float:
        return min(self._kill_at, self._server_kill_point())

    def _exec_deadline(self) -> float:
        limit = self.policy.exec_timeout_seconds
        started = self._exec_started_at
        if started is None:
            if self.policy.start_delay_seconds > 0 or self._start_held:
                return _NEVER  # held (its previous holder, a dying tree): counts from the start
            started = self._polled_at
        return started + limit if limit > 0 else _NEVER

    def _attempt_due_at(self, planned: float, in_flight: bool) -> float | None:
        """When an attempt planned for ``planned`` may start, or None if it may not."""
        if planned == _NEVER or in_flight or self._reported or self._final_update or self._expired:
            return None
        if self._fence_reason in FINAL_FENCES:
            return None
        return planned if max(planned, self._now) <= self._last_start else None

    def _beat_due_at(self) -> float | None:
        planned = self._next_beat_at
        if self._child_exited and not self._final_tried and planned != _NEVER:
            # The final update follows the exit at once: a beat started now would be in flight beside
            # it, and one whose answer is lost can undo the result (docs/final-results.md). Only a
            # lease that would run out before that update starts gets a beat, as late as it allows.
            planned = max(planned, self._last_start - EXITED_BEAT_ROOM_SECONDS)
        return self._attempt_due_at(planned, self._beat_in_flight)

    def _check_due_at(self) -> float | None:
        if self._child_exited:
            return None
        return self._attempt_due_at(self._next_check_at, self._check_in_flight)

    def _attempt_timeout(self, now: float) -> float:
        return min(self.policy.http_timeout_seconds, self._term - now)

    # ----- queries -------------------------------------------------------------------------------

    @property
    def fence_reason(self) -> FenceReason | None:
        """Why the tree was fenced (None: it was not); OWNERSHIP_LOST means report nothing."""
        return self._fence_reason

    @property
    def lost_reason(self) -> str | None:
        """Why an ownership check found the task no longer ours, for the log (None: it did not)."""
        return self._lost_reason

    @property
    def poll_count(self) -> int:
        """The newest pollCount delivered to us (0: unknown)."""
        return self._poll_count

    @property
    def state(self) -> LeaseState:
        """running / terminating / killing / reporting / done."""
        if self._reported:
            return LeaseState.DONE
        if self._child_exited:
            return LeaseState.REPORTING
        if self._killed:
            return LeaseState.KILLING
        return LeaseState.RUNNING if self._fence_reason is None else LeaseState.TERMINATING

    def kill_by(self) -> tuple[float, float] | None:
        """(TERM at, KILL at) of the earliest server deadline (the lease's, the hard ceiling): what the
        fork server's dead-man's switch enforces if the runner stalls (None: no server deadline). It
        moves only with an ack, a re-delivery or a check that found the task ours, processed before
        the TERM point, never past the lease's own fence points: TERM at deadline - grace - margin,
        KILL at deadline - margin. (Worked out by ``_reckon``: the engine asks after every event.)"""
        return self._kill_by

    def next_wakeup(self) -> float | None:
        """When ``on_tick`` must next be called (None: only events can change anything)."""
        if self._reported:
            return None
        earliest = _NEVER
        if (beat := self._beat_due_at()) is not None and beat < earliest:
            earliest = beat
        if (check := self._check_due_at()) is not None and check < earliest:
            earliest = check
        if not self._child_exited:
            if self._fence_reason is None:  # (the fence points: ``_due_fence``)
                earliest = min(earliest, self._term, self._hard_term, self._exec_deadline(),
                               self._shutdown_at)  # fmt: skip
            elif not self._killed:
                earliest = min(earliest, self._kill_due_at())
        return None if earliest == _NEVER else earliest

    def times(self) -> tuple[FenceReason | None, float | None, float | None]:
        """(fence reason, lease deadline, hard deadline), as ``view`` has them, without the rest."""
        return self._fence_reason, _finite(self._deadline), _finite(self._hard_at)

    def view(self) -> LeaseView:
        """A frozen snapshot for display."""
        # (positional, in LeaseView's field order: polled_at, last_ack_at, ... state, fence_reason)
        return LeaseView(self._polled_at, self._acked_sent_at, self._beat_due_at(), _finite(self._deadline),
                         _finite(self._hard_at), _finite(self._exec_deadline()), self._failures,
                         self._beat_in_flight, self.state, self._fence_reason)  # fmt: skip

    # ----- events --------------------------------------------------------------------------------

    def on_tick(self, now: float) -> list[Action]:
        """Time has reached ``now``: do whatever has come due."""
        return self._advance(self._enter(now))

    @property
    def consecutive_failures(self) -> int:
        """Failed heartbeats since the last acknowledged one."""
        return self._failures

    def on_heartbeat_ok(self, now: float, sent_at: float) -> list[Action]:
        """The beat sent at ``sent_at`` was acknowledged."""
        now = self._enter(now)
        actions = self._advance(now)  # first: an ack processed after the deadline never un-fences
        self._beat_in_flight = False
        self._failures = 0
        self._record_ack(min(sent_at, now), planned_at=self._beat_planned_at)
        return actions + self._advance(now)

    def on_heartbeat_failed(self, now: float) -> list[Action]:
        """The beat in flight failed (network, timeout, 5xx, other 4xx) or could not be started."""
        now = self._enter(now)
        actions = self._advance(now)
        self._beat_in_flight = False
        self._failures += 1
        # The backoff's delay, but never later than half the time left before the TERM point: a beat
        # that failed late in its interval still gets retries before the lease is lost.
        backoff = self.policy.retry_backoff.delay(self._failures, self._random())
        self._next_beat_at = now + min(backoff, max(MIN_RETRY_GAP_SECONDS, (self._term - now) / 2))
        if self._failures == 1 and self._next_check_at != _NEVER:
            self._next_check_at = min(self._next_check_at, now)  # is the task still ours at all?
        return actions + self._advance(now)

    def on_heartbeat_not_found(self, now: float) -> list[Action]:
        """The server answered 404 to a beat: the task (or its workflow) is gone."""
        now = self._enter(now)
        actions = self._advance(now)
        self._beat_in_flight = False
        return actions + self._fence(now, FenceReason.OWNERSHIP_LOST) + self._advance(now)

    def on_ownership(self, now: float, ownership: TaskOwnership | None) -> list[Action]:
        """An ownership check read the task back (None: 404); see the module docstring's rules."""
        now = self._enter(now)
        actions = self._advance(now)
        self._check_in_flight = False
        self._next_check_at = now + self.policy.ownership_check_every_seconds
        if self._final_update or self._reported:
            return actions + self._advance(now)  # our own update is changing the status: proves nothing
        grace = self.policy.redelivery_grace_seconds
        unconfirmed = self._unconfirmed_poll_count
        verdict = judge_ownership(ownership, self._poll_count, unconfirmed_poll_count=unconfirmed,
                                  redelivery_grace_seconds=grace)  # fmt: skip
        if verdict.confirm_poll_count is not None:
            # Maybe a re-delivery to us that is still on its way to the runner: give it the grace to
            # arrive (``on_redelivered``), then look again.
            self._unconfirmed_poll_count = verdict.confirm_poll_count
            self._next_check_at = now + grace
            return actions + self._advance(now)
        self._unconfirmed_poll_count = None
        if (why := verdict.lost_reason) is not None:
            self._lost_reason = self._lost_reason or why
            actions += self._fence(now, FenceReason.OWNERSHIP_LOST)
        elif not self._expired:  # still ours as of the check's start: that keeps the lease
            self._confirmed_at = max(self._confirmed_at, self._check_started_at)
            self._reckon()
        return actions + self._advance(now)

    def on_ownership_check_failed(self, now: float) -> list[Action]:
        """An ownership check could not be answered: again at the next interval, or sooner (at most
        half the time left to the TERM point, which the ownership window may set)."""
        now = self._enter(now)
        actions = self._advance(now)
        self._check_in_flight = False
        left = max(MIN_RETRY_GAP_SECONDS, (self._term - now) / 2)
        self._next_check_at = now + min(self.policy.ownership_check_every_seconds, left)
        return actions + self._advance(now)

    def on_redelivered(self, now: float, polled_at: float, poll_count: int = 0) -> list[Action]:
        """The same task was polled again by us: the poll reset the server's updateTime, like an ack,
        and its pollCount (0: unknown) is now ours."""
        now = self._enter(now)
        actions = self._advance(now)
        self._record_ack(min(polled_at, now))
        if not self._expired:  # our own poll handed it to us: ours as of then
            self._confirmed_at = max(self._confirmed_at, min(polled_at, now))
            self._reckon()
        self._poll_count = max(self._poll_count, poll_count)
        return actions + self._advance(now)

    def is_new_delivery(self, poll_count: int) -> bool:
        """A poll of this task with ``poll_count`` starts a new lease rather than acking this one.

        True once this lease's final update has been sent (a yield: IN_PROGRESS re-queues the task,
        callbackAfterSeconds 0 at once) and the poll is newer than every delivery this lease held: that
        poll is the task's next run, and this lease only waits for its update's acknowledgement. While
        the command runs (no final update yet) a re-delivery is the same run (``on_redelivered``).
        """
        return self._final_update and not self._reported and poll_count > self._poll_count > 0

    def on_start_held(self, now: float) -> list[Action]:
        """The runner holds the command back (``leasecore.handover.StartGate``): the exec timeout
        counts from ``on_child_started``, never from the poll."""
        now = self._enter(now)
        self._start_held = True
        return self._advance(now)

    def on_child_started(self, now: float) -> list[Action]:
        """The child is running: the exec timeout counts from here."""
        now = self._enter(now)
        if self._exec_started_at is None:
            self._exec_started_at = now
        return self._advance(now)

    def on_child_exited(self, now: float) -> list[Action]:
        """The child is gone: no more fencing; no beat until the final update starts, unless the lease
        would run out first (see the class docstring)."""
        now = self._enter(now)
        actions = self._advance(now)
        self._child_exited = True
        self._reckon()  # the ownership window no longer counts
        return actions

    def on_final_update_started(self, now: float) -> list[Action]:
        """The final update is about to be sent: start no heartbeat or ownership check until it ends.

        (A beat already in flight is the caller's to wait for; see ``LeaseEngine.begin_final_update``.)
        """
        now = self._enter(now)
        self._final_update = self._final_tried = True
        return self._advance(now)  # a fence may come due; no beat or check can

    def on_final_update_failed(self, now: float) -> list[Action]:
        """The final update failed and will be retried: heartbeat (and check) again meanwhile."""
        now = self._enter(now)
        self._final_update = False
        return self._advance(now)

    def on_heartbeat_withdrawn(self, now: float) -> list[Action]:
        """A beat handed out was never sent (withdrawn for a final update): not a failure, still due."""
        now = self._enter(now)
        self._beat_in_flight = False
        return self._advance(now)

    def on_reported(self, now: float) -> list[Action]:
        """The final update was acknowledged: this lease is over, no action ever again."""
        self._enter(now)
        self._reported = True
        return []

    def on_shutdown(self, now: float, drain_deadline: float | None = None) -> list[Action]:
        """Fence for SHUTDOWN now, or (draining, still beating) at ``drain_deadline``."""
        now = self._enter(now)
        actions = self._advance(now)
        self._shutdown_at = min(self._shutdown_at, now if drain_deadline is None else drain_deadline)
        return actions + self._advance(now)

    def on_force_shutdown(self, now: float) -> list[Action]:
        """A second signal: kill the tree now."""
        now = self._enter(now)
        actions = self._advance(now)
        if self._child_exited or self._reported or self._killed:
            return actions
        if self._fence_reason is None:
            self._fence_reason = FenceReason.SHUTDOWN
        self._killed = True
        return [*actions, KillTree(self._fence_reason)]

    # ----- internals -----------------------------------------------------------------------------

    def _enter(self, now: float) -> float:
        # Events reach us from several threads; never let time run backwards inside the lease.
        self._now = max(self._now, now)
        return self._now

    def _record_ack(self, sent_at: float, *, planned_at: float | None = None) -> None:
        if self._expired:
            return  # too late: the deadline (and what the display shows) stays where it passed
        self._acked_sent_at = max(self._acked_sent_at, sent_at)
        self._reckon()
        if self._interval is not None:
            self._next_beat_at = self._acked_sent_at + self._interval
            if planned_at is not None and planned_at < sent_at:  # it went out late: keep the cadence
                self._next_beat_at = max(planned_at + self._interval, sent_at + self._interval / 2)

    def _fence(self, at: float, reason: FenceReason) -> list[Action]:
        if self._reported:
            return []
        if self._fence_reason is not None or self._child_exited:
            if reason is FenceReason.OWNERSHIP_LOST:
                self._fence_reason = reason  # whatever was under way: now report nothing
            return []
        self._fence_reason = reason
        # Counted from the TERM point itself, so a late tick cannot push the KILL back; and never
        # past a server deadline's KILL point (a shutdown's grace ends there too).
        self._kill_at = at + self.policy.effective_kill_grace_seconds
        grace = max(0.0, self._kill_due_at() - at)
        return [TerminateTree(reason, at, grace)]

    def _due_fence(self, now: float) -> tuple[float, FenceReason] | None:
        """The earliest fence point at or before ``now`` (on a tie, the first listed). The server's
        deadlines (the lease, the hard ceiling) are met with the tree already dead: TERM at deadline -
        grace - margin, so KILL at deadline - margin. Ours (the exec timeout, a shutdown) TERM at the
        deadline, KILL a grace later. (``next_wakeup`` reads the same four points.)"""
        term, hard, exec_, shutdown = self._term, self._hard_term, self._exec_deadline(), self._shutdown_at
        if min(term, hard, exec_, shutdown) > now:
            return None  # (every event asks: the common answer, without building the list)
        points = [(term, FenceReason.LEASE_EXPIRED), (hard, FenceReason.HARD_TIMEOUT),
                  (exec_, FenceReason.EXEC_TIMEOUT), (shutdown, FenceReason.SHUTDOWN)]  # fmt: skip
        return min([p for p in points if p[0] <= now], key=lambda p: p[0])  # (min: the first of equal ones)

    def _advance(self, now: float) -> list[Action]:
        if self._reported:
            return []
        actions: list[Action] = []
        if now >= self._term:
            self._expired = True
        if not self._child_exited:
            due = self._due_fence(now) if self._fence_reason is None else None
            if due is not None:
                actions += self._fence(*due)
            if self._fence_reason is not None and not self._killed and now >= self._kill_due_at():
                self._killed = True
                actions.append(KillTree(self._fence_reason))
        beat_due = self._beat_due_at()
        if beat_due is not None and beat_due <= now:
            self._beat_in_flight = True
            self._beat_planned_at = beat_due
            actions.append(SendHeartbeat(self._attempt_timeout(now), beat_due, self._term))
        check_due = self._check_due_at()
        if check_due is not None and check_due <= now:
            self._check_in_flight = True
            self._check_started_at = now
            actions.append(CheckOwnership(self._attempt_timeout(now), check_due, self._term))
        return actions
