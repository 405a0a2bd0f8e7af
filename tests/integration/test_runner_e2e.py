"""End to end: the real ``conductor-run run`` process against the embedded server, real children."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from cli import exitcodes
from leasecore.conductor.client import ConductorClient
from leasecore.models import TaskResult, TaskStatus
from leasecore.runner.wiring import Redelivery
from leasecore.state.outbox import Outbox
from tests.faultproxy import FaultProxy
from tests.integration.helpers import AUTH_KEY, AUTH_SECRET, FAILER, ROOT, World, gone
from tests.support import wait_until

TERM_IGNORER = str(ROOT / "sample_tasks" / "term_ignorer.sh")


def test_a_long_task_outlives_its_response_timeout_thanks_to_heartbeats(world: World) -> None:
    world.define(response_timeout=2)
    wf = world.start_workflow(seconds=5)
    code, err = world.finish(world.run("--once"))
    assert code == exitcodes.OK, err
    assert world.workflow_status(wf) == "COMPLETED"
    task = world.task_of(wf)
    assert task["pollCount"] == 1 and task["outputData"]["slept"] == 5
    logs = [entry["log"] for entry in world.admin.get_logs(task["taskId"])]
    assert any("sleeping 5s" in line for line in logs)


def test_once_exit_codes_for_failed_and_for_nothing(world: World) -> None:
    world.define(response_timeout=10)
    world.start_workflow(code=3)
    code, err = world.finish(world.run("--once", command=["/bin/sh", FAILER]))
    assert code == exitcodes.TASK_FAILED, err
    started = time.monotonic()
    code, err = world.finish(world.run("--once", "--once-wait", "1"))
    assert code == exitcodes.NO_TASK, err
    assert "--once: no task within 1 s" in err
    assert time.monotonic() - started < 1 + 15  # the wait, plus start-up and shutdown under load


def test_a_paused_task_type_idles_instead_of_ending_the_run(world: World) -> None:
    """Paused (as the SDKs' workers): not polled, and the runner stays up, as a service must (an exit 0
    at once would have a Restart=always unit restart it in a loop)."""
    world.define(response_timeout=10)
    wf = world.start_workflow(code=0)
    paused = {"CONDUCTOR_WORKER_ALL_PAUSED": "true"}
    proc = world.run(env=paused)
    wait_until(lambda: "is paused: not polling it" in world.stderr(proc), what="the pause logged")
    # Still running a while later (its snapshot, refreshed every second, keeps changing), and the task
    # was never handed out:
    seen: set[str] = set()

    def published() -> bool:
        for path in world.state_dir.glob("runner-*.json"):
            with contextlib.suppress(OSError, ValueError):
                seen.add(json.loads(path.read_text())["updated_at"])
        return len(seen) >= 3

    wait_until(published, what="the runner to go on publishing its status")
    assert proc.poll() is None, world.stderr(proc)
    assert world.task_of(wf)["status"] == "SCHEDULED"
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "no more work to do" not in err
    # With --once it is "no task within --once-wait", after that wait, not at once.
    started = time.monotonic()
    code, err = world.finish(world.run("--once", "--once-wait", "1", env=paused))
    assert code == exitcodes.NO_TASK, err
    assert "--once: no task within 1 s" in err
    assert time.monotonic() - started >= 1


def test_server_unreachable_at_start_is_a_clear_error(world: World) -> None:
    with FaultProxy("127.0.0.1", 9) as proxy:  # port 9 (discard): nothing listens there
        proxy.set_mode("refuse")
        code, err = world.finish(world.run("--once", url=proxy.url_for("/api")))
    assert code == exitcodes.UNREACHABLE
    assert "server unreachable" in err and "Traceback" not in err


def test_sigterm_stops_the_child_and_reports_failed_promptly(world: World) -> None:
    world.define(response_timeout=30, retry_count=1)
    wf = world.start_workflow(seconds=60)
    proc = world.run()
    (pid,) = wait_until(world.child_pids, what="the child to start")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc, timeout=30)
    assert code == exitcodes.SIGTERM, err
    assert gone(pid)
    first = world.admin.get_workflow(wf)["tasks"][0]
    assert first["status"] == "FAILED" and first["reasonForIncompletion"] == "worker shutting down"


def test_drain_lets_the_task_finish_while_heartbeating(world: World) -> None:
    world.define(response_timeout=2)
    wf = world.start_workflow(seconds=4)
    proc = world.run("--drain", "--drain-timeout", "60")
    wait_until(world.child_pids, what="the child to start")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc, timeout=60)
    assert code == exitcodes.SIGTERM, err
    assert world.workflow_status(wf) == "COMPLETED"  # outlived R=2 while draining


def test_a_terminated_workflow_kills_its_child(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow(seconds=60)
    proc = world.run()
    (pid,) = wait_until(world.child_pids, what="the child to start")
    world.admin.terminate_workflow(wf, "changed my mind")
    wait_until(lambda: gone(pid), timeout_seconds=20, what="the child to be killed")
    assert proc.poll() is None  # the runner itself keeps serving
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def test_a_silent_server_means_the_tree_is_dead_by_the_lease_deadline(world: World) -> None:
    world.define(response_timeout=3)
    wf = world.start_workflow(seconds=120)
    with world.proxy() as proxy:
        proc = world.run("--kill-grace", "1", url=proxy.url_for("/api"))
        (pid,) = wait_until(world.child_pids, what="the child to start")
        silenced_at = time.monotonic()
        proxy.set_mode("blackhole")
        wait_until(lambda: gone(pid), timeout_seconds=30, what="the child to be fenced")
        # R (3 s) from the last acknowledged heartbeat, at most, plus the 1 s grace and slack.
        assert time.monotonic() - silenced_at < 3 + 1 + 4
        proxy.set_mode("pass")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err
    assert "lease" in err.lower()
    del wf


def test_concurrent_tasks_overlap(world: World) -> None:
    world.define(response_timeout=10)
    wfs = [world.start_workflow(seconds=2) for _ in range(3)]
    code, err = world.finish(world.run("--concurrency", "3", "--max-tasks", "3"))
    assert code == exitcodes.OK, err
    tasks = [world.task_of(wf) for wf in wfs]
    assert all(t["status"] == "COMPLETED" for t in tasks)
    span_ms = max(t["endTime"] for t in tasks) - min(t["startTime"] for t in tasks)
    assert span_ms < 5000  # one after the other would take over 6 s


def test_an_undelivered_result_is_delivered_on_the_next_start(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow()
    with world.proxy() as proxy:
        code, err = world.strand_result(proxy)
        assert code == exitcodes.SIGTERM, err
        assert list((world.state_dir / "outbox").glob("*.json"))
        assert world.workflow_status(wf) == "RUNNING"
        proxy.set_mode("pass")
        code, err = world.finish(world.run("--once", "--once-wait", "1", url=proxy.url_for("/api")))
    assert code == exitcodes.NO_TASK, err
    assert "delivered the saved result of task" in err
    assert world.workflow_status(wf) == "COMPLETED"
    assert not list((world.state_dir / "outbox").glob("*.json"))


def test_a_saved_result_is_delivered_while_the_runner_serves_once_the_server_answers(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    # Before, only the next start delivered it: a runner that stays up kept it until the server had
    # retried the task (after R), and the finished work was done again.
    world.define(response_timeout=30)
    wf = world.start_workflow()
    with world.proxy() as proxy:
        code, err = world.strand_result(proxy)  # the proxy now cuts every connection
        assert code == exitcodes.SIGTERM, err
        url = proxy.url_for("/api")
        outbox = Outbox(world.state_dir / "outbox", server=url)
        assert outbox.any_saved()
        # The outbox's lines, even if a CLI run earlier in this process stopped their propagation.
        outbox_logger = logging.getLogger("conductor_run.outbox")
        outbox_logger.addHandler(caplog.handler)
        level = outbox_logger.level
        outbox_logger.setLevel(logging.DEBUG)
        with ConductorClient(url, timeout_seconds=5) as client, contextlib.ExitStack() as undo:
            undo.callback(outbox_logger.removeHandler, caplog.handler)
            undo.callback(outbox_logger.setLevel, level)
            redelivery = Redelivery(outbox, client, interval_seconds=0.05)
            redelivery.start()
            try:
                tried = proxy.accepted
                wait_until(lambda: proxy.accepted >= tried + 3, what="delivery attempts while cut off")
                assert outbox.any_saved() and world.workflow_status(wf) == "RUNNING"
                proxy.set_mode("pass")
                wait_until(lambda: world.workflow_status(wf) == "COMPLETED", what="the result delivered")
                wait_until(lambda: not outbox.any_saved(), what="the outbox emptied")
            finally:
                redelivery.stop()
    # Quiet while the server was away (a look every few seconds), one line once it was delivered.
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "could not deliver" in r.getMessage()]
    assert not warned
    assert any("delivered the saved result of task" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- the runner's loose ends

KEY, SECRET = AUTH_KEY, AUTH_SECRET
WRITE_ENV_NAMES = (
    "import json, os\n"
    "with open(os.environ['CONDUCTOR_OUTPUT_FILE'], 'w') as f:\n"
    "    json.dump({'names': sorted(os.environ)}, f)\n"
)


def test_secrets_and_credentials_never_reach_the_child(auth_world: World) -> None:
    world = auth_world
    world.define(response_timeout=30)
    wf = world.start_workflow()
    config = world.tmp / "conductor.toml"
    config.write_text('[worker]\nsecrets = ["MY_TOKEN"]\n')
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET, "MY_TOKEN": "tok-123456",
           "PLAIN_VAR": "visible"}
    proc = world.run(
        "--config", str(config), "--once", command=[sys.executable, "-c", WRITE_ENV_NAMES], env=env
    )
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    names = world.task_of(wf)["outputData"]["names"]
    assert "PLAIN_VAR" in names  # the environment does reach the child...
    assert not {"MY_TOKEN", "CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET"} & set(names)  # ...minus these
    assert SECRET not in err and "tok-123456" not in err


def test_refused_credentials_at_start_are_exit_4_naming_the_variable(auth_world: World) -> None:
    wrong = "wrong-secret-never-printed"
    proc = auth_world.run(
        "--once", command=["/bin/true"], env={"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": wrong}
    )
    code, err = auth_world.finish(proc)
    assert code == exitcodes.UNREACHABLE, err
    assert "refused our credentials" in err and "CONDUCTOR_AUTH_KEY" in err
    assert wrong not in err and "Traceback" not in err


@pytest.mark.parametrize("mode", [["--once", "--once-wait", "2"], ["--max-tasks", "3"], []])
def test_missing_credentials_at_start_are_exit_4_not_an_idle_queue(
    auth_world: World, mode: list[str]
) -> None:
    """No credentials: /health needs none, but the first poll gets 401. A cron job that lost its
    credentials must not look like an idle one (exit 6) nor serve on for ever: exit 4, one line."""
    proc = auth_world.run(*mode, command=["/bin/true"])
    code, err = auth_world.finish(proc)
    assert code == exitcodes.UNREACHABLE, err
    assert "wants credentials" in err and "CONDUCTOR_AUTH_KEY" in err, err
    assert err.count("CONDUCTOR_AUTH_KEY") == 1, err  # one hint, not the client's and the poller's both
    assert "Traceback" not in err and "no task" not in err


def test_wrong_credentials_are_exit_4_with_once(auth_world: World) -> None:
    proc = auth_world.run("--once", "--once-wait", "2", command=["/bin/true"],
                          env={"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": "wrong-0b1e"})
    code, err = auth_world.finish(proc)
    assert code == exitcodes.UNREACHABLE, err
    assert "refused our credentials" in err and "wrong-0b1e" not in err


def test_credentials_refused_mid_run_are_retried_then_logged_once_per_outage(auth_world: World) -> None:
    """After a good start, every token is expired (refreshed transparently, no log line), then the
    secret stops working: the poll's one refresh-and-retry fails, the refusal is logged once while
    polls back off, and once the secret works again the recovery is logged and tasks run."""
    world = auth_world
    world.define(response_timeout=30)
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET}
    proc = world.run("--max-tasks", "2", command=["/bin/true"], env=env)
    first = world.start_workflow()
    wait_until(lambda: world.task_of(first).get("status") == "COMPLETED", 30, what="the first task")
    api = world.server.api  # type: ignore[attr-defined]
    api.expire_tokens()
    api._auth_secret = "rotated-secret"  # the runner's secret no longer gets a token
    wait_until(lambda: "refused our credentials" in world.stderr(proc), 30, what="the refusal logged")
    time.sleep(0.2)  # a polling interval of the backoff: later refusals must not be logged again
    api._auth_secret = SECRET
    second = world.start_workflow()
    code, err = world.finish(proc)
    assert code == exitcodes.OK, err
    assert world.task_of(second)["status"] == "COMPLETED"
    assert err.count("refused our credentials") == 1, err
    assert "accepts our credentials again" in err
    assert SECRET not in err


def test_an_exec_timeout_fails_the_task_with_its_reason_and_kills_the_tree(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow(seconds=60)
    proc = world.run("--once", "--exec-timeout", "1", "--kill-grace", "1")
    (pid,) = wait_until(world.child_pids, what="the child to start")
    tree = [pid]
    with contextlib.suppress(psutil.NoSuchProcess):
        tree += [p.pid for p in psutil.Process(pid).children(recursive=True)]
    code, err = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, err
    task = world.task_of(wf)
    assert task["status"] == "FAILED" and task["reasonForIncompletion"] == "exec timeout after 1s"
    assert all(gone(p) for p in tree)


def test_a_signal_during_setup_ends_the_run_cleanly_and_keeps_saved_results(world: World) -> None:
    with world.proxy() as proxy:
        url = proxy.url_for("/api")
        outbox = Outbox(world.state_dir / "outbox", server=url)
        for i in range(6):  # results of tasks the server does not know: each is dropped on a 404
            outbox.save(TaskResult(f"unknown-{i}", "wf", TaskStatus.COMPLETED))
        world.state_dir.chmod(0o700)  # the runner wants its state directory private
        proxy.set_mode("latency", latency_seconds=0.7)  # each call at start takes over a second
        proc = world.run("--once", url=url)
        wait_until(lambda: "dropping the saved result" in world.stderr(proc), what="the first delivery")
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc, timeout=30)
    assert code == exitcodes.SIGTERM, err  # not a raw -15: the handlers were installed
    assert "serving" not in err  # stopped before polling
    assert len(list((world.state_dir / "outbox").glob("*.json"))) >= 3  # the rest kept for next time


def test_a_stuck_long_poll_does_not_delay_the_exit_past_its_timeout(world: World) -> None:
    with world.proxy() as proxy:
        proc = world.run("--poll-timeout", "5000", url=proxy.url_for("/api"))
        wait_until(lambda: "serving" in world.stderr(proc), what="the runner to poll")
        proxy.set_mode("blackhole")  # the poll in flight (or the next one) never gets an answer
        stop_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code, err = world.finish(proc, timeout=30)
        elapsed = time.monotonic() - stop_at
    assert code == exitcodes.SIGTERM, err
    # The poll timeout (5 s) + 0.5 s, not the poll's HTTP timeout (5 s + 10 s); margin for load.
    assert elapsed < 5 + 0.5 + 3.5, err


def test_sigterm_latency_is_within_kill_grace_plus_the_poll_timeout(world: World) -> None:
    world.define(response_timeout=30)
    wf = world.start_workflow()
    proc = world.run("--poll-timeout", "5000", "--kill-grace", "2", "--concurrency", "2",
                     command=["/bin/sh", TERM_IGNORER])
    (pid,) = wait_until(world.child_pids, what="the child to start")
    wait_until(lambda: "ignoring TERM" in json.dumps(world.admin.get_logs(world.task_of(wf)["taskId"])),
               what="the child to ignore TERM")
    stop_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc, timeout=30)
    assert code == exitcodes.SIGTERM, err
    assert time.monotonic() - stop_at < 2 + 5 + 3  # kill grace + poll timeout + margin for load
    assert gone(pid)
    assert world.task_of(wf)["reasonForIncompletion"] == "worker shutting down"


def test_a_command_whose_exec_fails_is_failed_with_a_clear_reason(world: World, tmp_path: Path) -> None:
    script = tmp_path / "no-shebang"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    world.define(response_timeout=10)
    wf = world.start_workflow()
    code, err = world.finish(world.run("--once", command=[str(script)]), timeout=60)
    assert code == exitcodes.TASK_FAILED, err
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    assert task["reasonForIncompletion"].startswith("could not start the command: cannot start"), task
    assert "#!" in task["reasonForIncompletion"]
