"""End to end, a runner that stalls (SIGSTOP: a deadlock, a swap storm, a debugger alike) while its
fork server and task tree go on: the fork server's dead-man's switch ends the tree by the lease's
deadline with nobody's help (docs/runner-stalls.md). Real ``conductor-run run`` processes against the
embedded server; every overlap and death is read from the copies' own records (``stall_child.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from cli import exitcodes
from tests.integration.copies import STALL_CHILD, Copy, copies
from tests.integration.helpers import ROOT, World, gone
from tests.integration.test_metrics_e2e import metrics_port, scrape, value
from tests.support import wait_until

SLACK = 2.5  # seconds of scheduling slack on a loaded 2-core machine
R = 4  # responseTimeoutSeconds: G = 1 s (a quarter of R), M = 0.4 s: TERM at ack + 2.6 s, KILL at ack + 3.6 s


def command(record: Path) -> list[str]:
    return [sys.executable, STALL_CHILD, str(record)]


def started(record: Path, count: int) -> list[Copy]:
    return wait_until(lambda: (found := copies(record)) and len(found) >= count and found,
                      60, what=f"{count} cop(ies) of the task to start")  # fmt: skip


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGSTOP ``proc`` and wait until every thread of it has stopped (each stops on its way back to
    user space: a thread in the middle of something can still act for a moment after the kill)."""
    os.kill(proc.pid, signal.SIGSTOP)

    def all_stopped() -> bool:
        states = []
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        return bool(states) and all(state in ("T", "t") for state in states)

    wait_until(all_stopped, 10, what="the runner to stop")


def forkserver_of(runner: subprocess.Popen[str]) -> psutil.Process:
    (server,) = [p for p in psutil.Process(runner.pid).children() if "forkserver" in " ".join(p.cmdline())]
    return server


def first_attempt(world: World, workflow_id: str) -> dict[str, object]:
    return dict(world.admin.get_workflow(workflow_id)["tasks"][0])


def test_a_stalled_runners_copy_is_dead_before_the_retry_starts_on_another_runner(world: World) -> None:
    world.define(response_timeout=R, retry_count=1)
    record = world.tmp / "copies"
    a = world.run("--max-tasks", "1", "--worker-id", "host-a", command=command(record))
    wf = world.start_workflow()
    started(record, 1)
    stop(a)  # A's main process stops; its fork server and the tree go on
    try:
        b = world.run("--max-tasks", "1", "--worker-id", "host-b", command=command(record))
        first, second = started(record, 2)[:2]
        # B's copy runs a while (for as long as it pleased, A's copy would overlap it)
        wait_until(lambda: copies(record)[1].last >= second.start + 1.0, 30, what="B's copy to run 1 s")
        first, second = copies(record)[:2]
        assert gone(first.pid)
        assert first.last < second.start, "A's copy still ran when B's started"
        assert first.term_rounds == 1  # one TERM (ignored), then the KILL
        timed_out = first_attempt(world, wf)
        assert timed_out["status"] == "TIMED_OUT"
        assert first.last_wall <= int(timed_out["endTime"]) / 1000  # dead before the server moved on
        assert first.task_id == timed_out["taskId"] and second.task_id != first.task_id  # B has the retry
    finally:
        os.kill(a.pid, signal.SIGCONT)
    code, err = world.finish(a)
    assert code == exitcodes.TASK_FAILED, err
    assert "the lease ran out while the runner was stalled" in err
    assert "reporting FAILED (lease expired while the runner was stalled" in err
    assert copies(record)[0].term_rounds == 1  # the resumed runner sent no second TERM
    b.send_signal(signal.SIGTERM)
    world.finish(b)


def test_a_stalled_runner_that_resumes_reports_truthfully_and_keeps_its_result_in_the_outbox(
    world: World,
) -> None:
    world.define(response_timeout=R)
    record = world.tmp / "copies"
    with world.proxy() as proxy:
        a = world.run("--worker-id", "host-a", "--metrics-port", "0", url=proxy.url_for("/api"),
                      command=command(record))  # fmt: skip
        wf = world.start_workflow()
        (copy,) = started(record, 1)
        stop(a)
        try:
            wait_until(lambda: first_attempt(world, wf)["status"] == "TIMED_OUT", 30, what="the timeout")
            assert wait_until(lambda: gone(copy.pid), 10)
            copy = copies(record)[0]
            assert copy.last_wall <= int(first_attempt(world, wf)["endTime"]) / 1000
            proxy.set_mode("blackhole")  # its report cannot get through: it must wait in the outbox
        finally:
            os.kill(a.pid, signal.SIGCONT)
        outbox = world.state_dir / "outbox"
        def saved_body() -> str:  # a saved result, whole (not a save in progress, .tmp-*.json)
            for path in outbox.glob("*.json"):
                try:
                    if not path.name.startswith(".") and (text := path.read_text()):
                        return text
                except FileNotFoundError:  # claimed or replaced meanwhile: look again
                    pass
            return ""

        body = wait_until(saved_body, 60, what="the result in the outbox")
        assert "lease expired while the runner was stalled" in body and '"FAILED"' in body
        shown = _status_json(world)
        (task,) = [t for r in shown["runners"] for t in r["tasks"] if t["task_id"] == copy.task_id]
        assert task["fenced_by"] == "switch" and task["fence_reason"] == "lease_expired"
        err = world.stderr(a)
        assert "the lease ran out while the runner was stalled" in err
        samples = scrape(metrics_port(world, a))  # /metrics says the switch ended it, not the runner
        assert value(samples, "conductor_run_switch_fences_total", taskType=world.task_type,
                     reason="lease_expired") == 1  # fmt: skip
        assert len(copies(record)) == 1 and copies(record)[0].term_rounds == 1  # no second start or kill
        a.send_signal(signal.SIGTERM)
        world.finish(a)
    assert list(outbox.glob("*.json"))  # still there for the next start (the server is unreachable)


def test_a_fork_server_killed_while_the_runner_is_stalled_leaves_the_tree_until_the_runner_resumes(
    world: World,
) -> None:
    # The residual case (docs/runner-stalls.md): with both the runner and its fork server out, nothing
    # on this host can end the tree; the runner kills it the moment it runs again.
    world.define(response_timeout=R)
    record = world.tmp / "copies"
    a = world.run("--worker-id", "host-a", command=command(record))
    wf = world.start_workflow()
    (copy,) = started(record, 1)
    server = forkserver_of(a)
    stop(a)
    try:
        server.kill()
        wait_until(lambda: gone(server.pid), 10)  # (a zombie until the stopped runner reaps it)
        wait_until(lambda: first_attempt(world, wf)["status"] == "TIMED_OUT", 30, what="the server's timeout")
        end = int(first_attempt(world, wf)["endTime"]) / 1000
        wait_until(lambda: copies(record)[0].last_wall > end + 0.5, 10, what="the copy to outlive the lease")
        assert not gone(copy.pid)  # the residual case: alive past the server's deadline
    finally:
        resumed = time.monotonic()
        os.kill(a.pid, signal.SIGCONT)
    assert wait_until(lambda: gone(copy.pid), 30)
    died_after = copies(record)[0].last - resumed
    assert died_after < SLACK, f"the tree lived {died_after:.2f} s after the runner resumed"
    wait_until(lambda: "the fork server died; killing every task tree it held" in world.stderr(a), 30)
    # Its switch gone, the runner learns of the stall from its own lease: the deadline passed unfenced.
    wait_until(lambda: "reporting FAILED (lease expired while the runner was stalled" in world.stderr(a), 30)
    a.send_signal(signal.SIGTERM)
    code, err = world.finish(a)
    assert code == exitcodes.SIGTERM, err


def _status_json(world: World) -> dict[str, object]:
    argv = [sys.executable, "-m", "cli", "status", "--json", "--state-dir", str(world.state_dir)]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(out.stdout))
