"""The final updates' guard: every attempt to report a task's result excludes that task's heartbeats,
and a result a late heartbeat may undo is made to stick.

Owns ``FinalUpdates``, the reporter's update port: around each attempt of the client's ``update`` it
calls the lease engine's ``begin_final_update`` (no beat of the task starts; one in flight is waited
for), then ``reported`` once the server acknowledged it, or ``final_update_failed`` when it raised (the
task beats again until the reporter's retry, so its lease outlives a slow report), except after an
attempt with no answer, which may still land: its beats stay held until the reporter read it back.
DESIGN.md §4: no heartbeat overlaps or follows a task's final update. ``runner.ports.FinalUpdateGuard``
is the engine side it needs (``LeaseEngine``, and the runner's ``EnginePort``).

A heartbeat the runner got no answer to may still reach the server after the final update, and the
real server's extendLease then writes its stale IN_PROGRESS copy over the result (docs/final-results.md).
Only when the engine knows such a beat (``late_beats``; the common path reads and waits for nothing)
the rules of ``leasecore.lease.finalcheck`` apply here: a terminal result is parked first and sent
once the beat can no longer land; a result such a beat may have followed is read back once it can no
longer land, and sent again (v1, bounded) if the server shows it undone.

Must not touch: the lease engine's queues or leases (that bookkeeping is ``LeaseEngine``'s own), the
retry policy (``leasecore.runner.upstream.reporter``'s), the result's content.

Threads: whichever thread calls ``update``: the reporter's threads in the product (a park's wait and
a read-back, rare, hold that thread up to ``LATE_BEAT_MARGIN_SECONDS`` plus the reads). It holds no
lock of its own; the engine's calls are thread-safe.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from leasecore.clock import Clock, SystemClock
from leasecore.errors import ConductorError
from leasecore.lease.finalcheck import (
    PARK_CALLBACK_SECONDS,
    LateBeats,
    ReadBack,
    ReadStep,
    parked_send_at,
    plan_final_update,
    read_back_at,
)
from leasecore.lease.finalfailure import Failure, failure_of
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import TaskResult, TaskStatus
from leasecore.runner.ports import FinalUpdateGuard, TaskReader, UpdatePort

__all__ = ["FinalUpdates", "make_result_stick"]

log = logging.getLogger("conductor_run.report")

_Guard = TypeVar("_Guard", bound=FinalUpdateGuard)
_Sent = TypeVar("_Sent")
_READ_TIMEOUT_SECONDS = 10.0  # a read-back's and a re-send's own timeout


class FinalUpdates:
    """The reporter's update port: each attempt of a final update excludes that task's heartbeats.

    Wraps the client's ``update``: ``begin_final_update`` before each attempt, ``reported`` once it is
    acknowledged, ``final_update_failed`` when it raises (the reporter may retry: the task beats again
    meanwhile, so its lease outlives a slow report). The engine is attached once it exists (the runner
    makes it), so both can be built without an order between them::

        updates = FinalUpdates(client, reader=client)
        make_engine = lambda on_fence: updates.attach(LeaseEngine(client, on_fence))
        make_reporter = lambda done: Reporter(updates, done)

    ``reader`` (``get_task_ownership``) reads a task back after a late heartbeat (None: never read
    back); ``clock`` and ``sleep`` time the park's wait and the reads; ``observer`` counts re-sends.
    """

    def __init__(self, port: UpdatePort, engine: FinalUpdateGuard | None = None, *,
                 reader: TaskReader | None = None, clock: Clock | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 observer: Observer = NO_METRICS) -> None:  # fmt: skip
        self._port = port
        self._engine = engine
        self._reader = reader
        self._clock = clock or SystemClock()
        self._sleep = sleep
        self._observer = observer

    @property
    def reader(self) -> TaskReader | None:
        """What reads a task back (the reporter reads a yield back with it after its answer was lost)."""
        return self._reader

    def attach(self, engine: _Guard) -> _Guard:
        """Use ``engine`` from now on; returns it (for a factory's one-liner)."""
        self._engine = engine
        return engine

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.guarded(result, lambda: self._port.update(result, timeout_seconds=timeout_seconds),
                     timeout_seconds=timeout_seconds)  # fmt: skip

    def guarded(self, result: TaskResult, send: Callable[[], _Sent], *,
                timeout_seconds: float | None = None,
                send_parked: Callable[[], _Sent] | None = None) -> _Sent:  # fmt: skip
        """``send()`` (one attempt of ``result``'s final update, whichever endpoint carries it) with the
        task's heartbeats excluded: ``reported`` when it returns, ``final_update_failed`` when it
        raises. After a heartbeat of unknown fate: parked first (then ``send_parked()`` instead, if
        given), or read back after (see the module)."""
        engine = self._engine
        if engine is None:
            raise RuntimeError("FinalUpdates.update before attach(): no lease engine to exclude")
        task_id = result.task_id
        engine.begin_final_update(task_id)
        try:
            late = engine.late_beats(task_id)
            parked = late is not None and self._park(result, late, timeout_seconds)
            sent_at = self._clock.monotonic()
            sent = send_parked() if parked and send_parked is not None else send()
        except ConductorError as exc:
            # With no answer the update may still land: a heartbeat now could load the task before it
            # lands and write it back after (the lost update), so the beats stay held until the
            # reporter has read the task back (``finalfailure``: ReadBack). Without a reader, as
            # after any failure: the task beats again until the retry.
            if self._reader is None or failure_of(exc) is not Failure.NO_ANSWER:
                engine.final_update_failed(task_id)
            raise
        except BaseException:
            engine.final_update_failed(task_id)
            raise
        engine.reported(task_id)
        if late is not None and (at := read_back_at(late.until, sent_at)) is not None:
            self._read_back(result, late, at)
        return sent

    def _park(self, result: TaskResult, late: LateBeats, timeout_seconds: float | None) -> bool:
        """A terminal result that a late beat could still undo: park the task (IN_PROGRESS with a long
        callback; a late beat landing now undoes only that, and the workflow cannot end meanwhile),
        then wait until the beat can no longer land; True once parked. Raises what the park raises."""
        plan = plan_final_update(result.status, late.until, self._clock.monotonic())
        if not plan.park:
            return False
        log.info("task %s: a heartbeat of unknown fate may still reach the server; parking the task "
                 "until %.1f s from now, then reporting %s", result.task_id,
                 plan.send_at - self._clock.monotonic(), result.status.value)  # fmt: skip
        park = TaskResult(result.task_id, result.workflow_id, TaskStatus.IN_PROGRESS,
                          output_data=result.output_data, callback_after_seconds=PARK_CALLBACK_SECONDS,
                          worker_id=result.worker_id)  # fmt: skip
        self._port.update(park, timeout_seconds=timeout_seconds)
        self._wait_until(parked_send_at(plan, self._clock.monotonic()))
        return True

    def _read_back(self, result: TaskResult, late: LateBeats, read_at: float) -> None:
        """Read the task back once the late beat can no longer land; send the result again while the
        server shows it undone (``make_result_stick``)."""
        if self._reader is not None:
            make_result_stick(result, read_at=read_at, poll_count=late.poll_count, reader=self._reader,
                              resend=self._resend, clock=self._clock, sleep=self._sleep,
                              on_resent=lambda: self._observer.on_final_result_resent(late.task_type))

    def _resend(self, result: TaskResult) -> bool:
        """The result once more, through v1 (update-v2 would claim another task)."""
        try:
            self._port.update(result, timeout_seconds=_READ_TIMEOUT_SECONDS)
        except ConductorError as exc:
            log.warning("task %s: sending the result again failed: %s", result.task_id, exc)
            return False
        return True

    def _wait_until(self, at: float) -> None:
        _wait_until(self._clock, self._sleep, at)


def make_result_stick(result: TaskResult, *, read_at: float, poll_count: int, reader: TaskReader,
                      resend: Callable[[TaskResult], bool], clock: Clock,
                      sleep: Callable[[float], None] = time.sleep,
                      on_resent: Callable[[], None] = lambda: None) -> None:  # fmt: skip
    """Read ``result``'s task back at ``read_at`` (monotonic) and send the result again (``resend``:
    True once acknowledged) while the server shows it undone (``finalcheck.ReadBack``: bounded reads
    and re-sends; ``on_resent`` counts each). Logs once when it re-sends, and once at the end."""
    check = ReadBack(read_at, poll_count=poll_count, worker_id=result.worker_id)
    reads, read_seconds = 0, 0.0
    while (at := check.next_at) is not None:
        _wait_until(clock, sleep, at)
        reads += 1
        started = clock.monotonic()
        try:
            ownership = reader.get_task_ownership(result.task_id, timeout_seconds=_READ_TIMEOUT_SECONDS)
        except ConductorError:
            check.on_read_failed(clock.monotonic())
            continue
        finally:
            read_seconds += clock.monotonic() - started
        if check.on_read(clock.monotonic(), ownership) is ReadStep.RESEND:
            if check.resent == 0:
                log.warning("task %s: a heartbeat that reached the server after the final update undid it "
                            "(the server shows it IN_PROGRESS again, pollCount %d, this worker); sending "
                            "%s again", result.task_id, poll_count, result.status.value)  # fmt: skip
            on_resent()
            check.on_resent(clock.monotonic(), resend(result))
    log.info("task %s: read back after a heartbeat of unknown fate: %s (%d read(s) in %.1f ms, %d "
             "re-send(s))", result.task_id, check.outcome, reads, read_seconds * 1000, check.resent)


def _wait_until(clock: Clock, sleep: Callable[[float], None], at: float) -> None:
    left = at - clock.monotonic()
    if left > 0:
        sleep(left)
