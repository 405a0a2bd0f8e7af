"""The runner's fd budget through the real command (embedded server, real children): a runner whose
open-file limit cannot hold the concurrency asked runs fewer trees at once and every task to the end,
none FAILED for want of fds; a soft limit below the hard one is raised at start.

The limit is set on the runner's process only (``prlimit`` in front of it), never on this test's.
How many trees ran at once is read from the records the children write (start and end times), not
from the runner's log.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from leasecore.runner.fdbudget import trees_that_fit
from tests.integration.helpers import World
from tests.support import wait_until

# The child records when it started and ended (and the open-file limit it got) under $RECORDS.
RECORDING = (
    's=$(date +%s.%N); sleep "$HOLD"; '
    'printf "%s %s %s" "$s" "$(date +%s.%N)" "$(ulimit -n)" > "$RECORDS/$CONDUCTOR_TASK_ID"'
)


def _run_limited(
    world: World, nofile: str, concurrency: int, records: Path, hold: float, cgroup: str = "auto"
) -> subprocess.Popen[str]:
    return world.run("--cgroup", cgroup, "--concurrency", str(concurrency),
                     command=["/bin/sh", "-c", RECORDING], env={"RECORDS": str(records), "HOLD": f"{hold:g}"},
                     wrapper=["prlimit", f"--nofile={nofile}"])  # fmt: skip


def _most_at_once(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    running = most = 0
    for _, step in edges:  # an end sorts before a start at the same instant
        running += step
        most = max(most, running)
    return most


# auto: where the runner may make cgroups (root here), the fork server keeps group files open too;
# off: the runner's own pipes are what runs out first.
@pytest.mark.parametrize("cgroup", ["auto", "off"])
def test_a_runner_whose_fd_limit_cannot_hold_its_concurrency_runs_all(world: World, cgroup: str) -> None:
    limit, concurrency, tasks = 400, 200, 200  # 200 trees would need 400 fds and more for the runner
    fit = trees_that_fit(limit, 1)
    assert fit < concurrency and 2 * concurrency >= limit
    world.define(response_timeout=30)
    records = world.tmp / "records"
    records.mkdir()
    workflows = [world.start_workflow() for _ in range(tasks)]
    proc = _run_limited(world, f"{limit}:{limit}", concurrency, records, hold=2.0, cgroup=cgroup)
    wait_until(
        lambda: (
            len(list(records.iterdir())) == tasks
            or proc.poll() is not None
            or "could not start" in world.stderr(proc)
        ),
        timeout_seconds=240,
        what="every child to write its record (or a start to fail)",
        interval_seconds=0.2,
    )
    assert proc.poll() is None, world.stderr(proc)
    assert "could not start" not in world.stderr(proc), world.stderr(proc)
    statuses = wait_until(
        lambda: (s := [world.workflow_status(wf) for wf in workflows]).count("COMPLETED") == tasks and s,
        timeout_seconds=60,
        what="every workflow to complete",
        interval_seconds=0.5,
    )
    assert set(statuses) == {"COMPLETED"}
    log = world.stderr(proc)
    assert "Too many open files" not in log and "could not start" not in log, log
    assert (
        f"the open-file limit (RLIMIT_NOFILE) is {limit}: it holds {fit} task trees at once" in log
        and f"concurrency asked ({concurrency})" in log
    ), log
    spans = []
    for record in records.iterdir():
        start, end, _nofile = record.read_text().split()
        spans.append((float(start), float(end)))
    assert len(spans) == tasks
    most = _most_at_once(spans)
    assert 1 < most <= fit, most  # the children's own records: never more trees than the fds hold


@pytest.mark.parametrize(("concurrency", "child_limit"), [(100, 2 * 100 + 258), (4, 300)])
def test_a_soft_limit_below_what_the_concurrency_needs_is_raised_that_far_at_start(
    world: World, concurrency: int, child_limit: int
) -> None:
    world.define(response_timeout=30)
    records = world.tmp / "records"
    records.mkdir()
    workflow = world.start_workflow()
    proc = _run_limited(world, "300:4096", concurrency, records, hold=0)
    wait_until(lambda: list(records.iterdir()) or proc.poll() is not None, what="the child's record")
    wait_until(lambda: world.workflow_status(workflow) == "COMPLETED", what="the task to complete")
    log = world.stderr(proc)
    if child_limit > 300:  # 100 slots need 258 + 200 fds: raised that far, not to the hard limit
        said = f"open-file limit (RLIMIT_NOFILE) raised from 300 to {child_limit} (the hard limit is 4096)"
        assert said in log, log
    else:  # 4 trees fit under 300: the limit is left as it was
        assert "raised from" not in log, log
    assert "RLIMIT_NOFILE) is" not in log, log  # every slot fits: no cap, no warning
    (record,) = records.iterdir()
    assert record.read_text().split()[2] == str(child_limit)  # the children inherit the runner's limit
