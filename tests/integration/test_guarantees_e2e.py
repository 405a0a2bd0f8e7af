"""End to end, the core guarantees under faults: the real ``conductor-run run`` against the embedded
server, through the fault proxy (transport faults) or a relay that answers chosen calls itself.

Each test states the guarantee it holds the runner to (docs/leases.md "How it works",
docs/processes.md "Process hygiene", docs/deployment.md "Shutdown and draining", docs/child-interface.md
"Statuses"; DESIGN.md §4-§6). Timing bounds carry slack for a loaded machine.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cli import exitcodes
from tests.integration.helpers import ROOT, World, all_gone, gone, tree_of
from tests.integration.rewriting_relay import RewritingRelay, is_lease
from tests.support import wait_until

TERM_IGNORER = str(ROOT / "sample_tasks" / "term_ignorer.sh")
DAEMONIZER = str(ROOT / "sample_tasks" / "daemonizer.py")
SLACK = 2.5  # seconds of scheduling slack on a loaded 2-core machine


def task_log(world: World, workflow_id: str) -> str:
    return json.dumps(world.admin.get_logs(world.task_of(workflow_id)["taskId"]))


def wait_for_log(world: World, workflow_id: str, text: str) -> None:
    wait_until(lambda: text in task_log(world, workflow_id), what=f"{text!r} in the task's log")


def mark_in_progress(world: World, workflow_id: str) -> str:
    """Another client sends a bare IN_PROGRESS update: the server re-queues the task (SCHEDULED)."""
    task_id = str(world.task_of(workflow_id)["taskId"])
    body = {"taskId": task_id, "workflowInstanceId": workflow_id, "status": "IN_PROGRESS"}
    world.client.request("POST", "/tasks", json_body=body, accept="*/*")
    return task_id


# ---------------------------------------------------------------- the lease under a bad server


@pytest.mark.parametrize("latency", [0.4, 1.8])
def test_a_slow_server_never_lets_the_tree_outlive_its_timeout(world: World, latency: float) -> None:
    """Latency per chunk of 0.2 R or 0.9 R: a beat whose ack comes late never keeps the tree alive
    past the server's own response timeout (plus the kill grace)."""
    world.define(responseTimeoutSeconds=2)
    wf = world.start_workflow(seconds=60)
    with world.proxy() as proxy:
        proc = world.run("--kill-grace", "1", url=proxy.url_for("/api"))
        (pid,) = wait_until(world.child_pids, what="the child to start")
        wait_for_log(world, wf, "sleeping")
        tree = tree_of(pid)
        slowed = time.monotonic()
        proxy.set_mode("latency", latency_seconds=latency)
        wait_until(lambda: all_gone(tree), timeout_seconds=30, what="the tree to be fenced")
        died_wall, died = time.time(), time.monotonic()
        # The lease runs from an ack sent before the slowdown: R (2 s) + the grace (1 s) at most.
        assert died - slowed < 2 + 1 + SLACK
        task = world.task_of(wf)
        if task["status"] == "TIMED_OUT":  # the server gave up too: the tree was not left behind
            assert died_wall <= task["endTime"] / 1000 + 1 + SLACK
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "lease expired" in err


def test_heartbeats_answered_500_fence_the_tree_at_the_lease_deadline(world: World) -> None:
    """The server answers 500 to every extendLease while GET task still says IN_PROGRESS: no beat is
    acknowledged, so the tree is fenced at poll + R, no later than the server times the task out."""
    world.define(responseTimeoutSeconds=3)
    wf = world.start_workflow(seconds=60)
    with RewritingRelay(world.server.url) as relay:
        relay.rule = lambda _method, _path, body: 500 if is_lease(body) else None
        proc = world.run("--kill-grace", "1", url=relay.url)
        (pid,) = wait_until(world.child_pids, what="the child to start")
        tree = tree_of(pid)
        started_ms = world.task_of(wf)["startTime"]
        assert world.client.get_task_status(world.task_of(wf)["taskId"]) == "IN_PROGRESS"
        wait_until(lambda: all_gone(tree), timeout_seconds=30, what="the tree to be fenced")
        assert time.time() - started_ms / 1000 < 3 + 1 + SLACK
        beats = relay.calls("lease")
        assert beats and all(c.status == 500 for c in beats)
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "lease expired" in err


def test_no_heartbeat_follows_the_acknowledged_final_update(world: World) -> None:
    """The final update is refused (500: the server answered, so it was not applied) and retried,
    heartbeats go on meanwhile; the workflow is terminated during the retries; once an update is
    acknowledged no heartbeat is ever sent. (A gateway's 502/503/504 would leave the update's fate
    unknown: its heartbeats stay held until it is read back, docs/final-results.md.)"""
    world.define(responseTimeoutSeconds=2)
    wf = world.start_workflow(seconds=1)
    refuse = {"updates": True}
    with RewritingRelay(world.server.url) as relay:
        relay.rule = lambda method, _path, body: (
            500 if refuse["updates"] and method == "POST" and isinstance(body, dict) and "status" in body
            and not is_lease(body) else None
        )  # fmt: skip
        proc = world.run(url=relay.url)
        wait_until(lambda: relay.calls("update"), what="the first final update")
        world.admin.terminate_workflow(wf, "terminated while the result is being reported")
        terminated = time.monotonic()
        wait_until(lambda: len(relay.calls("update", since=terminated)) >= 2, what="the update retried")
        refuse["updates"] = False
        acked_calls = lambda: [c.at for c in relay.calls("update") if c.status == 200]  # noqa: E731
        acked = max(wait_until(acked_calls, what="an acknowledged update"))
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert relay.calls("lease", since=terminated)  # the beats went on while the update was refused
    assert not relay.calls("lease", since=acked)


# ---------------------------------------------------------------- two copies never run at once


def test_a_task_delivered_again_to_us_is_not_started_twice(world: World) -> None:
    world.define(responseTimeoutSeconds=10)
    wf = world.start_workflow(seconds=4)
    proc = world.run("--concurrency", "2")
    wait_until(world.child_pids, what="the child to start")
    mark_in_progress(world, wf)  # re-queued: our own idle poller takes it again
    wait_until(lambda: world.workflow_status(wf) != "RUNNING", timeout_seconds=40, what="the workflow to end")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED"
    fenced = "no longer ours on the server" in err
    if fenced:
        # The ownership check saw the re-queue first and killed the copy: also fine, as long as a
        # second start (the re-poll, pollCount 2, may still arrive) waits for the first tree to go.
        starts = [i for i, line in enumerate(err.splitlines()) if "started: pid" in line]
        fence = next(i for i, line in enumerate(err.splitlines()) if "no longer ours on the server" in line)
        assert len(starts) <= 2 and all(i > fence for i in starts[1:]), err
    elif task["pollCount"] == 2:
        assert "delivered again while it runs here" in err
        assert err.count("started: pid") == 1


def test_a_task_polled_by_another_worker_is_fenced_and_not_reported(world: World) -> None:
    world.define(responseTimeoutSeconds=10)
    wf = world.start_workflow(seconds=60)
    proc = world.run("--kill-grace", "1")
    (pid,) = wait_until(world.child_pids, what="the child to start")
    tree = tree_of(pid)
    task_id = mark_in_progress(world, wf)
    stolen = world.client.poll(world.task_type, count=1, timeout_ms=100, worker_id="another-worker")
    taken = time.monotonic()
    assert [t.task_id for t in stolen] == [task_id]
    wait_until(lambda: all_gone(tree), timeout_seconds=30, what="our copy to be fenced")
    # The ownership check interval (5 s), its 1 s confirmation, the 1 s grace.
    assert time.monotonic() - taken < 5 + 1 + 1 + SLACK
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    task = world.task_of(wf)
    assert task["status"] == "IN_PROGRESS" and task["workerId"] == "another-worker"  # nothing reported


def test_timeout_seconds_kills_the_tree_although_heartbeats_are_acknowledged(world: World) -> None:
    world.define(responseTimeoutSeconds=2, timeoutSeconds=5, timeoutPolicy="RETRY")
    wf = world.start_workflow(seconds=60)
    proc = world.run("--once", "--kill-grace", "1")
    (pid,) = wait_until(world.child_pids, what="the child to start")
    tree = tree_of(pid)
    wait_until(lambda: all_gone(tree), timeout_seconds=30, what="the hard timeout")
    lived = time.time() - world.task_of(wf)["startTime"] / 1000
    code, err = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, err
    assert 5 - 1 < lived < 5 + 1 + SLACK  # heartbeats (every 1.6 s) did not extend it


def test_a_term_ignoring_tree_does_not_delay_the_other_tasks_heartbeats(world: World) -> None:
    world.define(responseTimeoutSeconds=2)
    script = (
        "import os, time\n"
        "if os.environ['CONDUCTOR_INPUT_SECONDS'] == '99':\n"
        f"    os.execv('/bin/sh', ['/bin/sh', {TERM_IGNORER!r}])\n"
        "time.sleep(int(os.environ['CONDUCTOR_INPUT_SECONDS']))\n"
    )
    hanging = world.start_workflow(seconds=99)
    proc = world.run("--concurrency", "4", "--max-tasks", "4", "--kill-grace", "12",
                     command=[sys.executable, "-c", script])  # fmt: skip
    (pid,) = wait_until(world.child_pids, what="the hanging child")
    wait_for_log(world, hanging, "ignoring TERM")
    tree = tree_of(pid)
    others = [world.start_workflow(seconds=10) for _ in range(3)]
    wait_until(lambda: len(world.child_pids()) == 4, what="four children running")
    world.admin.terminate_workflow(hanging, "fence the TERM ignorer")  # TERM, then KILL after 12 s
    code, err = world.finish(proc, timeout=90)
    assert code == exitcodes.TASK_FAILED, err  # --max-tasks, like --once: one of the four was fenced
    assert all_gone(tree)
    for wf in others:  # R = 2 s, 10 s each: they lived on heartbeats while the other tree hung
        task = world.task_of(wf)
        assert (task["status"], task["pollCount"]) == ("COMPLETED", 1), err


def test_a_sigkilled_runner_takes_its_tree_with_it(world: World) -> None:
    """A runner SIGKILLed mid-task takes its tree with it at once; a restart finds nothing running."""
    world.define(responseTimeoutSeconds=30)
    wf = world.start_workflow(seconds=120)
    proc = world.run()
    (pid,) = wait_until(world.child_pids, what="the child to start")
    wait_for_log(world, wf, "sleeping")
    tree = tree_of(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    wait_until(lambda: all_gone(tree), timeout_seconds=5, what="the tree to die with the runner")
    code, err = world.finish(world.run("--once", "--once-wait", "1"))
    # The restart hands the dead runner's task back (FAILED; retryCount 0, so no retry to run) and
    # finds nothing else to do: the old task is never started a second time.
    assert code == exitcodes.NO_TASK, err
    task = world.task_of(wf)
    assert task["status"] == "FAILED" and "died" in task["reasonForIncompletion"], task


# ---------------------------------------------------------------- shutdown


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, exitcodes.SIGINT), (signal.SIGTERM, exitcodes.SIGTERM)]
)
def test_a_signal_fails_the_task_and_leaves_nothing_running(world: World, sig: int, code: int) -> None:
    world.define(responseTimeoutSeconds=30)
    wf = world.start_workflow()
    proc = world.run("--kill-grace", "2", command=[sys.executable, DAEMONIZER])
    (pid,) = wait_until(world.child_pids, what="the child to start")
    wait_for_log(world, wf, "daemon ")
    daemon = int(task_log(world, wf).split("daemon ")[1].split('"')[0].split("\\")[0])
    tree = [*tree_of(pid), daemon]
    proc.send_signal(sig)
    rc, err = world.finish(proc, timeout=30)
    assert rc == code, err
    assert all_gone(tree), [p for p in tree if not gone(p)]
    task = world.task_of(wf)
    assert (task["status"], task["reasonForIncompletion"]) == ("FAILED", "worker shutting down")


def test_a_drain_past_its_timeout_beats_until_the_tree_is_dead_and_reported(world: World) -> None:
    world.define(responseTimeoutSeconds=2, retryCount=1)
    wf = world.start_workflow(seconds=60)
    with RewritingRelay(world.server.url) as relay:
        proc = world.run("--drain", "--drain-timeout", "4", "--kill-grace", "2", url=relay.url,
                         command=["/bin/sh", TERM_IGNORER])  # fmt: skip
        (pid,) = wait_until(world.child_pids, what="the child to start")
        wait_for_log(world, wf, "ignoring TERM")
        tree = tree_of(pid)
        stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: all_gone(tree), timeout_seconds=30, what="the tree to die")
        died = time.monotonic() - stop
        code, err = world.finish(proc, timeout=30)
    assert code == exitcodes.SIGTERM, err
    assert 4 <= died < 4 + 2 + SLACK  # the drain timeout, then TERM (ignored), KILL after the grace
    task = world.admin.get_workflow(wf)["tasks"][0]
    assert (task["status"], task["reasonForIncompletion"]) == ("FAILED", "worker shutting down")
    beats = [c.at - stop for c in relay.calls("lease", since=stop)]
    update = min(c.at - stop for c in relay.calls("update", since=stop))
    assert beats and max(beats) > 2 + 1  # kept the lease (R = 2 s) past R while draining
    assert max(beats) <= update  # and none after the update


def test_a_second_signal_during_a_drain_kills_at_once(world: World) -> None:
    world.define(responseTimeoutSeconds=2)
    wf = world.start_workflow(seconds=60)
    proc = world.run("--drain", "--drain-timeout", "120", "--kill-grace", "60",
                     command=["/bin/sh", TERM_IGNORER])  # fmt: skip
    (pid,) = wait_until(world.child_pids, what="the child to start")
    wait_for_log(world, wf, "ignoring TERM")
    tree = tree_of(pid)
    proc.send_signal(signal.SIGINT)
    signalled_ms = time.time() * 1000
    wait_until(lambda: "letting 1 task(s) finish" in world.stderr(proc), what="the drain to start")
    # The drain keeps the lease: a heartbeat lands more than R after the signal.
    wait_until(lambda: world.task_of(wf)["updateTime"] > signalled_ms + 2500, what="a beat past R")
    assert world.task_of(wf)["status"] == "IN_PROGRESS"
    second = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc, err = world.finish(proc, timeout=30)
    assert rc == exitcodes.SIGINT, err
    assert all_gone(tree)
    assert time.monotonic() - second < 3 + SLACK  # not the 60 s grace


# ---------------------------------------------------------------- data and credentials


def test_shell_mode_never_executes_the_input(world: World) -> None:
    world.define(responseTimeoutSeconds=10)
    marker = world.tmp / "pwned"
    wf = world.start_workflow(x=f'$(touch {marker}); `touch {marker}`; "; touch {marker}; "')
    argv = [sys.executable, "-m", "cli", "run", "--server", world.server.url, "--task-type", world.task_type,
            "--state-dir", str(world.state_dir), "--once", "--shell",
            'echo "x=$CONDUCTOR_INPUT_X"; echo $CONDUCTOR_INPUT_X']  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
    done = subprocess.run(argv, cwd=world.tmp, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == exitcodes.OK, done.stderr
    assert not marker.exists()
    assert "touch" in task_log(world, wf)  # it was printed as data


def test_a_password_in_the_server_url_is_never_printed_or_stored(world: World) -> None:
    world.define(responseTimeoutSeconds=3)
    world.start_workflow(seconds=60)
    password = "pw-s3cr3t-in-url"
    with world.proxy() as proxy:
        proc = world.run("--kill-grace", "1", url=f"http://user:{password}@{proxy.host}:{proxy.port}/api")
        (pid,) = wait_until(world.child_pids, what="the child to start")
        proxy.set_mode("reset")  # every call fails: errors name the calls they failed
        wait_until(lambda: gone(pid), timeout_seconds=30, what="the tree to be fenced")
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "connection failed" in err or "reset" in err
    stored = "".join(p.read_text(errors="replace") for p in world.state_dir.rglob("*") if p.is_file())
    assert password not in err and password not in stored
