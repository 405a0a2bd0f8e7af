"""End to end: a SIGKILLed runner's task is reported FAILED by the next start of a runner with the same
state directory, so the server retries it at once instead of after responseTimeoutSeconds (R = 300 s
here: R cannot be what retries it); but never over another worker's run of it (docs/deployment.md
"Shutdown and draining", DESIGN.md: nothing is lost on failure)."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from cli import exitcodes
from leasecore.process.linux import leftovers
from tests.integration.helpers import World, gone
from tests.support import wait_until

R = 300
# Without the gate the task starts an escapee (its own session: only the tree's marker token finds it)
# and waits; with the gate (created before the restart) the retry completes at once.
COMMAND = ["/bin/sh", "-c", 'if [ -e "$1" ]; then exit 0; fi; setsid sleep 600 & wait', "job"]


def _command(world: World) -> list[str]:
    return [*COMMAND, str(world.gate)]


def _descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _start_and_kill(world: World, *, kill_forkserver: bool) -> tuple[str, int, list[int]]:
    """Start the workflow and a runner, wait for the task's tree, SIGKILL the runner (and, if asked,
    its fork server first, so no one but the next start's sweep kills the escapee). Returns the
    workflow id, the dead runner's pid and the tree's pids."""
    world.define(response_timeout=R, retry_count=1)
    wf = world.start_workflow()
    proc = world.run(command=_command(world))
    (pid,) = wait_until(world.child_pids, what="the child to start")
    escapee = wait_until(lambda: _descendants(pid), what="the escapee to start")
    tree = [pid, *escapee]
    assert world.task_of(wf)["status"] == "IN_PROGRESS"
    if kill_forkserver:
        forkserver = psutil.Process(pid).ppid()
        proc.send_signal(signal.SIGSTOP)  # both die before either can clean up
        os.kill(forkserver, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    if kill_forkserver:  # nothing is left to kill the tree: all of it waits for the next start's sweep
        assert not any(gone(p) for p in tree)
    else:  # the fork server saw the runner die and killed the whole tree
        wait_until(lambda: all(gone(p) for p in tree), timeout_seconds=10, what="the tree to die")
    return wf, proc.pid, tree


@pytest.mark.parametrize("kill_forkserver", [False, True], ids=["runner", "runner-and-fork-server"])
def test_the_next_start_reports_a_killed_runners_task_failed_and_it_is_retried_at_once(
    world: World, kill_forkserver: bool
) -> None:
    wf, dead_pid, tree = _start_and_kill(world, kill_forkserver=kill_forkserver)
    dead_snapshot = world.state_dir / f"runner-{dead_pid}.json"
    assert dead_snapshot.exists()  # what `status` shows, as STALE, until the next start takes over
    world.gate.touch()  # the retry may now complete at once
    started = time.monotonic()
    code, err = world.finish(world.run("--once", "--once-wait", "20", command=_command(world)))
    elapsed = time.monotonic() - started
    assert code == exitcodes.OK, err  # the restart ran the retry, created on the FAILED report
    assert elapsed < R / 4, elapsed  # at once: not after the server's own response timeout
    assert all(gone(p) for p in tree), [p for p in tree if not gone(p)]
    old, retry = world.admin.get_workflow(wf)["tasks"]
    assert old["status"] == "FAILED", old
    assert (f"the worker running this task died (runner pid {dead_pid}); its process tree was killed"
            in old["reasonForIncompletion"])
    assert (retry["status"], retry["retryCount"], retry["pollCount"]) == ("COMPLETED", 1, 1)
    assert world.workflow_status(wf) == "COMPLETED"
    # Its tasks reported, the dead runner's snapshot is gone: it would show them running under it.
    assert not dead_snapshot.exists()
    assert f"was running under runner pid {dead_pid}, which died" in err
    assert f"delivered the saved result of task {old['taskId']} (FAILED)" in err
    assert not list((world.state_dir / "outbox").glob("*.json"))
    assert not list(world.state_dir.glob("processes-*"))


def test_a_killed_runners_task_polled_again_by_another_worker_is_not_reported(world: World) -> None:
    wf, _, _ = _start_and_kill(world, kill_forkserver=False)
    # Another client re-queues the task (bare IN_PROGRESS update) and another worker polls it.
    stolen = world.steal(wf)
    task_id = stolen.task_id
    assert stolen.poll_count == 2
    code, err = world.finish(world.run("--once", "--once-wait", "1", command=_command(world)))
    assert code == exitcodes.NO_TASK, err
    task = world.task_of(wf)
    assert (task["status"], task["pollCount"], task["workerId"]) == ("IN_PROGRESS", 2, "other-worker")
    assert len(world.admin.get_workflow(wf)["tasks"]) == 1  # no retry: nothing was reported
    assert f"task {task_id} (FAILED): no longer ours: the task was polled again by worker " \
           "'other-worker' (pollCount 2, ours 1)" in err
    assert not list((world.state_dir / "outbox").glob("*.json"))


def test_the_record_names_the_task_but_never_the_servers_url(world: World) -> None:
    """The server key in the state directory is a hash: credentials in a URL never reach the disk."""
    world.define(response_timeout=R)
    world.start_workflow()
    url = world.server.url.replace("://", "://user:hunter2@")
    proc = world.run(url=url, command=_command(world))
    (pid,) = wait_until(world.child_pids, what="the child to start")
    (record,) = world.state_dir.glob("processes-*.json")
    (tree,) = [t for t in leftovers.read_record(record)["trees"] if t["pid"] == pid]
    assert tree["meta"]["task_type"] == world.task_type and tree["meta"]["poll_count"] == 1
    journal = record.with_suffix(".journal")
    text = record.read_text() + (journal.read_text() if journal.exists() else "")
    assert "hunter2" not in text and "127.0.0.1" not in text
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
