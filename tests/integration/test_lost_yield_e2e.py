"""A yield whose answer was lost is not sent again once it landed: the embedded server behind a fault
proxy that lets the yield (IN_PROGRESS, callbackAfterSeconds 0) through, holds its answer until the
runner has polled the task's next run, then resets the connection (a real runner, real children).

Sent again then, the yield would re-queue the next run the runner holds (the simulator found it; the
runner read nothing back before it resent). Now the runner reads the task back once the update can no
longer land: a higher pollCount says it landed. Each delivery records its own pollCount (the child's
record, not the runner's log): 1 then 2, and the task ends with pollCount 2.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from cli import exitcodes
from tests.integration.helpers import World
from tests.support import wait_until

pytestmark = pytest.mark.slow

_HOLD_ANSWER_SECONDS = 1.5  # the next run is polled well within this (a long poll of 0.5 s)
_NEXT_RUN_SECONDS = 3


def run_lost_yield_scenario(world: World, tmp_path: Path, *, response_timeout: int = 10) -> None:
    """The scenario above, asserted on ``world``'s server (the embedded one, or the real jar)."""
    world.define(response_timeout=response_timeout)
    config = tmp_path / "conductor.toml"
    config.write_text("[worker]\nin_progress_exit_code = 75\ncallback_after_seconds = 0\n")
    runs = tmp_path / "runs"
    # the next run takes a while: re-queued under it, the task would be polled again meanwhile
    script = ('echo "$CONDUCTOR_POLL_COUNT" >> "$0"; if [ "$CONDUCTOR_POLL_COUNT" -le 1 ]; then exit 75; fi; '
              f'sleep {_NEXT_RUN_SECONDS}; exit 0')
    with world.proxy() as proxy:
        # the runner's yield: a v1 update with IN_PROGRESS and no extendLease (heartbeats carry it)
        proxy.lose_answer(rb'"status"\s*:\s*"IN_PROGRESS"(?![^{}]*"extendLease"\s*:\s*true)',
                          after_seconds=_HOLD_ANSWER_SECONDS)
        wf = world.start_workflow()
        runner = world.run("--config", str(config), "--concurrency", "2", url=proxy.url_for("/api"),
                           command=["/bin/sh", "-c", script, str(runs)])
        wait_until(lambda: world.workflow_status(wf) != "RUNNING", timeout_seconds=60,
                   what="the workflow to end")
        runner.send_signal(signal.SIGTERM)
        code, err = world.finish(runner)
    print(err)  # (shown whole under "Captured stdout" if an assertion below fails; a message is cut)
    assert proxy.lost, "no yield's answer was lost: the scenario did not happen"
    polls = [int(line) for line in runs.read_text().split()]
    assert polls == [1, 2], err  # the next run ran once, as delivered; nothing re-queued it
    task = world.task_of(wf)
    assert world.workflow_status(wf) == "COMPLETED", err
    # (a third poll that ran nothing means the task was queued again under the next run: the runner's
    # log says whether it sent the yield again or held a re-delivery)
    assert task["status"] == "COMPLETED" and task["pollCount"] == 2, task
    assert "had landed" in err, err
    assert code == exitcodes.SIGTERM, err  # (stopped by the test once the workflow ended)
    assert "Traceback" not in err


def test_a_yield_whose_answer_was_lost_is_not_sent_again_after_its_next_run_was_polled(
    world: World, tmp_path: Path
) -> None:
    run_lost_yield_scenario(world, tmp_path)
