"""How often the runner publishes its status snapshots (``publishing.SnapshotPublisher``), on a
``FakeClock``: a burst of events is one publish, and a costly snapshot is spaced so that publishing
takes at most 1/20 of the main loop's time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from leasecore.clock import FakeClock
from leasecore.runner.loop.publishing import MAIN_LOOP_SHARE, SnapshotPublisher
from leasecore.runner.loop.table import TaskTable
from leasecore.runner.ports import EnginePort, RunOptions
from leasecore.runner.upstream.server_contact import ServerContact


class Status:
    """A status port whose every publish costs ``cost`` seconds of the clock."""

    def __init__(self, clock: FakeClock, cost: float = 0.0) -> None:
        self.clock, self.cost, self.published_at = clock, cost, list[float]()

    def publish(self, tasks: Sequence[Any], *, server: Any, paused: Sequence[str] = (),
                stopping: bool = False) -> bool:  # fmt: skip
        self.published_at.append(self.clock.monotonic())
        self.clock.advance(self.cost)
        return True

    def remove(self) -> None:
        pass


def publisher(clock: FakeClock, status: Status, min_interval: float = 0.2) -> SnapshotPublisher:
    table = TaskTable(RunOptions(status_min_interval_seconds=min_interval), {})
    return SnapshotPublisher(table, clock=clock, engine=cast(EnginePort, None), status=status, pollers={},
                             contact=ServerContact(clock), paused_types=list)  # fmt: skip


def test_a_burst_of_events_is_one_publish_and_the_change_goes_out_when_due() -> None:
    clock = FakeClock()
    status = Status(clock)
    snapshots = publisher(clock, status, min_interval=0.25)  # (binary fractions: exact sums)
    snapshots.maybe_publish()
    for _ in range(100):  # 100 events within the same instant
        snapshots.maybe_publish()
    assert status.published_at == [1000.0]
    assert snapshots.pending
    assert snapshots.wait_seconds(0.5) == 0.25  # the loop wakes when the next one is due
    clock.advance(0.125)
    snapshots.maybe_publish()
    assert len(status.published_at) == 1 and snapshots.wait_seconds(0.5) == 0.125
    clock.advance(0.125)
    snapshots.maybe_publish()
    assert status.published_at == [1000.0, 1000.25] and not snapshots.pending
    assert snapshots.wait_seconds(0.5) == 0.5  # nothing pending: the loop's own wait


def test_a_costly_snapshot_takes_at_most_a_twentieth_of_the_loop() -> None:
    clock = FakeClock()
    status = Status(clock, cost=0.05)  # 1000 tasks: about 50 ms a snapshot
    snapshots = publisher(clock, status)
    for _ in range(200):
        snapshots.maybe_publish()
        clock.advance(0.01)
    gaps = {round(b - a, 6) for a, b in zip(status.published_at, status.published_at[1:], strict=False)}
    assert len(status.published_at) >= 3
    assert min(gaps) >= MAIN_LOOP_SHARE * 0.05  # 1 s apart, not every status_min_interval (0.2 s)


def test_without_a_status_port_nothing_is_built() -> None:
    clock = FakeClock()
    table = TaskTable(RunOptions(), {})
    snapshots = SnapshotPublisher(table, clock=clock, engine=cast(EnginePort, None), status=None, pollers={},
                                  contact=ServerContact(clock), paused_types=list)  # fmt: skip
    snapshots.publish()  # no port: returns without reading the engine (None here)
    snapshots.maybe_publish()
    assert not snapshots.pending
