"""A late heartbeat must not undo a final result, on the REAL Conductor OSS server.

The real server's extendLease loads the task, checks "not terminal" on its copy and writes the whole
copy back (CONDUCTOR_PROTOCOL.md §3, ``EDF.extendLease``). A proxy holds each task's first heartbeat
and lets it through together with that task's next update (``latebeat_scenario.py``); on the runner
without the fix, 16 tasks ended with several task records IN_PROGRESS, without output, inside
COMPLETED workflows. Every record must agree with its workflow and keep its output.
"""

from __future__ import annotations

import pytest

from cli import exitcodes
from tests.integration.latebeat_scenario import run_late_beat_scenario
from tests.integration.realworld import RealWorld
from tests.integration.test_lost_yield_e2e import run_lost_yield_scenario

pytestmark = pytest.mark.real_server

TASKS = 16
R_SECONDS = 10
CHILD_SECONDS = 5.0  # the first heartbeat is spread over its interval (6.1 s): most go out before this
KILL_GRACE = 2.0


def test_a_heartbeat_released_with_the_final_update_does_not_undo_it(real_world: RealWorld) -> None:
    outcome = run_late_beat_scenario(real_world, tasks=TASKS, seconds=CHILD_SECONDS,
                                     response_timeout=R_SECONDS, kill_grace=KILL_GRACE)  # fmt: skip
    assert outcome.exit_code == exitcodes.OK, outcome.stderr
    assert outcome.released >= TASKS // 2, f"only {outcome.released} held heartbeats met their update"
    assert outcome.stderr.count("parking the task") >= outcome.released, outcome.stderr
    assert outcome.undone() == [], (
        f"{len(outcome.undone())} of {TASKS} task records disagree with their workflow: "
        f"{outcome.summary(outcome.undone())}\n{outcome.stderr}"
    )


def test_a_yield_undone_by_a_late_heartbeat_is_sent_again(real_world: RealWorld) -> None:
    # Children that yield (exit 3 = IN_PROGRESS with a 60 s callback): a yield is sent at once, read
    # back once the held heartbeat can no longer land, and sent again if the server shows it undone
    command = ["/bin/sh", "-c", f"sleep {CHILD_SECONDS}; exit 3"]
    config = real_world.tmp / "yield.toml"
    config.write_text("[worker]\nin_progress_exit_code = 3\ncallback_after_seconds = 60\n")
    outcome = run_late_beat_scenario(real_world, tasks=TASKS, seconds=CHILD_SECONDS,
                                     response_timeout=R_SECONDS, kill_grace=KILL_GRACE,
                                     args=("--config", str(config)), command=command)  # fmt: skip
    assert outcome.exit_code == exitcodes.OK, outcome.stderr
    assert outcome.released >= TASKS // 2, f"only {outcome.released} held heartbeats met their yield"
    not_yielded = [wf for wf, r in outcome.records.items() if r["task"].get("status") != "SCHEDULED"]
    assert not_yielded == [], f"{outcome.summary(not_yielded)}\n{outcome.stderr}"
    assert outcome.stderr.count("read back after a heartbeat of unknown fate") >= outcome.released


def test_a_yield_whose_answer_was_lost_is_not_sent_again_after_its_next_run_was_polled(
    real_world: RealWorld,
) -> None:
    # test_lost_yield_e2e's scenario on the jar: a proxy lets the yield through and loses its answer
    # until the runner polled the next run; sent again, the yield would re-queue that run
    run_lost_yield_scenario(real_world, real_world.tmp)
