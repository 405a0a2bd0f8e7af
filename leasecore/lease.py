"""The lease of one task as a pure state machine: (state, event, now) -> actions.

Owns every timing decision about a polled task: when to heartbeat, when to retry, when to check
ownership, when to fence (terminate, then kill, the child's tree) and why. It performs no I/O, starts no
thread and never reads a clock: every event carries ``now`` (monotonic seconds) and the caller (the
``heartbeat`` engine, or a test with a ``FakeClock``) carries out the returned actions and calls
``on_tick(now)`` at ``next_wakeup()``.

Rules (DESIGN.md §4 and §6, CONDUCTOR_PROTOCOL.md §3, §4, §10):

* **Dead by the deadline.** The server may hand the task to someone else at the lease deadline (and
  at the hard ceiling), so the whole tree is dead by then, not after: TERM at the *TERM point*,
  deadline - G - M, KILL at deadline - M, where G is ``kill_grace`` capped at ``kill_grace_share``
  (1/4) of the lease timeout and of the hard ceiling, and (lease extension on) at what leaves the
  heartbeats 1.25 s from an ack to the TERM point (``kill_grace_capped`` tells the runner to warn),
  and M is ``fence_margin_seconds`` (``FENCE_MARGIN_SECONDS``, measured). The lease is lost at
  the TERM point. Our own deadlines (exec timeout, shutdown) TERM at the deadline and KILL G later,
  but never later than a server deadline's KILL point.
* Heartbeats are sent every ``heartbeat_ratio * (L - G - M)`` (L = ``min(R, heartbeat_timeout)``)
  counted from the *send* time of the newest acknowledged heartbeat (or of the poll): a share of the
  time from an ack to its TERM point; none when that interval is under
  ``min_heartbeat_interval_seconds`` or lease extension is off. A beat that went out late (its sender
  was busy: 1000 leases on a loaded machine) keeps the cadence: the next is due one interval after the
  late beat was *planned*, but at least half an interval after it was sent. Lateness then shortens the
  next interval instead of stretching every later one, so the gaps the server sees stay near the
  interval (the lease deadline still counts from the actual send time). A failed beat is retried after the
  ``retry_backoff`` delays (1 s, 1.5 s, 2 s, 2 s, ...), each at most half the time left to the TERM
  point (and at least ``MIN_RETRY_GAP_SECONDS``), for as long as the lease lasts.
* Lease deadline = send time of the newest ack (or the poll) + ``min(heartbeat_timeout, R)`` (default
  R, the moment the server may time the task out and hand it to someone else). A heartbeat timeout can
  only shorten the lease: past R the server may already have handed the task to another worker, so a
  longer one would let two copies run (``heartbeat_timeout_capped`` tells the runner to warn). **With
  lease extension off the deadline is still enforced** at poll + that timeout: the server times the
  task out at R anyway, so a child still running after that may run next to its retry.
* An HTTP attempt never outlives the lease: its timeout is ``min(http cap, TERM point - now)`` and no
  attempt starts with less than ``min_attempt_seconds`` left.
* Fencing at the TERM point is unconditional. An ack *processed* after it is ignored (it cannot
  cancel the fence or move the deadline), even if its beat was sent in time: the tree is already
  being stopped, and the server may time the task out soon. So the tree is never fenced while the
  lease is confirmed (TERM point in the future), and is terminated at the TERM point and killed at
  deadline - margin if it still lives.
  An expired lease stays expired (no more beats or checks), also after the child has exited.
* Ownership is checked every ``ownership_check_interval_seconds`` (and right after the first failed beat
  of a streak) by reading the task back (``TaskOwnership``: status, pollCount, workerId). The task is
  no longer ours (fence with OWNERSHIP_LOST, which means: report nothing) on a 404 (also a 404 on a
  heartbeat), a terminal status, SCHEDULED (re-queued: a bare IN_PROGRESS update or an admin requeue;
  it will be handed out again), or IN_PROGRESS with a pollCount above the newest one we hold (someone
  polled it again; pollCount grows by one per poll). A re-delivery to us raises the pollCount we hold
  (``on_redelivered``); since that delivery may still be on its way to the runner when a check sees
  it, a higher pollCount is confirmed by one more check ``redelivery_grace_seconds`` later before it
  fences. workerId is not compared (runners on one host share the default id). A failed check
  changes nothing; the next one follows.
* ``hard_timeout_seconds`` (the task's ``timeoutSeconds``) counts, like the server's check, from the
  task's ``startTime``, which survives re-deliveries: hard deadline = poll + timeoutSeconds -
  ``hard_elapsed_seconds``, the time the server had already counted at the poll (updateTime -
  startTime of the polled task, both from the server's clock, so no clock skew enters). Heartbeats
  cannot extend it (fenced like the lease deadline: TERM at hard - G - M). ``exec_timeout_seconds``
  counts from ``on_child_started`` (else the poll; with a start delay, or once ``on_start_held`` said
  the runner holds the command, e.g. for an earlier attempt's tree still dying here, only from the start).
* ``start_delay_seconds`` (set by ``from_task`` for a re-delivery that may still run elsewhere,
  ``leasecore.handover``) is the runner's to honour: the lease is held from the poll meanwhile.
* After ``on_child_exited`` nothing is terminated or killed any more, but heartbeats go on until
  ``on_reported`` (the final update may need retries). After ``on_reported`` no action is ever returned.
* The final update and the heartbeats of a task never overlap: from ``on_final_update_started`` no
  heartbeat or ownership check is started (a check answered meanwhile is ignored: our own update
  changes the status); ``on_final_update_failed`` resumes them (an overdue beat goes out at once) so
  the lease outlives a slow report; ``on_reported`` ends the lease.
* R = 0 (no response timeout) with no explicit heartbeat timeout means no lease deadline at all.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from leasecore.backoff import Backoff
from leasecore.errors import ConfigError
from leasecore.handover import redelivery_wait_seconds
from leasecore.models import Task, TaskOwnership, TaskStatus

__all__ = [
    "Action",
    "CheckOwnership",
    "FenceAction",
    "FenceReason",
    "KillTree",
    "Lease",
    "LeasePolicy",
    "LeaseState",
    "LeaseView",
    "SendHeartbeat",
    "TerminateTree",
    "ownership_lost_reason",
]

_NEVER = math.inf

# Failed heartbeats are retried after 1 s, 1.5 s, 2 s, then every 2 s (each up to 10 % sooner), but
# never later than half the time left before the TERM point, nor closer than MIN_RETRY_GAP_SECONDS.
HEARTBEAT_RETRY_BACKOFF = Backoff(initial_seconds=1.0, multiplier=1.5, max_seconds=2.0, jitter_ratio=0.1)
MIN_RETRY_GAP_SECONDS = 0.25

# The whole tree is dead (every process reaped) this long before a deadline of the server's (the lease
# deadline, the hard ceiling): KILL goes out at deadline - margin, TERM kill_grace before that. It
# covers the timer's lateness, the signal's way to the fork server, its /proc walk, the KILL itself and
# the reaping. Measured on this project's 2-core machine (README "The lease's timings", bench/kill.py):
# from the KILL time to the last process's exit, idle, 8 ms for one tree, 34 ms for 20, 54-76 ms for
# 200 trees at once; with the machine overloaded (load average 9-11) the worst of 200 trees took up to
# 0.43 s, the median 0.08 s. 0.4 s is four times the idle worst and covers all but that outlier.
FENCE_MARGIN_SECONDS = 0.4
# kill_grace is capped at this share of the lease timeout (and of the hard ceiling): the TERM point
# then stays at >= 3/4 of the lease minus the margin, so heartbeats are at most ~1.4 x as frequent as
# without a grace, and a grace of a quarter of R is still room enough for a child's clean-up. Nor may
# the grace take the heartbeats' room: with lease extension on, it leaves at least
# min_heartbeat_interval / heartbeat_ratio (1.25 s: a beat a second, 0.25 s for its answer) from an ack
# to its TERM point, where the lease is long enough for that at all (R = 2 s: a grace of 0.35 s).
KILL_GRACE_SHARE = 0.25


class FenceReason(StrEnum):
    """Why the child's tree was (or is being) stopped; tells the runner how to report."""

    SHUTDOWN = "shutdown"
    LEASE_EXPIRED = "lease_expired"
    OWNERSHIP_LOST = "ownership_lost"
    HARD_TIMEOUT = "hard_timeout"
    EXEC_TIMEOUT = "exec_timeout"


# After these fences the lease is worthless: no more heartbeats or ownership checks.
_FINAL_FENCES = frozenset({FenceReason.OWNERSHIP_LOST, FenceReason.LEASE_EXPIRED})


class LeaseState(StrEnum):
    """Where a lease is in its life, for the status display."""

    RUNNING = "running"
    TERMINATING = "terminating"
    KILLING = "killing"
    REPORTING = "reporting"
    DONE = "done"


@dataclass(frozen=True)
class SendHeartbeat:
    """Send one extendLease; ``expires_at`` is the lease's TERM point, which the attempt must not outlive."""

    timeout_seconds: float
    due_at: float
    expires_at: float


@dataclass(frozen=True)
class CheckOwnership:
    """Read the task's status from the server (GET /api/tasks/{id})."""

    timeout_seconds: float
    due_at: float
    expires_at: float


@dataclass(frozen=True)
class TerminateTree:
    """Send TERM to the child's whole tree; its KILL is due ``grace_seconds`` after ``at``.

    ``at``: when the fence came due (the TERM point itself, not when this action was carried out), so
    that a TERM carried out late (a runner stopping 500 trees hands them out one by one) does not
    push its KILL back. ``grace_seconds``: the (capped) kill grace, shortened so that the KILL comes
    no later than a server deadline's KILL point (None: the process layer's own). Neither is part of
    equality: they are times, the action is what to do.
    """

    reason: FenceReason
    at: float | None = field(default=None, compare=False)
    grace_seconds: float | None = field(default=None, compare=False)


@dataclass(frozen=True)
class KillTree:
    """Send KILL to the child's whole tree."""

    reason: FenceReason


Action = SendHeartbeat | CheckOwnership | TerminateTree | KillTree
FenceAction = TerminateTree | KillTree


def _positive_or_zero(name: str, value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ConfigError(f"{name} must be >= 0 seconds, got {value}", key=name)


@dataclass(frozen=True)
class LeasePolicy:
    """Every number that drives one task's lease (all durations in seconds; 0 = none)."""

    response_timeout_seconds: float
    heartbeat_timeout_seconds: float | None = None  # None: the task's R
    lease_extend_enabled: bool = True
    heartbeat_ratio: float = 0.8
    min_heartbeat_interval_seconds: float = 1.0
    retry_backoff: Backoff = HEARTBEAT_RETRY_BACKOFF
    ownership_check_interval_seconds: float = 5.0  # 0: never check
    kill_grace_seconds: float = 10.0
    hard_timeout_seconds: float = 0.0
    hard_elapsed_seconds: float = 0.0  # of hard_timeout_seconds, already counted by the server at the poll
    exec_timeout_seconds: float = 0.0
    http_timeout_seconds: float = 10.0
    min_attempt_seconds: float = 0.1
    redelivery_grace_seconds: float = 0.5  # a higher pollCount is confirmed this much later (0: at once)
    # --- dead by the deadline (#17) ---
    fence_margin_seconds: float = FENCE_MARGIN_SECONDS  # KILL this long before a server deadline
    kill_grace_share: float = KILL_GRACE_SHARE  # kill_grace is capped at this share of the lease
    # The command starts this long after the delivery reached the runner: a re-delivery whose previous
    # holder may still run it (``leasecore.handover``); 0: at once.
    start_delay_seconds: float = 0.0
    # The first heartbeat and ownership check come after (1 - spread * random()) of their interval:
    # leases polled in one batch (1000 at once) then beat spread over the interval instead of all at
    # the same instant, which no server answers within the 0.2 R of slack. 0: exactly on time.
    first_attempt_spread: float = 0.0

    def __post_init__(self) -> None:
        for name in (
            "response_timeout_seconds", "min_heartbeat_interval_seconds",
            "ownership_check_interval_seconds", "kill_grace_seconds", "hard_timeout_seconds",
            "hard_elapsed_seconds", "exec_timeout_seconds", "min_attempt_seconds",
            "redelivery_grace_seconds", "fence_margin_seconds", "start_delay_seconds",
        ):  # fmt: skip
            _positive_or_zero(name, getattr(self, name))
        if self.heartbeat_timeout_seconds is not None:
            _positive_or_zero("heartbeat_timeout_seconds", self.heartbeat_timeout_seconds)
        if not 0 <= self.first_attempt_spread <= 1:
            raise ConfigError(f"first_attempt_spread must be in [0, 1], got {self.first_attempt_spread}")
        if not 0 < self.kill_grace_share <= 1:
            raise ConfigError(f"kill_grace_share must be in (0, 1], got {self.kill_grace_share}")
        if not 0 < self.heartbeat_ratio <= 1:
            raise ConfigError(f"heartbeat_ratio must be in (0, 1], got {self.heartbeat_ratio}")
        if not self.http_timeout_seconds > 0:
            raise ConfigError(f"http_timeout_seconds must be > 0, got {self.http_timeout_seconds}")

    @classmethod
    def from_task(
        cls,
        task: Task,
        *,
        heartbeat_timeout_seconds: float | None = None,
        lease_extend_enabled: bool = True,
        kill_grace_seconds: float = 10.0,
        exec_timeout_seconds: float = 0.0,
        ownership_check_interval_seconds: float = 5.0,
        http_timeout_seconds: float = 10.0,
        first_attempt_spread: float = 0.0,
        check_queue_seconds: float = 0.0,
    ) -> LeasePolicy:
        """The policy for a polled task: R and the hard ceiling from the task, the rest from config.
        ``check_queue_seconds``: the most the runner's ownership-check budget may hold a due check
        (#23; it lengthens a re-delivery's wait for its previous holder).

        The hard ceiling keeps the time the server had already counted towards it (an earlier delivery
        of the same task id), measured with the server's own timestamps. A re-delivery that may still
        run elsewhere gets its ``start_delay_seconds`` (``leasecore.handover``).
        """
        policy = cls(
            response_timeout_seconds=task.response_timeout_seconds,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            lease_extend_enabled=lease_extend_enabled,
            kill_grace_seconds=kill_grace_seconds,
            hard_timeout_seconds=task.timeout_seconds,
            hard_elapsed_seconds=task.server_elapsed_seconds if task.timeout_seconds > 0 else 0.0,
            exec_timeout_seconds=exec_timeout_seconds,
            ownership_check_interval_seconds=ownership_check_interval_seconds,
            http_timeout_seconds=http_timeout_seconds,
            first_attempt_spread=first_attempt_spread,
        )
        wait = redelivery_wait_seconds(
            task,
            ownership_check_interval_seconds=ownership_check_interval_seconds,
            redelivery_grace_seconds=policy.redelivery_grace_seconds,
            kill_grace_seconds=policy.effective_kill_grace_seconds,
            fence_margin_seconds=policy.fence_margin_seconds,
            check_queue_seconds=check_queue_seconds,
        )
        return dataclasses.replace(policy, start_delay_seconds=wait) if wait > 0 else policy

    @property
    def lease_timeout_seconds(self) -> float:
        """How long an ack (or the poll) keeps the lease; 0 = no lease deadline.

        The heartbeat timeout only shortens R, never lengthens it (R = 0: it is the only deadline).
        """
        r = self.response_timeout_seconds
        configured = self.heartbeat_timeout_seconds
        if configured is None or configured <= 0:
            return r
        return min(configured, r) if r > 0 else configured

    @property
    def heartbeat_timeout_capped(self) -> bool:
        """True when the configured heartbeat timeout is longer than R and was cut down to it."""
        configured = self.heartbeat_timeout_seconds
        r = self.response_timeout_seconds
        return configured is not None and r > 0 and configured > r

    @property
    def kill_grace_cap_seconds(self) -> float | None:
        """The most ``kill_grace`` may be: a share of the lease timeout and of the hard ceiling, and no
        more than leaves the heartbeats their room (None: neither deadline is set, no cap)."""
        lease = self.lease_timeout_seconds
        bounds = [t for t in (lease, self.hard_timeout_seconds) if t > 0]
        if not bounds:
            return None
        cap = self.kill_grace_share * min(bounds)
        if self.lease_extend_enabled and self.response_timeout_seconds > 0:
            beats_need = self.min_heartbeat_interval_seconds / self.heartbeat_ratio
            room = lease - self.fence_margin_seconds - beats_need
            if room >= 0:  # (else no grace makes room: there are no heartbeats anyway)
                cap = min(cap, room)
        return cap

    @property
    def effective_kill_grace_seconds(self) -> float:
        """The grace between TERM and KILL that this task gets: ``kill_grace``, capped."""
        cap = self.kill_grace_cap_seconds
        return self.kill_grace_seconds if cap is None else min(self.kill_grace_seconds, cap)

    @property
    def kill_grace_capped(self) -> bool:
        """True when the configured ``kill_grace`` was cut down to its cap (the runner warns once)."""
        return self.effective_kill_grace_seconds < self.kill_grace_seconds

    @property
    def fence_lead_seconds(self) -> float:
        """How long before a server deadline the TERM goes out: the (capped) grace + the margin."""
        return self.effective_kill_grace_seconds + self.fence_margin_seconds

    @property
    def heartbeat_interval_seconds(self) -> float | None:
        """Seconds from an acked beat's send time to the next beat; None: no heartbeats.

        ``heartbeat_ratio`` x (lease timeout - kill grace - margin): a share of the time from an ack
        to its TERM point, so a healthy lease never reaches it and a failed beat has the rest for
        its retries. None when that is under ``min_heartbeat_interval_seconds``.
        """
        if not self.lease_extend_enabled or self.response_timeout_seconds <= 0:
            return None
        window = self.lease_timeout_seconds - self.fence_lead_seconds
        interval = self.heartbeat_ratio * window
        return interval if interval >= self.min_heartbeat_interval_seconds else None


@dataclass(frozen=True)
class LeaseView:
    """A snapshot of one lease for the status display (monotonic seconds; None = not applicable)."""

    polled_at: float
    last_ack_at: float  # send time of the newest acknowledged heartbeat, or the poll
    next_heartbeat_at: float | None
    lease_deadline: float | None
    hard_deadline: float | None
    exec_deadline: float | None
    consecutive_failures: int
    heartbeat_in_flight: bool
    state: LeaseState
    fence_reason: FenceReason | None


def _finite(value: float) -> float | None:
    return value if value != _NEVER else None


def _no_jitter() -> float:
    return 0.0


def ownership_lost_reason(ownership: TaskOwnership | None, held_poll_count: int) -> str | None:
    """Why the task read back is no longer ours (None: still ours). ``held_poll_count`` 0: unknown."""
    if ownership is None:
        return "the server no longer knows the task (404)"
    if ownership.status.is_terminal:
        return f"the task is {ownership.status.value} on the server"
    if ownership.status is TaskStatus.SCHEDULED:
        return "the task was re-queued (SCHEDULED) and will be handed out again"
    if held_poll_count > 0 and ownership.poll_count > held_poll_count:
        by = f" by worker {ownership.worker_id!r}" if ownership.worker_id else ""
        return f"the task was polled again{by} (pollCount {ownership.poll_count}, ours {held_poll_count})"
    return None


def _repolled_count(ownership: TaskOwnership | None, held_poll_count: int) -> int | None:
    """The higher pollCount of a task someone polled again while IN_PROGRESS (None: not that case)."""
    if ownership is None or ownership.status is not TaskStatus.IN_PROGRESS or held_poll_count <= 0:
        return None
    return ownership.poll_count if ownership.poll_count > held_poll_count else None


class Lease:
    """The lease of one task, from its poll to its final report. Not thread-safe."""

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
        self._interval = policy.heartbeat_interval_seconds
        self._polled_at = self._now = polled_at
        self._acked_sent_at = polled_at  # send time of the newest ack, or the poll
        self._beat_planned_at: float | None = None  # when the beat in flight was due
        self._failures = 0
        self._beat_in_flight = self._check_in_flight = False
        early = 1.0 - policy.first_attempt_spread * random() if policy.first_attempt_spread else 1.0
        self._next_beat_at = polled_at + self._interval * early if self._interval else _NEVER
        check_every = policy.ownership_check_interval_seconds
        self._next_check_at = polled_at + check_every * early if check_every > 0 else _NEVER
        self._exec_started_at: float | None = None
        self._start_held = False  # the runner holds the command: the exec timeout waits for its start
        self._shutdown_at = self._kill_at = _NEVER
        self._fence_reason: FenceReason | None = None
        self._killed = self._child_exited = self._reported = False
        self._expired = False  # the deadline passed once: no ack processed later revives the lease

    # ----- derived times -------------------------------------------------------------------------

    @property
    def lease_deadline(self) -> float:
        """When the lease ends unless a newer ack arrives (inf: never)."""
        timeout = self.policy.lease_timeout_seconds
        return self._acked_sent_at + timeout if timeout > 0 else _NEVER

    @property
    def term_point(self) -> float:
        """When the tree is TERMed unless a newer ack arrives: lease deadline - grace - margin (inf:
        never). The lease is lost from here: an ack processed later cannot revive it."""
        return self.lease_deadline - self.policy.fence_lead_seconds

    def _hard_deadline(self) -> float:
        hard = self.policy.hard_timeout_seconds
        return self._polled_at + hard - self.policy.hard_elapsed_seconds if hard > 0 else _NEVER

    def _server_kill_point(self) -> float:
        """The latest moment the tree may still be KILLed: margin before the earliest server deadline."""
        return min(self.lease_deadline, self._hard_deadline()) - self.policy.fence_margin_seconds

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
        if self._reported or self._final_update or in_flight or self._expired:
            return None
        if self._fence_reason in _FINAL_FENCES:
            return None
        if planned == _NEVER:
            return None
        start = max(planned, self._now)
        return planned if start <= self.term_point - self.policy.min_attempt_seconds else None

    def _beat_due_at(self) -> float | None:
        return self._attempt_due_at(self._next_beat_at, self._beat_in_flight)

    def _check_due_at(self) -> float | None:
        if self._child_exited:
            return None
        return self._attempt_due_at(self._next_check_at, self._check_in_flight)

    def _attempt_timeout(self, now: float) -> float:
        return min(self.policy.http_timeout_seconds, self.term_point - now)

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

    def next_wakeup(self) -> float | None:
        """When ``on_tick`` must next be called (None: only events can change anything)."""
        if self._reported:
            return None
        times = [self._beat_due_at(), self._check_due_at()]
        if not self._child_exited:
            if self._fence_reason is None:
                times += [deadline for deadline, _ in self._fence_points()]
            elif not self._killed:
                times.append(self._kill_due_at())
        finite = [t for t in times if t is not None and t != _NEVER]
        return min(finite) if finite else None

    def view(self) -> LeaseView:
        """A frozen snapshot for display."""
        beat = self._beat_due_at()
        return LeaseView(
            polled_at=self._polled_at,
            last_ack_at=self._acked_sent_at,
            next_heartbeat_at=beat,
            lease_deadline=_finite(self.lease_deadline),
            hard_deadline=_finite(self._hard_deadline()),
            exec_deadline=_finite(self._exec_deadline()),
            consecutive_failures=self._failures,
            heartbeat_in_flight=self._beat_in_flight,
            state=self.state,
            fence_reason=self._fence_reason,
        )

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
        self._next_beat_at = now + min(backoff, max(MIN_RETRY_GAP_SECONDS, (self.term_point - now) / 2))
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
        self._next_check_at = now + self.policy.ownership_check_interval_seconds
        if self._final_update or self._reported:
            return actions + self._advance(now)  # our own update is changing the status: proves nothing
        why = ownership_lost_reason(ownership, self._poll_count)
        grace = self.policy.redelivery_grace_seconds
        repolled = _repolled_count(ownership, self._poll_count)
        if repolled is not None and grace > 0 and self._unconfirmed_poll_count is None:
            # Maybe a re-delivery to us that is still on its way to the runner: give it the grace to
            # arrive (``on_redelivered``), then look again.
            self._unconfirmed_poll_count = repolled
            self._next_check_at = now + grace
            return actions + self._advance(now)
        self._unconfirmed_poll_count = None
        if why is not None:
            if self._lost_reason is None:
                self._lost_reason = why
            actions += self._fence(now, FenceReason.OWNERSHIP_LOST)
        return actions + self._advance(now)

    def on_ownership_check_failed(self, now: float) -> list[Action]:
        """An ownership check could not be answered; try again at the next interval."""
        now = self._enter(now)
        actions = self._advance(now)
        self._check_in_flight = False
        self._next_check_at = now + self.policy.ownership_check_interval_seconds
        return actions + self._advance(now)

    def on_redelivered(self, now: float, polled_at: float, poll_count: int = 0) -> list[Action]:
        """The same task was polled again by us: the poll reset the server's updateTime, like an ack,
        and its pollCount (0: unknown) is now ours."""
        now = self._enter(now)
        actions = self._advance(now)
        self._record_ack(min(polled_at, now))
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
        """The child is gone: no more fencing; keep beating until the result is reported."""
        now = self._enter(now)
        actions = self._advance(now)
        self._child_exited = True
        return actions

    def on_final_update_started(self, now: float) -> list[Action]:
        """The final update is about to be sent: start no heartbeat or ownership check until it ends.

        (A beat already in flight is the caller's to wait for; see ``LeaseEngine.begin_final_update``.)
        """
        now = self._enter(now)
        self._final_update = True
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

    def _fence_points(self) -> list[tuple[float, FenceReason]]:
        """When each fence comes due. The server's deadlines (the lease, the hard ceiling) are met
        with the tree already dead: TERM at deadline - grace - margin, so KILL at deadline - margin.
        Ours (the exec timeout, a shutdown) TERM at the deadline, KILL a grace later."""
        lead = self.policy.fence_lead_seconds
        return [
            (self.term_point, FenceReason.LEASE_EXPIRED),
            (self._hard_deadline() - lead, FenceReason.HARD_TIMEOUT),
            (self._exec_deadline(), FenceReason.EXEC_TIMEOUT),
            (self._shutdown_at, FenceReason.SHUTDOWN),
        ]

    def _due_fence(self, now: float) -> tuple[float, FenceReason] | None:
        due = [
            (deadline, order, reason)
            for order, (deadline, reason) in enumerate(self._fence_points())
            if deadline <= now
        ]
        if not due:
            return None
        deadline, _, reason = min(due)
        return deadline, reason

    def _advance(self, now: float) -> list[Action]:
        if self._reported:
            return []
        actions: list[Action] = []
        if now >= self.term_point:
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
            actions.append(SendHeartbeat(self._attempt_timeout(now), beat_due, self.term_point))
        check_due = self._check_due_at()
        if check_due is not None and check_due <= now:
            self._check_in_flight = True
            actions.append(CheckOwnership(self._attempt_timeout(now), check_due, self.term_point))
        return actions
