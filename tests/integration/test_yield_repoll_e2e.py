"""A yield re-queued at once (callbackAfterSeconds 0) and polled back by the same runner before its
report's acknowledgement is processed: the task's next delivery is a new run with its own lease, end
to end (a real runner, the embedded server on loopback, real children).

Before the fix the re-poll either was dropped as "delivered again while it runs here" (nobody held the
task until R timed it out) or started with no lease at all (no heartbeats; a KeyError traceback at
exit). Several yields in a row make the race certain to come up at least once: the runner's poller
is in a long poll while each IN_PROGRESS update re-queues the task.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import exitcodes
from tests.integration.helpers import World
from tests.support import wait_until

_YIELDS_IN_A_ROW = 6
_R_SECONDS = 2
_LAST_RUN_SECONDS = 5  # > R + its slack: only heartbeats keep the last run's task alive

# Each delivery records its pollCount; the first ones yield, the last runs past R and completes.
_YIELD = {
    "native": ("exit 75", "exit 0", ()),
    "stdio": ("""echo '{"status": "IN_PROGRESS", "callbackAfterSeconds": 0}'; exit 0""",
              """echo '{"status": "COMPLETED"}'; exit 0""", ("--protocol", "stdio")),
}


@pytest.mark.parametrize("protocol", sorted(_YIELD))
def test_a_yield_polled_back_at_once_runs_again_here_with_its_own_lease(
    world: World, tmp_path: Path, protocol: str
) -> None:
    world.define(response_timeout=_R_SECONDS)
    config = tmp_path / "conductor.toml"
    config.write_text("[worker]\nin_progress_exit_code = 75\ncallback_after_seconds = 0\n")
    runs = tmp_path / "runs"
    yield_, done, flags = _YIELD[protocol]
    script = (f'echo "$CONDUCTOR_POLL_COUNT" >> "$0"; if [ "$CONDUCTOR_POLL_COUNT" -le {_YIELDS_IN_A_ROW} ]; '
              f'then {yield_}; fi; sleep {_LAST_RUN_SECONDS}; {done}')
    wf = world.start_workflow()
    a = world.run("--config", str(config), "--max-tasks", str(_YIELDS_IN_A_ROW + 1), *flags,
                  command=["/bin/sh", "-c", script, str(runs)])
    wait_until(lambda: world.workflow_status(wf) != "RUNNING", timeout_seconds=60,
               what="the workflow to end")
    code, err = world.finish(a)
    polls = [int(line) for line in runs.read_text().split()]
    assert polls == list(range(1, _YIELDS_IN_A_ROW + 2)), err  # every delivery ran, once, in order
    assert world.workflow_status(wf) == "COMPLETED", err  # the last run outlived R: heartbeats held it
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED" and task["pollCount"] == _YIELDS_IN_A_ROW + 1, task
    assert code == exitcodes.OK, err
    assert "Traceback" not in err
    assert "delivered again while it runs here" not in err
    # (Which side of the race each re-poll fell on varies: a re-poll before the report's done event
    # is logged "... while its result is reported: running it once that report is done"; one after it
    # is a plain new task whose lease the old run's end no longer drops. Before the fix both variants
    # failed this test: the dropped delivery timed out at R, the lease-less one failed at R too.)
