"""Doubles and stepping helpers for the lease engine's tests.

``FakePort`` scripts the server's answers per task and records every call with its time on the
engine's clock. On a ``FakeClock`` a "hang" or "slow" call moves that clock on by the time it would
take (the engine then runs stepped: ``InlineSenders`` and ``run_until`` / ``step_until``, no thread);
on the real clock it waits on ``release`` instead (the real-thread tests).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

from leasecore.clock import Clock, FakeClock, SystemClock
from leasecore.errors import ConductorNotFound, ConductorUnavailable
from leasecore.lease import FenceAction, LeasePolicy
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine

T0 = 1000.0  # FakeClock's start


class FakePort:
    """A LeasePort (and an update port, for FinalUpdates) whose answers are scripted per task."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self.cv = threading.Condition()
        self.beats: dict[str, list[float]] = defaultdict(list)
        self.beat_timeouts: dict[str, list[float]] = defaultdict(list)
        self.checks: dict[str, list[float]] = defaultdict(list)
        self.beat_mode: dict[str, str] = {}  # ok | fail | 404 | hang | stuck | slow
        self.check_mode: dict[str, str] = {}  # ok | stuck (until ``release``)
        self.status: dict[str, TaskStatus | None] = {}
        self.poll_count: dict[str, int] = {}  # what a check reads back (default 1)
        self.release = threading.Event()  # frees "stuck" calls (real clock)
        self.slow_seconds = 0.4
        self.update_failures = 0  # the next N updates fail
        self.order: list[tuple[str, str]] = []  # (event, task id) in the order they happened

    @property
    def stepped(self) -> bool:
        return isinstance(self.clock, FakeClock)

    def note(self, event: str, task_id: str) -> None:
        with self.cv:
            self.order.append((event, task_id))
            self.cv.notify_all()

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        with self.cv:
            self.beats[task_id].append(self.clock.monotonic())
            self.beat_timeouts[task_id].append(timeout_seconds)
            self.order.append(("beat-start", task_id))
            mode = self.beat_mode.get(task_id, "ok")
            self.cv.notify_all()
        try:
            self._answer(mode, timeout_seconds)
        finally:
            self.note("beat-end", task_id)

    def _take(self, seconds: float) -> None:
        """Let a call take ``seconds``: the fake clock moves on, the real one waits (``release`` ends it)."""
        if isinstance(self.clock, FakeClock):
            self.clock.advance(seconds)
        else:
            self.release.wait(seconds)

    def _answer(self, mode: str, timeout_seconds: float) -> None:
        if mode == "slow":  # a slow but working server
            self._take(min(self.slow_seconds, timeout_seconds))
        if mode == "hang":  # a server that never answers: the client times out
            self._take(timeout_seconds)
            raise ConductorUnavailable("read timed out")
        if mode == "stuck":  # a broken client that ignores its own timeout
            if self.stepped:
                raise AssertionError("a stuck call needs a real thread to be stuck in")
            self.release.wait()
            raise ConductorUnavailable("finally gave up")
        if mode == "fail":
            raise ConductorUnavailable("connection refused")
        if mode == "404":
            raise ConductorNotFound("No such task found by id", status_code=404)

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        with self.cv:
            self.checks[task_id].append(self.clock.monotonic())
            self.order.append(("check", task_id))
            self.cv.notify_all()
        if self.check_mode.get(task_id) == "stuck":
            self.release.wait()
        with self.cv:
            status = self.status.get(task_id, TaskStatus.IN_PROGRESS)
            return None if status is None else TaskOwnership(status, self.poll_count.get(task_id, 1), "host")

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        """The reporter's call, for FinalUpdates: slow; fails while ``update_failures`` is positive."""
        self.note("update-start", result.task_id)
        try:
            self._take(self.slow_seconds)
            with self.cv:
                self.update_failures -= 1
                if self.update_failures >= 0:
                    raise ConductorUnavailable("server busy")
        finally:
            self.note("update-end", result.task_id)

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        with self.cv:
            assert self.cv.wait_for(predicate, timeout), "condition not reached in time"


class Fences:
    """Records on_fence callbacks with their times on ``clock``."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or SystemClock()
        self.cv = threading.Condition()
        self.calls: list[tuple[float, str, FenceAction]] = []

    def __call__(self, task_id: str, action: FenceAction) -> None:
        with self.cv:
            self.calls.append((self.clock.monotonic(), task_id, action))
            self.cv.notify_all()

    def of(self, task_id: str) -> list[tuple[float, FenceAction]]:
        with self.cv:
            return [(t, a) for t, k, a in self.calls if k == task_id]

    def wait_for(self, count: int, task_id: str, timeout: float) -> list[tuple[float, FenceAction]]:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.of(task_id)) >= count, timeout), self.calls
            return self.of(task_id)


def task(n: int | str, poll_count: int = 0) -> Task:
    return Task(task_id=f"t{n}", workflow_id=f"w{n}", task_type="demo", response_timeout_seconds=2,
                poll_count=poll_count)  # fmt: skip


def policy(r: float = 2.0, **kwargs: object) -> LeasePolicy:
    """R=2 s; no kill grace, no fence margin unless a test sets them: beats every 0.8 R = 1.6 s."""
    values: dict[str, object] = {
        "ownership_check_interval_seconds": 0.0, "kill_grace_seconds": 0.0, "fence_margin_seconds": 0.0,
    }  # fmt: skip
    values.update(kwargs)
    return LeasePolicy(response_timeout_seconds=r, **values)  # type: ignore[arg-type]


def lateness(calls: list[float], polled_at: float, interval: float) -> list[float]:
    """How late each beat was. Acks are immediate and none fails, so the k-th beat is due k intervals
    after the poll: a late beat keeps the cadence (the next is due one interval after the late one was
    planned), and one more than half an interval late pushes the next later still (counted late)."""
    return [call - (polled_at + k * interval) for k, call in enumerate(calls, start=1)]


# ----- stepping an engine on a FakeClock (InlineSenders: no threads) -------------------------------


def advance_to(clock: FakeClock, when: float) -> None:
    """Move ``clock`` to ``when`` (never back), landing at or just past it despite float rounding."""
    gap = when - clock.monotonic()
    if gap > 0:
        clock.advance(gap)
        while clock.monotonic() < when:
            clock.advance(1e-9)


def run_until(engine: LeaseEngine, clock: FakeClock, until: float, *, max_steps: int = 100_000) -> None:
    """Run every wake-up of ``engine`` up to ``until`` (monotonic seconds), each at its own time, then
    leave the clock at ``until``."""
    for _ in range(max_steps):
        engine.run_due()
        wake = engine.next_wakeup()
        if wake is None or wake > until:
            break
        advance_to(clock, wake)
    else:
        raise AssertionError(f"the engine still had wake-ups after {max_steps} steps")
    advance_to(clock, until)
    engine.run_due()


def step_until(
    engine: LeaseEngine, clock: FakeClock, done: Callable[[], bool], *, within_seconds: float
) -> float:
    """Run ``engine``'s wake-ups one by one until ``done()``; fails if that takes more than
    ``within_seconds`` of the fake clock. Returns the clock's time then."""
    deadline = clock.monotonic() + within_seconds
    engine.run_due()
    while not done():
        wake = engine.next_wakeup()
        assert wake is not None and wake <= deadline, f"not done by {deadline} (next wake-up: {wake})"
        advance_to(clock, wake)
        engine.run_due()
    return clock.monotonic()
