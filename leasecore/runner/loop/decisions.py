"""What the runner decides about one task, as pure functions over small read-only views.

Owns: the admission of a polled or chained task (``admit``: start, hold, wait behind the run still
here, ack a duplicate, hand back, end unstarted), the start of a held task once its hold is over
(``held_start``: read the task back first; start only while it is still ours), and what a child's exit
means (``exit_meaning``, ``report_meaning``, ``hold_over``: forget, report now, hold until the tree is
gone, mark a yield or not), and whether a result is sent only after reading the task back
(``report_check``: after a lease that ran out, the task may be another runner's delivery now).
Each returns a frozen value; the caller (the runner's main thread, or the simulator's driver)
carries it out. No I/O, no clock, no state: the views carry everything.

Must not: call the engine, the supervisor, the reporter or the server; import anything threaded.
Threads: none (pure).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from leasecore.lease.actions import FenceReason
from leasecore.lease.ownership import ownership_lost_reason
from leasecore.models import TaskOwnership, TaskStatus

__all__ = [
    "AckDuplicate",
    "Admission",
    "BackUnstarted",
    "ChainedBack",
    "Delivery",
    "Earlier",
    "EndUnstarted",
    "ExitMeaning",
    "HandBack",
    "HeldStart",
    "HeldView",
    "Hold",
    "HoldOver",
    "LeaseNow",
    "Read",
    "ReportCheck",
    "ReportMeaning",
    "Start",
    "Unstarted",
    "WaitBehind",
    "admit",
    "exit_meaning",
    "held_start",
    "hold_over",
    "report_check",
    "report_meaning",
    "unstarted_meaning",
]

READ_AGAIN_SECONDS = 1.0  # a held start's read-back that failed is tried again this much later


class LeaseNow(Enum):
    """The delivery's own lease as the engine holds it when the main thread handles it."""

    UNTRACKED = "untracked"  # not tracked (or the track at poll reached an earlier run's lease, ended since)
    LIVE = "live"
    FENCED = "fenced"  # fenced already (say while it waited behind an earlier run)
    PAST_TERM = "past term point"  # not fenced yet, but its TERM point passed (the runner stalled)


@dataclass(frozen=True, eq=False)
class Earlier:
    """The run of the same task id still here when a delivery of it is handled."""

    poll_count: int
    reporting: bool  # its child is gone and its result is being reported
    ownership_lost: bool  # its lease was fenced because the task is no longer ours
    yield_waiting: bool  # its yield waits for its tree to be gone (its report would reach a new delivery)


@dataclass(frozen=True, eq=False)
class Delivery:
    """A polled (or, ``chained``, update-v2-claimed) task, as the main thread sees it."""

    poll_count: int
    earlier: Earlier | None = None
    surplus: bool = False  # beyond the slots and budget: it took none
    chained: bool = False
    stopping: bool = False
    lease: LeaseNow = LeaseNow.UNTRACKED
    start_delay: float = 0.0  # the re-delivery wait from now (0: its previous holder cannot run it)
    dying_here: bool = False  # a tree of an earlier attempt of the same logical task dies here


@dataclass(frozen=True)
class WaitBehind:
    """Its next run, polled while the run here still ends: kept, replayed once that run is forgotten."""

    why: str  # "reporting" or "killed"


@dataclass(frozen=True)
class AckDuplicate:
    """The run here delivered again: its lease is acked, no second copy; ``give_back``: the slot and
    budget the poll took go back; ``newer``: this delivery's pollCount is ours now."""

    newer: bool
    give_back: bool


@dataclass(frozen=True)
class HandBack:
    """Polled beyond the slots and budget: re-queued at once, never tracked."""


@dataclass(frozen=True)
class ChainedBack:
    """Claimed by an update-v2 as the stop began: handed back unrun."""


@dataclass(frozen=True)
class BackUnstarted:
    """Polled while stopping: ended before its command started (handed back, or FAILED)."""


@dataclass(frozen=True)
class EndUnstarted:
    """Its lease is fenced, or past its TERM point, before the command started: never started."""

    why: str


@dataclass(frozen=True)
class Hold:
    """Not yet: its previous holder may still run it (``waits``) or an earlier attempt's tree dies
    here (``dying``); its lease is held meanwhile. ``track``: start its lease first."""

    waits: bool
    dying: bool
    track: bool


@dataclass(frozen=True)
class Start:
    """Start its command now (``track``: start its lease first)."""

    track: bool


Admission = WaitBehind | AckDuplicate | HandBack | ChainedBack | BackUnstarted | EndUnstarted | Hold | Start


def admit(d: Delivery) -> Admission:
    """What to do with delivery ``d`` (its slot, if it took one, is held whatever the answer)."""
    e = d.earlier
    if e is not None and d.poll_count > e.poll_count:
        if e.reporting:
            return WaitBehind("reporting")  # a yield re-queued at once, polled before its report's ack
        if e.ownership_lost and not e.yield_waiting:
            # Handed to us again while our copy is killed for a lost ownership: a new run, once that
            # copy is forgotten (and its tree gone). Not while its yield waits to go out: that report
            # would reach this delivery.
            return WaitBehind("killed")
    if e is not None:
        return AckDuplicate(newer=d.poll_count > e.poll_count, give_back=not d.surplus)
    if d.surplus:
        return HandBack()
    if d.stopping:
        return ChainedBack() if d.chained else BackUnstarted()
    if d.lease is LeaseNow.FENCED:
        return EndUnstarted("its lease was fenced before its command started")
    if d.lease is LeaseNow.PAST_TERM:
        return EndUnstarted("its lease ran out before the runner handled it")
    track = d.lease is LeaseNow.UNTRACKED
    waits = d.start_delay > 0
    if waits or d.dying_here:
        return Hold(waits=waits, dying=d.dying_here, track=track)
    return Start(track=track)


# ----- a held task whose hold is over --------------------------------------------------------------


class Read(Enum):
    """Where the read-back of a held task stands."""

    NOT_SENT = "not sent"
    IN_FLIGHT = "in flight"
    ANSWERED = "answered"
    FAILED = "failed"
    NO_READER = "no reader"  # the port cannot read a task back (small test fakes)


@dataclass(frozen=True, eq=False)
class HeldView:
    poll_count: int  # the delivery's
    lease: LeaseNow
    read: Read
    ownership: TaskOwnership | None = None  # the answer (with ANSWERED; None: a 404)


class HeldStart(Enum):
    READ_BACK = "read back"  # send the read-back; decide again on its answer
    WAIT = "wait"  # a read-back is in flight, or the lease's fence is on its way (it ends the task)
    START = "start"
    NOT_OURS = "not ours"  # forget it, report nothing: the server moved on while it was held
    READ_AGAIN = "read again"  # the read failed: try again after READ_AGAIN_SECONDS


def held_start(v: HeldView) -> tuple[HeldStart, str | None]:
    """A held task whose hold is over: start it only if the server still has it IN_PROGRESS with our
    pollCount. While it was held, the previous holder's late result (a FAILED of its lost lease:
    Conductor's update carries no pollCount) or a re-queue may have landed on our delivery; starting
    then would run a task that is over, or next to its retry. Returns the step and, for NOT_OURS, why."""
    if v.lease is not LeaseNow.LIVE:
        return HeldStart.WAIT, None
    if v.read is Read.NO_READER:
        return HeldStart.START, None
    if v.read is Read.NOT_SENT:
        return HeldStart.READ_BACK, None
    if v.read is Read.IN_FLIGHT:
        return HeldStart.WAIT, None
    if v.read is Read.FAILED:
        return HeldStart.READ_AGAIN, None
    why = ownership_lost_reason(v.ownership, v.poll_count)
    if why is not None:
        return HeldStart.NOT_OURS, why
    return HeldStart.START, None


# ----- what an exit means --------------------------------------------------------------------------


class ExitMeaning(Enum):
    FORGET = "forget"  # no longer ours: its tree was killed, nothing is reported
    NOT_STARTED = "not started"  # the command never ran (its exec failed): report that
    RESULT = "result"  # make its result (by fence reason), then ``report_meaning``


def exit_meaning(*, ownership_lost: bool, start_error: bool) -> ExitMeaning:
    if ownership_lost:
        return ExitMeaning.FORGET
    return ExitMeaning.NOT_STARTED if start_error else ExitMeaning.RESULT


class ReportMeaning(Enum):
    REPORT = "report"  # now, as it is
    REPORT_YIELD = "report yield"  # now, marked as our yield (its next holder starts at once)
    HOLD = "hold until gone"  # lease heartbeated, until the tree is gone or its grace + margin passed


def report_meaning(status: TaskStatus, *, tree_gone: bool) -> ReportMeaning:
    """A result made from an exit: a yield is marked only once nothing of the tree runs; a FAILED (the
    server creates the retry at once, for any host) waits for the tree too; the rest go out now."""
    if status is TaskStatus.IN_PROGRESS:
        return ReportMeaning.REPORT_YIELD if tree_gone else ReportMeaning.HOLD
    if status is TaskStatus.FAILED and not tree_gone:
        return ReportMeaning.HOLD
    return ReportMeaning.REPORT


class ReportCheck(Enum):
    SEND = "send"  # as it is
    READ_FIRST = "read first"  # only if the task read back is still ours (``finalfailure.lost_lease_read``)


# The fences after which the server may have handed the task out again: our lease ran out (beats or
# ownership checks lost, or the runner stalled past it), the task's hard ceiling passed, or the task
# is known to be no longer ours (whose results are forgotten anyway: ``exit_meaning``).
_LEASE_RAN_OUT = frozenset({FenceReason.LEASE_EXPIRED, FenceReason.HARD_TIMEOUT, FenceReason.OWNERSHIP_LOST})


def report_check(fence: FenceReason | None) -> ReportCheck:
    """Whether a result (any status: a FAILED, a hand-back) of a task fenced by ``fence`` is read back
    before it is sent. Conductor's update carries no pollCount: once our lease ran out, the server may
    have re-delivered the task (same taskId, a higher pollCount) to another runner, and our FAILED
    would end that runner's delivery (the server creates the retry at once, next to its copy), an
    IN_PROGRESS would re-queue it. So it goes out only if the server still has the task IN_PROGRESS
    with our pollCount (as the outbox delivers saved results); otherwise nothing is sent. Reporting
    nothing at all would cost the fast retry (the server times the task out by itself, R after the
    last beat, and the real server's sweep comes up to 90 s late) and the reason an operator reads."""
    return ReportCheck.READ_FIRST if fence in _LEASE_RAN_OUT else ReportCheck.SEND


class HoldOver(Enum):
    REPORT_YIELD = "report yield"  # the tree is gone: the yield is marked
    REPORT_UNMARKED = "report unmarked"  # the tree outlived its bound: unmarked (its next holder waits)
    REPORT_ANYWAY = "report anyway"  # a FAILED whose tree outlived its bound: it goes out now either way
    REPORT = "report"  # a FAILED whose tree is gone


def hold_over(status: TaskStatus, *, tree_gone: bool) -> HoldOver:
    """A held result whose tree is gone, or whose bound passed."""
    if status is not TaskStatus.IN_PROGRESS:
        return HoldOver.REPORT if tree_gone else HoldOver.REPORT_ANYWAY
    return HoldOver.REPORT_YIELD if tree_gone else HoldOver.REPORT_UNMARKED


class Unstarted(Enum):
    """A task ended before its command started (fenced, stopped, or its lease over when handled)."""

    FORGET = "forget"  # no longer ours: nothing is reported
    HAND_BACK = "hand back"  # an unmarked IN_PROGRESS, re-queued once its hold would have ended
    FAIL = "fail"  # FAILED with the reason (a retry follows at once: nobody else may run it)


def unstarted_meaning(*, ownership_lost: bool, may_run_elsewhere: bool) -> Unstarted:
    """One whose previous holder may still run it is never failed: FAILED would make the server
    create a retry at once that nobody waits for, next to that holder (two copies, a retry spent)."""
    if ownership_lost:
        return Unstarted.FORGET
    return Unstarted.HAND_BACK if may_run_elsewhere else Unstarted.FAIL
