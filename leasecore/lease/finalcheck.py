"""Making a final result stick when a heartbeat's fate was unknown. Pure: no I/O, no clock, no threads.

The real server's extendLease is a read-modify-write of the whole task (CONDUCTOR_PROTOCOL.md §3,
``EDF.extendLease``): a heartbeat handled at the same time as the task's final update can write its
stale IN_PROGRESS copy after the final one, and the record then says IN_PROGRESS, without output,
whatever the workflow did. A heartbeat the runner got an answer to was handled before that answer; one
whose answer never came (timed out, connection reset, a gateway's 502/503/504) may still reach the
server after the runner gave up on it. These rules bound that and decide what to do about it:

* **When such a beat may still land** (``beat_may_land_until``): the runner cuts the connection of a
  request it gave up on (a TCP reset), so only a middlebox that already took the request can still
  deliver it; that is assumed to take at most ``LATE_ARRIVAL_SECONDS`` after the give-up. What undoes
  a result is the beat's write-back, not its arrival: the server writes the copy it loaded back up to
  ``EXTEND_HOLD_SECONDS`` later. ``LATE_BEAT_MARGIN_SECONDS`` is both.
* **How a final update goes out** (``plan_final_update``): with no such beat, at once (the common
  path: nothing is read or waited for). Otherwise a terminal result is first *parked*: an IN_PROGRESS
  update with a long callback, which a late beat may undo harmlessly (the workflow cannot end while
  the task is not terminal), and the result itself goes out once the beat can no longer land and
  the park has settled (``parked_send_at``: a beat released together with the park is handled). A
  yield (IN_PROGRESS with a callback) goes out at once: undone, it can still be sent again.
* **When to read back** (``read_back_at``): after an acknowledged update that such a beat may have
  followed (it may land after the update's send time), once it can no longer land.
* **What the read says** (``undone``) and **what follows** (``ReadBack``, a step machine): a task
  IN_PROGRESS again under this runner (same workerId, same pollCount) although its final update was
  acknowledged has been undone: the result is sent again, then read back once more, a bounded
  number of times. Anything else (terminal, SCHEDULED, re-polled, 404) is left alone.

The invariant a simulator checks with these rules: once a final update was acknowledged and its
read-backs are over, the server's record of the task is what the runner reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from leasecore.models import TaskOwnership, TaskStatus

__all__ = [
    "CONFIRM_AFTER_SECONDS",
    "EXTEND_HOLD_SECONDS",
    "LATE_ARRIVAL_SECONDS",
    "LATE_BEAT_MARGIN_SECONDS",
    "MAX_READS",
    "MAX_RESENDS",
    "PARK_CALLBACK_SECONDS",
    "PARK_SETTLE_SECONDS",
    "READ_RETRY_SECONDS",
    "FinalPlan",
    "LateBeats",
    "ReadBack",
    "ReadStep",
    "beat_may_land_until",
    "parked_send_at",
    "plan_final_update",
    "read_back_at",
    "undone",
    "unknown_fate",
]

# A request given up on, its connection reset, is assumed to reach the server within this much after
# the give-up, or never (a middlebox that took it forwards it at once or fails it).
LATE_ARRIVAL_SECONDS = 2.0
# The server's extendLease loads the task, then writes that copy back (CONDUCTOR_PROTOCOL.md §3): a read
# and a write with nothing between, milliseconds on a healthy server. A beat arriving just inside
# LATE_ARRIVAL_SECONDS still writes back after it; this allows for a pause of the server or its store
# between the two (a JVM collection, a locked row). Found by the simulator: with the arrival alone as
# the margin, a beat loaded 1.1 s before the margin ended wrote its copy over the result after it.
EXTEND_HOLD_SECONDS = 1.5
# Until a beat given up on may still undo a result: its latest arrival plus its write-back.
LATE_BEAT_MARGIN_SECONDS = LATE_ARRIVAL_SECONDS + EXTEND_HOLD_SECONDS
# The park update's callbackAfterSeconds: if the runner dies between the park and the result, the
# task is polled again after this (as after a yield), never left IN_PROGRESS.
PARK_CALLBACK_SECONDS = 60
# After a park was acknowledged, the result waits at least this much more: a heartbeat the network
# let through together with the park (a healing partition) is handled by the server meanwhile.
PARK_SETTLE_SECONDS = 1.0
MAX_READS = 4  # read-backs of one final update, failed reads included
MAX_RESENDS = 2  # final results sent again after one final update
READ_RETRY_SECONDS = 1.0  # a failed read is tried again this much later
CONFIRM_AFTER_SECONDS = 1.0  # a result sent again is read back this much later

_GATEWAY_STATUSES = frozenset({502, 503, 504})  # a middlebox answered; the server may not have yet


def unknown_fate(status_code: int | None) -> bool:
    """A failed heartbeat whose request may still reach the server: no answer at all, or a gateway's."""
    return status_code is None or status_code in _GATEWAY_STATUSES


def beat_may_land_until(gave_up_at: float) -> float:
    """The latest time a heartbeat given up on at ``gave_up_at`` (monotonic) is taken to reach the server
    and write back what it loaded."""
    return gave_up_at + LATE_BEAT_MARGIN_SECONDS


@dataclass(frozen=True, eq=False)
class LateBeats:
    """A task's heartbeats of unknown fate, as its lease engine knows them: the latest time one may
    still land (monotonic seconds), and the pollCount the lease holds (what a read-back compares)."""

    until: float
    poll_count: int
    task_type: str = ""  # for the metrics


@dataclass(frozen=True, eq=False)
class FinalPlan:
    """How one final update goes out: ``park`` first (IN_PROGRESS with ``PARK_CALLBACK_SECONDS``),
    then the result itself at ``send_at`` (monotonic seconds)."""

    park: bool
    send_at: float


def plan_final_update(status: TaskStatus, late_until: float | None, now: float) -> FinalPlan:
    """The plan for a final update of ``status`` at ``now``; ``late_until``: the latest time a heartbeat
    of the task with an unknown fate may still land (None: there is none)."""
    if late_until is None or late_until <= now or not status.is_terminal:
        return FinalPlan(park=False, send_at=now)
    return FinalPlan(park=True, send_at=late_until)


def parked_send_at(plan: FinalPlan, park_acked_at: float) -> float:
    """When a parked result goes out: once the late beat can no longer land, and the park has settled."""
    return max(plan.send_at, park_acked_at + PARK_SETTLE_SECONDS)


def read_back_at(late_until: float | None, update_sent_at: float) -> float | None:
    """When to read the task back after its final update sent at ``update_sent_at`` was acknowledged
    (None: no need; a heartbeat that can no longer land by then cannot undo it)."""
    if late_until is None or late_until <= update_sent_at:
        return None
    return late_until


def undone(ownership: TaskOwnership | None, *, poll_count: int, worker_id: str | None) -> bool:
    """Does the server show the task back IN_PROGRESS under this runner (same worker, same delivery)?
    An unknown pollCount (0) or worker never matches: only what is certainly ours is sent again."""
    return (
        ownership is not None
        and ownership.status is TaskStatus.IN_PROGRESS
        and poll_count > 0
        and ownership.poll_count == poll_count
        and worker_id is not None
        and ownership.worker_id == worker_id
    )


class ReadStep(Enum):
    """What the caller does after feeding a read to ``ReadBack``."""

    DONE = "done"  # the record stands (or nothing more may be tried): stop
    RESEND = "resend"  # send the final result again, then report it with ``on_resent``
    WAIT = "wait"  # read again at ``next_at``


class ReadBack:
    """The read-backs of one acknowledged final update: a step machine the caller drives.

    ``next_at`` says when to read (None: done); ``on_read(now, ownership)`` or
    ``on_read_failed(now)`` feed the read's outcome; after ``RESEND`` the caller sends the result
    again and calls ``on_resent(now, ok)``. At most ``max_reads`` reads and ``max_resends`` re-sends::

        check = ReadBack(read_at, poll_count=3, worker_id="host-1")
        while (at := check.next_at) is not None:
            wait_until(at)
            if check.on_read(now(), client.get_task_ownership(task_id)) is ReadStep.RESEND:
                check.on_resent(now(), send_again())
    """

    def __init__(self, read_at: float, *, poll_count: int, worker_id: str | None,
                 max_reads: int = MAX_READS, max_resends: int = MAX_RESENDS) -> None:  # fmt: skip
        self._poll_count = poll_count
        self._worker_id = worker_id
        self._reads_left = max_reads
        self._resends_left = max_resends
        self.next_at: float | None = read_at
        self.resent = 0  # results sent again (acknowledged or not)
        self.outcome = "pending"  # for the log: why it ended

    def on_read(self, now: float, ownership: TaskOwnership | None) -> ReadStep:
        """The task as read back (None: 404)."""
        self._reads_left -= 1
        if not undone(ownership, poll_count=self._poll_count, worker_id=self._worker_id):
            return self._end("the record stands" if self.resent == 0 else "the record stands after a re-send")
        if self._resends_left == 0:
            return self._end("still undone after the last re-send")
        self._resends_left -= 1
        self.next_at = None  # until on_resent
        return ReadStep.RESEND

    def on_read_failed(self, now: float) -> ReadStep:
        """The read got no answer."""
        self._reads_left -= 1
        if self._reads_left <= 0:
            return self._end("the task could not be read back")
        self.next_at = now + READ_RETRY_SECONDS
        return ReadStep.WAIT

    def on_resent(self, now: float, ok: bool) -> ReadStep:
        """The result was sent again (``ok``: acknowledged): read it back once more, if reads are left."""
        self.resent += 1
        if self._reads_left <= 0:
            return self._end("sent again; no read left to confirm it" if ok else "the re-send failed")
        self.next_at = now + (CONFIRM_AFTER_SECONDS if ok else READ_RETRY_SECONDS)
        return ReadStep.WAIT

    def _end(self, why: str) -> ReadStep:
        self.next_at = None
        self.outcome = why
        return ReadStep.DONE
