"""No two copies at once, at the two edges a review found open, end to end (real runners, the embedded
server, TERM-ignoring copies that record their own life; see test_handover_e2e.py):

* a yield (IN_PROGRESS) whose tree still has an escapee must not tell the next holder to start at once;
* a held re-delivery handed back unstarted (the runner stops) must not become FAILED: that makes the
  server create a retry at once, which starts next to the previous holder's copy.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.integration.helpers import World
from tests.integration.rewriting_relay import RewritingRelay
from tests.integration.test_handover_e2e import COPY, Copies, psutil_alive, stop
from tests.integration.test_metrics_e2e import metrics_port, scrape, value
from tests.integration.test_operate_e2e import operate
from tests.support import wait_until

# The first delivery's yield, native (in_progress_exit_code) or stdio (a document saying IN_PROGRESS):
# a TERM-ignoring escapee in its own session (output away from the document's pipe), then the yield.
_YIELDS = {
    "native": ("exit 75", ()),
    "stdio": ("""echo '{"status": "IN_PROGRESS", "callbackAfterSeconds": 0}'; exit 0""",
              ("--protocol", "stdio")),
}


@pytest.mark.parametrize("protocol", sorted(_YIELDS))
def test_a_yield_whose_escapee_lives_is_marked_only_once_the_tree_is_gone(
    world: World, tmp_path: Path, protocol: str
) -> None:
    """A's first delivery starts a TERM-ignoring escapee (its own session) and yields at once
    (in_progress_exit_code, callbackAfterSeconds 0). The yield marker (next holder: start at once)
    reaches the server only once the escapee is gone (the fork server kills it kill_grace after the
    exit): the escapee's own last record is before the moment the marker is seen on the server. B then
    polls the second delivery and starts it at once (no re-delivery wait)."""
    world.define(responseTimeoutSeconds=20)
    copies = Copies(tmp_path / "copies")
    config = tmp_path / "conductor.toml"
    # (callbackAfterSeconds 0: A's own poller may get the second delivery back before its yield's
    # report is done; that delivery is then A's next run: test_yield_repoll_e2e.py)
    config.write_text("[worker]\nin_progress_exit_code = 75\ncallback_after_seconds = 0\n"
                      "ownership_check_interval = 5\n")
    yield_, flags = _YIELDS[protocol]
    script = ('if [ "$CONDUCTOR_POLL_COUNT" = 1 ]; then setsid /bin/sh -c "$0" copy "$1" '
              f'</dev/null >/dev/null 2>&1 & sleep 0.2; {yield_}; fi; exec /bin/sh -c "$0" copy "$1" >&2')
    command = ["/bin/sh", "-c", script, COPY, str(copies.dir)]
    wf = world.start_workflow()
    a = world.run("--config", str(config), "--kill-grace", "2", *flags, command=command)
    wait_until(lambda: len(copies.read()) == 1, what="A's escapee to start")

    def marked() -> bool:
        output = world.task_of(wf).get("outputData") or {}
        return output.get("conductorRunYieldedAtPollCount") == 1

    wait_until(marked, interval_seconds=0.01, what="the yield marker on the server")
    marked_at = time.time()
    lived = copies.read()[0].last_alive - marked_at
    assert lived < 0, f"the yield was marked while the escapee still lived {lived:.2f} s"
    wait_until(lambda: len(copies.read()) == 2, timeout_seconds=30, what="the second delivery's copy")
    first, second = copies.assert_never_overlapped()
    assert (first.poll_count, second.poll_count) == (1, 2)
    assert first.last_alive < marked_at
    stop(world, a)
    err = world.stderr(a)
    assert "reporting IN_PROGRESS once it is" in err
    assert "not starting it yet" not in err  # nothing of the first delivery was left to wait for


def test_a_held_redelivery_handed_back_at_a_stop_is_requeued_not_failed(
    world: World, tmp_path: Path
) -> None:
    """A runs the task; a bare IN_PROGRESS update re-queues it; B polls it (pollCount 2) and holds it
    (A may still run it); B is stopped while it holds it. B hands it back as an unmarked IN_PROGRESS:
    the same taskId comes back (no retry spent, the task is not FAILED), and C, polling meanwhile,
    waits for A's fence in turn. Before the fix B reported FAILED and C ran the retry next to A."""
    world.define(responseTimeoutSeconds=20, retry_count=1)
    copies = Copies(tmp_path / "copies")
    config = tmp_path / "conductor.toml"
    config.write_text("[worker]\nownership_check_interval = 2\n")
    wf = world.start_workflow()
    a = world.run("--config", str(config), "--kill-grace", "1", "--max-tasks", "1", command=copies.command())
    wait_until(lambda: len(copies.read()) == 1, what="A's copy to start")
    b = world.run("--config", str(config), "--kill-grace", "1", "--metrics-port", "0",
                  command=copies.command())
    wait_until(lambda: "serving" in world.stderr(b), what="B to poll")
    task_id = str(world.task_of(wf)["taskId"])
    world.client.request("POST", "/tasks", json_body={
        "taskId": task_id, "workflowInstanceId": wf, "status": "IN_PROGRESS"}, accept="*/*")
    wait_until(lambda: "not starting it yet" in world.stderr(b), what="B to hold the re-delivery")
    samples = scrape(metrics_port(world, b))  # the held task takes B's one slot
    assert value(samples, "conductor_run_tasks_waiting", taskType=world.task_type) == 1
    assert value(samples, "conductor_run_slots_free", taskType=world.task_type) == 0
    c = world.run("--config", str(config), "--kill-grace", "1", command=copies.command())
    wait_until(lambda: "serving" in world.stderr(c), what="C to poll")
    stop(world, b)  # while it holds the task (its hold is A's ownership window: R + twice the budget's)
    # B hands it back with the rest of its hold as callback, then C holds it a whole window: ~2 R
    wait_until(lambda: len(copies.read()) == 2, timeout_seconds=75, what="C's copy to start")
    first, second = copies.assert_never_overlapped()
    wait_until(lambda: copies.read()[0].exited is not None or not psutil_alive(first.pid),
               what="A's copy's exit to be seen")  # fmt: skip
    first, second = copies.assert_never_overlapped()
    assert first.task_id == second.task_id == task_id and second.poll_count == 3  # the same task, again
    tasks = world.admin.get_workflow(wf)["tasks"]
    assert len(tasks) == 1 and tasks[0]["status"] == "IN_PROGRESS", tasks  # no retry created
    stop(world, c)
    world.finish(a)  # ended on its own: its one task was fenced (ownership lost, nothing reported)
    assert "no longer ours" in world.stderr(a)
    assert "handing it back" in world.stderr(b)


def test_a_task_polled_back_while_its_copy_here_is_killed_runs_once_that_copy_is_gone(
    world: World, tmp_path: Path
) -> None:
    """A's ownership check reads 404 (a relay's lie: the task is A's on the server), so A fences its
    TERM-ignoring copy (kill_grace 4 s: room for the poll-back on a loaded machine); meanwhile the
    task is re-queued and A itself polls it back (pollCount 2, a spare slot). That delivery is a new
    run: it starts once the dying copy is gone, never next to it. Before the fix A dropped it
    ("delivered again while it runs here"), and the server waited on A until R to time it out (with
    retryCount 0: the workflow FAILED)."""
    world.define(responseTimeoutSeconds=20)
    copies = Copies(tmp_path / "copies")
    config = tmp_path / "conductor.toml"
    config.write_text("[worker]\nownership_check_interval = 1\n")
    wf = world.start_workflow()
    with RewritingRelay(world.server.url) as relay:
        a = world.run("--config", str(config), "--kill-grace", "4", "--concurrency", "2", url=relay.url,
                      command=copies.command())  # fmt: skip
        wait_until(lambda: len(copies.read()) == 1, what="A's copy to start")
        task_id = str(world.task_of(wf)["taskId"])
        relay.rule = lambda method, path, _body: 404 if method == "GET" and task_id in path else None
        wait_until(lambda: "no longer ours" in world.stderr(a), what="A to fence its copy")
        relay.rule = lambda _method, _path, _body: None  # the next delivery's checks read the truth
        world.client.request("POST", "/tasks", json_body={
            "taskId": task_id, "workflowInstanceId": wf, "status": "IN_PROGRESS"}, accept="*/*")
        wait_until(lambda: "polled again (pollCount 2)" in world.stderr(a)
                   or "delivered again" in world.stderr(a), what="A to poll it back")  # fmt: skip
        assert psutil_alive(copies.read()[0].pid)  # the race itself: the first copy still dies
        wait_until(lambda: len(copies.read()) == 2, timeout_seconds=30, what="the next run's copy")
        first, second = copies.assert_never_overlapped()
        assert first.task_id == second.task_id == task_id and second.poll_count == 2
        wait_until(lambda: copies.read()[0].exited is not None or not psutil_alive(first.pid),
                   what="the first copy's exit to be seen")  # fmt: skip
        copies.assert_never_overlapped()
        task = world.task_of(wf)
        assert (task["status"], task["pollCount"]) == ("IN_PROGRESS", 2), task  # A's run, not timed out
        stop(world, a)
    assert "not starting it twice" not in world.stderr(a)
    assert "polled again (pollCount 2) while its earlier copy here is killed" in world.stderr(a)


def test_a_failed_attempt_whose_escapee_lives_is_reported_only_once_the_tree_is_gone(
    world: World, tmp_path: Path
) -> None:
    """A's attempt starts a TERM-ignoring escapee (its own session) and exits 1: FAILED, and the server
    creates the retry at once. A is paused, so B, a runner on another host as far as A's trees are
    concerned, polls the retry and starts it at once (a retry is a new task: no re-delivery wait). The
    FAILED must therefore reach the server only once A's tree is gone (the fork server kills the escapee
    kill_grace after the exit), or B's copy runs beside the escapee: checked from the copies' records.
    Found by the simulator (the failed_before_tree_gone race)."""
    world.define(responseTimeoutSeconds=20, retry_count=1)
    copies = Copies(tmp_path / "copies")
    script = ('if [ "$CONDUCTOR_RETRY_COUNT" = 0 ]; then setsid /bin/sh -c "$0" copy "$1" '
              '</dev/null >/dev/null 2>&1 & sleep 1; exit 1; fi; exec /bin/sh -c "$0" copy "$1" >&2')
    command = ["/bin/sh", "-c", script, COPY, str(copies.dir)]
    world.start_workflow()
    a = world.run("--kill-grace", "2", command=command)
    wait_until(lambda: len(copies.read()) == 1, what="A's escapee to start")
    paused = operate(world, "pause", "--runner", str(a.pid))
    assert paused.returncode == 0, paused.stderr
    b = world.run("--kill-grace", "2", command=command)
    wait_until(lambda: len(copies.read()) == 2, timeout_seconds=30, what="the retry's copy on B")
    wait_until(lambda: copies.read()[0].exited is not None, what="A's escapee's exit to be seen")
    first, second = copies.assert_never_overlapped()
    assert first.task_id != second.task_id  # the retry: a new task
    stop(world, a, b)
    assert "its tree is not gone yet" in world.stderr(a)
