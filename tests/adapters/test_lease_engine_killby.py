"""The lease engine hands each lease's kill-by times to the fork server's switch (``on_kill_by``):
at the poll, after each acknowledged heartbeat, never for a failed one, None once the lease ends.
Stepped on a FakeClock (no threads, no sleeps)."""

from __future__ import annotations

import pytest

from leasecore.clock import FakeClock
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.senders import InlineSenders
from tests.adapters.engine_support import T0, FakePort, Fences, policy, run_until, task

KillBys = list[tuple[float, str, tuple[float, float] | None]]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(T0)


def engine_with(clock: FakeClock, port: FakePort, kill_bys: KillBys) -> LeaseEngine:
    def on_kill_by(task_id: str, times: tuple[float, float] | None) -> None:
        kill_bys.append((clock.monotonic(), task_id, times))

    return LeaseEngine(port, Fences(clock), clock=clock, executor=InlineSenders(capacity=4),
                       on_kill_by=on_kill_by)  # fmt: skip


def test_kill_by_follows_the_acks_and_ends_with_the_lease(clock: FakeClock) -> None:
    port, kill_bys = FakePort(clock), []
    engine = engine_with(clock, port, kill_bys)
    # R 4 s, grace 1 s, margin 0.4 s: TERM at ack + 2.6, KILL at ack + 3.6; beats every 2.08 s
    engine.track(task(1), policy(4.0, kill_grace_seconds=1.0, fence_margin_seconds=0.4), polled_at=T0)
    assert kill_bys == [(T0, "t1", (T0 + 2.6, T0 + 3.6))]
    run_until(engine, clock, T0 + 5.0)
    beats = port.beats["t1"]
    assert len(beats) == 2
    # one renewal per acknowledged beat, from its send time, and none otherwise
    assert [times for _, _, times in kill_bys[1:]] == [(b + 2.6, b + 3.6) for b in beats]
    engine.reported("t1")
    assert kill_bys[-1][1:] == ("t1", None)


def test_a_failed_heartbeat_renews_nothing(clock: FakeClock) -> None:
    port, kill_bys = FakePort(clock), []
    port.beat_mode["t1"] = "fail"
    engine = engine_with(clock, port, kill_bys)
    engine.track(task(1), policy(4.0, kill_grace_seconds=1.0, fence_margin_seconds=0.4), polled_at=T0)
    run_until(engine, clock, T0 + 4.0)
    assert port.beats["t1"]  # it tried
    assert kill_bys == [(T0, "t1", (T0 + 2.6, T0 + 3.6))]  # the switch keeps the poll's times
