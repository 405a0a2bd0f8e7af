"""The numbers behind one task's lease: deadlines, the kill grace and its cap, the heartbeat cadence.

Owns ``LeasePolicy`` (every duration that drives a lease, validated once, derived from a polled task by
``LeasePolicy.from_task``) and the measured constants its defaults come from: the fence margin, the
kill grace's share of the lease, the heartbeat retry backoff. Everything here is a function of the
policy alone: the lease timeout, the capped grace, how long before a server deadline the TERM goes
out (``fence_lead_seconds``), the heartbeat interval.

Must not touch: a lease's moving state (acks, failures, fences: ``leasecore.lease.machine``), time,
I/O or threads. A bad number is a ``ConfigError`` naming its key, never an assert.

Threads: none. A policy is frozen; the runner asks ``from_task`` for one per task (the tasks made of
the same numbers share one) and the lease engine's threads read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from leasecore.backoff import Backoff
from leasecore.errors import ConfigError
from leasecore.handover import redelivery_wait_seconds
from leasecore.models import Task

__all__ = [
    "FENCE_MARGIN_SECONDS",
    "HEARTBEAT_RETRY_BACKOFF",
    "KILL_GRACE_SHARE",
    "MIN_RETRY_GAP_SECONDS",
    "LeasePolicy",
]

# Failed heartbeats are retried after 1 s, 1.5 s, 2 s, then every 2 s (each up to 10 % sooner), but
# never later than half the time left before the TERM point, nor closer than MIN_RETRY_GAP_SECONDS.
HEARTBEAT_RETRY_BACKOFF = Backoff(initial_seconds=1.0, multiplier=1.5, max_seconds=2.0, jitter_ratio=0.1)
MIN_RETRY_GAP_SECONDS = 0.25

# The whole tree is dead (every process reaped) this long before a deadline of the server's (the lease
# deadline, the hard ceiling): KILL goes out at deadline - margin, TERM kill_grace before that. It
# covers the timer's lateness, the signal's way to the fork server, its /proc walk, the KILL itself and
# the reaping; four times the idle worst measured (docs/benchmarks.md, "The fence margin").
FENCE_MARGIN_SECONDS = 0.4
# kill_grace is capped at this share of the lease timeout (and of the hard ceiling): the TERM point
# then stays at >= 3/4 of the lease minus the margin, so heartbeats are at most ~1.4 x as frequent as
# without a grace, and a grace of a quarter of R is still room enough for a child's clean-up. Nor may
# the grace take the heartbeats' room: with lease extension on, it leaves at least
# min_heartbeat_interval / heartbeat_ratio (1.25 s: a beat a second, 0.25 s for its answer) from an ack
# to its TERM point, where the lease is long enough for that at all (R = 2 s: a grace of 0.35 s).
KILL_GRACE_SHARE = 0.25


_T = TypeVar("_T")


class _derived(Generic[_T]):  # (a decorator, named like the cached_property it replaces)
    """A number worked out from the policy at its first read and kept in the instance (like
    ``functools.cached_property``, which on Python 3.11 takes a lock on every first read; each lease
    reads about six of them. A policy is a value: two threads computing one at once get the same
    number)."""

    def __init__(self, func: Callable[[Any], _T]) -> None:
        self._func = func
        self._name = func.__name__
        self.__doc__ = func.__doc__

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _derived[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> _T: ...
    def __get__(self, obj: object | None, owner: type | None = None) -> _T | _derived[_T]:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._func(obj)  # (found there from now on: no __set__ here)
        return value


# from_task's policies by the numbers they are made of, at most _MADE_MAX (the pollers' threads share it:
# two making the same one at once each keep an equal value).
_MADE: dict[tuple[Any, ...], LeasePolicy] = {}
_MADE_MAX = 256


def _positive_or_zero(name: str, value: float) -> None:
    if not value >= 0:  # also rejects NaN
        raise ConfigError(f"{name} must be >= 0 seconds, got {value}", key=name)


@dataclass(frozen=True)
class LeasePolicy:
    """Every number that drives one task's lease (all durations in seconds; 0 = none).

    The rules these numbers serve (DESIGN.md §4 and §6, CONDUCTOR_PROTOCOL.md §3, §4, §10):

    * **Lease deadline** = send time of the newest ack (or the poll) + ``lease_timeout_seconds``, that
      is ``min(heartbeat_timeout, R)`` (default R, the moment the server may time the task out and hand
      it to someone else). A heartbeat timeout only shortens the lease: past R another worker may
      already hold the task (``heartbeat_timeout_capped`` tells the runner to warn). With lease
      extension off the deadline is still enforced (poll + that timeout). R = 0 with no explicit
      heartbeat timeout: no lease deadline at all.
    * **Dead by the deadline.** At a server deadline (the lease's, the hard ceiling) the whole tree is
      already dead: TERM at deadline - G - M (the lease's *TERM point*), KILL at deadline - M, where M
      is ``fence_margin_seconds`` and G is ``kill_grace`` capped at ``kill_grace_share`` of the lease
      timeout and of the hard ceiling and, with lease extension on, at what leaves the heartbeats
      1.25 s from an ack to the TERM point (``kill_grace_capped`` tells the runner to warn).
    * **Heartbeats** every ``heartbeat_ratio * (L - G - M)`` (L: the lease timeout), a share of the time
      from an ack to its TERM point; none under ``min_heartbeat_interval_seconds`` or with extension off.
    * **Hard ceiling** (the task's ``timeoutSeconds``) counts from the task's ``startTime``, which
      survives re-deliveries: poll + timeoutSeconds - ``hard_elapsed_seconds`` (what the server had
      already counted at the poll, from its own timestamps: no clock skew enters). Heartbeats cannot
      extend it. ``exec_timeout_seconds`` is ours and counts from the child's start.
    * **Ownership keeps the lease too.** With ownership checks on and a lease deadline, the lease
      also ends ``ownership_window_seconds`` (the lease timeout, plus twice the check budget's longest
      hold) after the newest check that found the task still ours was started (or the poll), while
      the command may run: heartbeats to a task handed to someone else still succeed, so only a check
      can tell, and a holder whose checks fail (lost answers, a partition, a stall) must not outlive
      the hold of the task's next holder (``leasecore.handover.redelivery_wait_seconds``). Checks come
      every ``ownership_check_every_seconds`` (the interval, at most a heartbeat-like share of that
      window) and a failed one is retried sooner, so a healthy lease keeps its window.
    * ``start_delay_seconds`` (``from_task``, for a re-delivery that may still run elsewhere,
      ``leasecore.handover``) is the runner's to honour; the lease is held from the poll meanwhile.
    """

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
    # --- dead by the deadline (no two copies at once) ---
    fence_margin_seconds: float = FENCE_MARGIN_SECONDS  # KILL this long before a server deadline
    kill_grace_share: float = KILL_GRACE_SHARE  # kill_grace is capped at this share of the lease
    # The command starts this long after the delivery reached the runner: a re-delivery whose previous
    # holder may still run it (``leasecore.handover``); 0: at once.
    start_delay_seconds: float = 0.0
    # The most the runner's ownership-check budget holds a due check (leasecore.checkbudget): it widens
    # the ownership window (and so the re-delivery wait) by twice that.
    check_queue_seconds: float = 0.0
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
            "check_queue_seconds",
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
        (it lengthens a re-delivery's wait for its previous holder).

        The hard ceiling keeps the time the server had already counted towards it (an earlier delivery
        of the same task id), measured with the server's own timestamps. A re-delivery that may still
        run elsewhere gets its ``start_delay_seconds`` (``leasecore.handover``).
        """
        hard_elapsed = task.server_elapsed_seconds if task.timeout_seconds > 0 else 0.0
        # A policy is a frozen value: the tasks of one type share the one made for the same numbers
        # (building and validating one, and working out its derived numbers, cost ~25 us a task).
        # The numbers of the task type only: the elapsed time (and the start delay) of the task's own
        # delivery differ per task, and go on a copy below.
        key = (cls, task.response_timeout_seconds, heartbeat_timeout_seconds, lease_extend_enabled,
               kill_grace_seconds, task.timeout_seconds, exec_timeout_seconds,
               ownership_check_interval_seconds, http_timeout_seconds, first_attempt_spread,
               check_queue_seconds)  # fmt: skip
        policy = _MADE.get(key)
        if policy is None:
            policy = cls(
                response_timeout_seconds=task.response_timeout_seconds,
                heartbeat_timeout_seconds=heartbeat_timeout_seconds,
                lease_extend_enabled=lease_extend_enabled,
                kill_grace_seconds=kill_grace_seconds,
                hard_timeout_seconds=task.timeout_seconds,
                exec_timeout_seconds=exec_timeout_seconds,
                ownership_check_interval_seconds=ownership_check_interval_seconds,
                http_timeout_seconds=http_timeout_seconds,
                first_attempt_spread=first_attempt_spread,
                check_queue_seconds=check_queue_seconds,
            )
            policy._work_out()  # (once: the copies below share them)
            if len(_MADE) >= _MADE_MAX:  # (bounded: one per task type and configuration, in practice)
                _MADE.clear()
            _MADE[key] = policy
        wait = redelivery_wait_seconds(
            task,
            ownership_check_interval_seconds=ownership_check_interval_seconds,
            redelivery_grace_seconds=policy.redelivery_grace_seconds,
            kill_grace_seconds=policy.effective_kill_grace_seconds,
            fence_margin_seconds=policy.fence_margin_seconds,
            check_queue_seconds=check_queue_seconds,
            lease_timeout_seconds=policy.lease_timeout_seconds,
        )
        if hard_elapsed > 0 or wait > 0:
            return policy._for_delivery(hard_elapsed, wait if wait > 0 else 0.0)
        return policy

    def _work_out(self) -> None:
        """Work out every derived number (each ``_derived`` of the class) now."""
        for name, value in vars(type(self)).items():
            if isinstance(value, _derived):
                getattr(self, name)

    def _for_delivery(self, hard_elapsed_seconds: float, start_delay_seconds: float) -> LeasePolicy:
        """This policy with one delivery's ``hard_elapsed_seconds`` and ``start_delay_seconds``: a copy
        of its fields and of the derived numbers already worked out, none of which reads those two (what
        ``dataclasses.replace`` gives, without building and validating the policy again: ~1 us, not ~10).
        Both come from ``from_task``, >= 0 by construction."""
        made = object.__new__(type(self))
        values = made.__dict__
        values.update(self.__dict__)
        values["hard_elapsed_seconds"] = hard_elapsed_seconds
        values["start_delay_seconds"] = start_delay_seconds
        return made

    # The derived numbers below are worked out once per policy (a frozen value: dataclasses.replace
    # makes a new one); the lease machine reads them many times per task.

    @_derived
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

    @_derived
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

    @_derived
    def effective_kill_grace_seconds(self) -> float:
        """The grace between TERM and KILL that this task gets: ``kill_grace``, capped."""
        cap = self.kill_grace_cap_seconds
        return self.kill_grace_seconds if cap is None else min(self.kill_grace_seconds, cap)

    @property
    def kill_grace_capped(self) -> bool:
        """True when the configured ``kill_grace`` was cut down to its cap (the runner warns once)."""
        return self.effective_kill_grace_seconds < self.kill_grace_seconds

    @_derived
    def fence_lead_seconds(self) -> float:
        """How long before a server deadline the TERM goes out: the (capped) grace + the margin."""
        return self.effective_kill_grace_seconds + self.fence_margin_seconds

    @_derived
    def ownership_window_seconds(self) -> float:
        """How long a check that found the task ours keeps the lease while the command may run: the
        lease timeout + twice ``check_queue_seconds``; 0: no such limit (no checks, or no lease
        deadline). The lease deadline is the earlier of the heartbeats' and this one's."""
        lease = self.lease_timeout_seconds
        if self.ownership_check_interval_seconds <= 0 or lease <= 0:
            return 0.0
        return lease + 2 * self.check_queue_seconds

    @_derived
    def ownership_check_every_seconds(self) -> float:
        """Seconds between ownership checks: the interval, but no more than ``heartbeat_ratio`` of the
        time from a confirming check to the TERM point its window sets (so one failed check still
        leaves room for retries before it); 0: never check."""
        every = self.ownership_check_interval_seconds
        room = self.ownership_window_seconds - self.fence_lead_seconds
        if every <= 0 or room <= 0:
            return every
        return min(every, max(self.min_heartbeat_interval_seconds, self.heartbeat_ratio * room))

    @_derived
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

