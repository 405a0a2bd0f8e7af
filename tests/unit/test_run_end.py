"""When a run ends (``stopping.run_end``), as a table: pure values, no threads, no clock."""

from __future__ import annotations

from dataclasses import replace

import pytest

from leasecore.runner.loop.stopping import (
    POLLER_JOIN_SLACK_SECONDS,
    Carry,
    Finished,
    RunView,
    StopFor,
    run_end,
)

IDLE = RunView(in_flight=0, stopping_for=None, pollers_alive=1, longest_poll_seconds=5.0, started=0,
               task_limit=None, polled_any=True, polling=True)  # fmt: skip
MORE = StopFor("no more work to do")


@pytest.mark.parametrize(
    ("change", "end"),
    [
        ({}, Carry()),  # serving, nothing in flight
        ({"in_flight": 1}, Carry()),
        # A task limit (--once, max_tasks) reached: stop; tasks still here are finished first.
        ({"task_limit": 1, "started": 1}, MORE),
        ({"task_limit": 3, "started": 2}, Carry()),
        ({"task_limit": 1, "started": 1, "in_flight": 1}, Carry()),
        # Every polled type's poller ended (its budget spent, or it failed): no more work.
        ({"polling": False}, MORE),
        # Every type paused from the start: the runner idles until stopped.
        ({"polled_any": False, "polling": False}, Carry()),
        # Stopping: over once nothing is in flight and the pollers are gone ...
        ({"stopping_for": 0.0, "pollers_alive": 0}, Finished()),
        ({"stopping_for": 0.0, "pollers_alive": 0, "in_flight": 2}, Carry()),
        # ... or a poll in flight is waited for up to its timeout and a slack, then abandoned.
        ({"stopping_for": 5.0}, Carry()),
        ({"stopping_for": 5.0 + POLLER_JOIN_SLACK_SECONDS}, Carry()),
        ({"stopping_for": 5.0 + POLLER_JOIN_SLACK_SECONDS + 0.01}, Finished(abandoned_poll=True)),
        # A stop under way is not begun again, whatever the limit says.
        ({"stopping_for": 1.0, "task_limit": 1, "started": 1}, Carry()),
    ],
)
def test_run_end(change: dict[str, object], end: Carry | StopFor | Finished) -> None:
    assert run_end(replace(IDLE, **change)) == end  # type: ignore[arg-type]
