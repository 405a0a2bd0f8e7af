"""A late heartbeat must not undo a final result: the embedded server, made to lose the update as the
real one does (``Store.lease_write_back``: extendLease writes its whole stale copy back a moment
after reading it), behind a proxy that holds each task's first heartbeat and lets it through
together with that task's next update (``tests/integration/latebeat_scenario.py``).

Every workflow must end with its task's record agreeing with it and keeping its output (the server's
records, read back at the end). The runner reads a task back only when one of its heartbeats had an
unknown fate: a run with no held heartbeat makes no such read (the server's request log says so).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli import exitcodes
from leasecore.server import EmbeddedServer
from tests.integration.helpers import World
from tests.integration.latebeat_scenario import run_late_beat_scenario

pytestmark = pytest.mark.slow

TASKS = 8
R_SECONDS = 4
CHILD_SECONDS = 2.0  # the first heartbeat (spread over its interval, 2.1 s) goes out before most exits
KILL_GRACE = 1.0


@pytest.fixture
def requests_seen() -> list[str]:
    """The lossy server's request lines ("POST /api/tasks/update-v2 200 1.2ms")."""
    return []


@pytest.fixture
def lossy_world(tmp_path: Path, requests_seen: list[str]) -> Iterator[World]:
    """An embedded server whose extendLease writes its copy back 0.3 s after reading it."""
    with EmbeddedServer(log=requests_seen.append) as server:
        server.store.lease_write_back = functools.partial(time.sleep, 0.3)
        world = World(tmp_path, server)
        try:
            yield world
        finally:
            world.close()


def test_a_heartbeat_released_with_the_final_update_does_not_undo_it(lossy_world: World) -> None:
    outcome = run_late_beat_scenario(lossy_world, tasks=TASKS, seconds=CHILD_SECONDS,
                                     response_timeout=R_SECONDS, kill_grace=KILL_GRACE)  # fmt: skip
    assert outcome.exit_code == exitcodes.OK, outcome.stderr
    assert outcome.released >= 1, f"no held heartbeat met its final update (held {outcome.held})"
    # each held heartbeat had no answer: its task was parked first, and that park released it
    assert outcome.stderr.count("parking the task") >= outcome.released, outcome.stderr
    assert outcome.undone() == [], (
        f"{len(outcome.undone())} of {TASKS} task records disagree with their workflow: "
        f"{outcome.summary(outcome.undone())}\n{outcome.stderr}"
    )


def test_a_yield_undone_by_a_late_heartbeat_is_read_back_and_sent_again(lossy_world: World) -> None:
    # Children that yield (exit 3 = IN_PROGRESS with a 60 s callback): a yield is not parked; the held
    # heartbeat, released with it, puts the task back IN_PROGRESS; the runner reads it back once the
    # heartbeat can no longer land and sends the yield again.
    command = ["/bin/sh", "-c", f"sleep {CHILD_SECONDS}; exit 3"]
    config = lossy_world.tmp / "yield.toml"
    config.write_text("[worker]\nin_progress_exit_code = 3\ncallback_after_seconds = 60\n")
    outcome = run_late_beat_scenario(lossy_world, tasks=TASKS, seconds=CHILD_SECONDS,
                                     response_timeout=R_SECONDS, kill_grace=KILL_GRACE,
                                     args=("--config", str(config)), command=command)  # fmt: skip
    assert outcome.exit_code == exitcodes.OK, outcome.stderr
    assert outcome.released >= 1, f"no held heartbeat met its yield (held {outcome.held})"
    not_yielded = [wf for wf, r in outcome.records.items() if r["task"].get("status") != "SCHEDULED"]
    assert not_yielded == [], f"{outcome.summary(not_yielded)}\n{outcome.stderr}"
    # The server undid yields (a released heartbeat's stale copy landed after them), and the runner
    # sent each again, logged once per task, and read it back standing
    resent = outcome.stderr.count("undid it")
    assert 1 <= resent <= outcome.released, outcome.stderr
    assert outcome.stderr.count("the record stands after a re-send") == resent, outcome.stderr


def test_with_update_v2_claiming_every_result_sticks_too(
    lossy_world: World, requests_seen: list[str]
) -> None:
    # Half the concurrency: final updates go out as update-v2 and claim the rest (a parked one goes
    # through v1 and claims nothing; every other task's heartbeat goes through, so some are not
    # parked). R is 5 s here: a claimed task's child starts a little after its lease does, and must
    # still end before its held heartbeat times out at the TERM point
    outcome = run_late_beat_scenario(lossy_world, tasks=TASKS, seconds=CHILD_SECONDS, response_timeout=5,
                                     kill_grace=KILL_GRACE, concurrency=TASKS // 2,
                                     hold_every=2)  # fmt: skip
    assert outcome.exit_code == exitcodes.OK, outcome.stderr
    assert outcome.released >= 1, f"no held heartbeat met its final update (held {outcome.held})"
    v2 = [line for line in requests_seen if line.startswith("POST /api/tasks/update-v2 ")]
    assert v2, [line for line in requests_seen if "/tasks" in line]
    assert outcome.undone() == [], f"{outcome.summary(outcome.undone())}\n{outcome.stderr}"
