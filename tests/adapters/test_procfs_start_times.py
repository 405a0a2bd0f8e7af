"""``procfs.StartTimes``: a child's start time from the boot clock read around its creation, as
/proc/<pid>/stat gives it, without reading /proc once a few have been checked."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from leasecore.process.linux import procfs

TICK_NS = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
_MAX_SPAWNS = 5000  # a bound on the spawns a test makes waiting for brackets within one tick


def _spawn_bracketed() -> tuple[int, int, int]:
    before = procfs.boot_clock_ns()
    pid = os.posix_spawn("/bin/sleep", ["sleep", "30"], os.environ, setsid=True)
    return pid, before, procfs.boot_clock_ns()


def _reap(pids: list[int]) -> None:
    for pid in pids:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_the_start_time_from_the_boot_clock_is_procs_for_every_child_it_pins() -> None:
    times = procfs.StartTimes(checks=0)  # no check: every pinned start time comes from the clock alone
    # A spawn is well under a 10 ms tick on a quiet machine, so most brackets pin; under load a spawn
    # can straddle a tick and is read instead. Spawn until 100 were pinned (each child reaped once
    # checked), within a bound: what is asserted is that the pinned ones agree with /proc.
    pinned = spawned = 0
    deadline = time.monotonic() + 60
    while pinned < 100 and spawned < _MAX_SPAWNS and time.monotonic() < deadline:
        pid, before, after = _spawn_bracketed()
        spawned += 1
        try:
            read_before = times.read
            start = times.of(pid, before, after)
            info = procfs.read_stat(pid)
            assert info is not None and start == info.start_time
            pinned += times.read == read_before
        finally:
            _reap([pid])
    assert not times.off
    assert pinned >= 100, f"only {pinned} of {spawned} spawns fell within one tick"


def test_the_first_pinned_ones_are_checked_against_proc_then_no_longer_read() -> None:
    times = procfs.StartTimes(checks=3)
    pids: list[int] = []
    try:
        spawned = 0
        deadline = time.monotonic() + 60
        # the 3 checks come with the first 3 spawns that fall within one tick (a few, unless loaded)
        while times.checks and spawned < _MAX_SPAWNS and time.monotonic() < deadline:
            pid, before, after = _spawn_bracketed()
            spawned += 1
            try:
                times.of(pid, before, after)
            finally:
                _reap([pid])
        assert times.checks == 0 and not times.off, f"{times.checks} checks left after {spawned} spawns"
        read = times.read
        pid, _, _ = _spawn_bracketed()
        pids.append(pid)
        info = procfs.read_stat(pid)
        assert info is not None
        tick_start = info.start_time * TICK_NS
        assert times.of(pid, tick_start, tick_start + 1) == tick_start // TICK_NS
        assert times.read == read and not times.off
    finally:
        _reap(pids)


@pytest.fixture
def sleeper() -> Iterator[tuple[int, int]]:
    """A child of ours that sleeps, and its start time as /proc gives it."""
    pid, _, _ = _spawn_bracketed()
    try:
        info = procfs.read_stat(pid)
        assert info is not None
        yield pid, info.start_time
    finally:
        _reap([pid])


def test_a_bracket_across_a_tick_is_read_from_proc(sleeper: tuple[int, int]) -> None:
    pid, start = sleeper
    times = procfs.StartTimes(checks=0)
    edge = start * TICK_NS
    assert times.of(pid, edge - 1, edge + 1) == start  # two ticks: not pinned
    assert times.read == 1


def test_a_clock_that_disagrees_with_proc_turns_the_shortcut_off_for_good(sleeper: tuple[int, int]) -> None:
    pid, start = sleeper
    times = procfs.StartTimes(checks=8)
    wrong = (start + 5) * TICK_NS  # a kernel that counted otherwise
    assert times.of(pid, wrong, wrong + 1) == start  # /proc's, not the clock's
    assert times.off
    assert times.of(pid, wrong, wrong + 1) == start and times.read == 2  # read from then on


def test_a_process_not_in_proc_gives_zero_as_before_and_counts_as_no_check() -> None:
    times = procfs.StartTimes(checks=8)
    missing = 2**22 + 12345  # beyond pid_max: no such process
    assert times.of(missing, 0, 1) == 0  # pinned to tick 0, but checked against /proc: nothing there
    assert times.checks == 8 and not times.off and times.read == 1
