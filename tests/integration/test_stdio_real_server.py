"""``--protocol stdio`` against the REAL Conductor OSS server: conductor-cli's contract end to end
(the whole task on stdin, the stdout document's output, reason and logs on the server), and a long
stdio task kept IN_PROGRESS past its response timeout by the heartbeats (a forced decide proves it)."""

from __future__ import annotations

import signal
import time

import pytest

from cli import exitcodes
from tests.integration.realworld import DECIDE_EVERY_SECONDS, RealWorld, all_dead
from tests.integration.test_stdio_e2e import WORKER, define, logs_of
from tests.support import wait_until

pytestmark = pytest.mark.real_server


def test_a_conductor_cli_script_completes_with_its_output_and_logs(real_world: RealWorld) -> None:
    define(real_world)
    wf = real_world.start_workflow(mode="complete", name="Ada")
    code, log = real_world.finish(real_world.run("--protocol", "stdio", "--once", command=WORKER))
    assert code == exitcodes.OK, log
    task = real_world.task_of(wf)
    assert task["status"] == "COMPLETED"
    out = task["outputData"]
    assert out["greeting"] == "hello Ada" and out["taskIdFromStdin"] == task["taskId"]
    assert out["cliEnv"]["EXECUTION_ID"] == wf
    wanted = {"read the task from stdin", "greeted Ada"}
    wait_until(lambda: wanted <= set(logs_of(real_world, wf)), what="the document's logs on the server")


def test_a_failed_document_keeps_its_reason_on_the_real_server(real_world: RealWorld) -> None:
    define(real_world)
    wf = real_world.start_workflow(mode="fail")
    code, log = real_world.finish(real_world.run("--protocol", "stdio", "--once", command=WORKER))
    assert code == exitcodes.TASK_FAILED, log
    task = real_world.task_of(wf)
    assert task["status"] == "FAILED"
    assert task["reasonForIncompletion"] == "the input was not good enough"


def test_a_long_stdio_task_is_kept_past_r_and_its_tree_dies_at_the_stop(real_world: RealWorld) -> None:
    define(real_world, response_timeout=3)
    wf = real_world.start_workflow(mode="sleep", seconds=120)
    proc = real_world.run("--protocol", "stdio", "--kill-grace", "2", command=WORKER)
    task_id = real_world.task_id_of_running(wf)
    tree = real_world.tree(task_id, at_least=2)  # the script and its own child
    started = time.monotonic()
    statuses: list[str] = []

    def over_three_r_or_lost() -> bool:  # the server's timeout checks forced at each look
        statuses.append(real_world.decide_and_get_task(wf)["status"])
        return statuses[-1] != "IN_PROGRESS" or time.monotonic() - started > 10

    wait_until(over_three_r_or_lost, timeout_seconds=40, interval_seconds=DECIDE_EVERY_SECONDS,
               what="three response timeouts to pass")  # fmt: skip
    assert set(statuses) == {"IN_PROGRESS"} and len(statuses) > 5, statuses
    proc.send_signal(signal.SIGTERM)
    code, log = real_world.finish(proc)
    assert code == exitcodes.SIGTERM, log
    assert all_dead(tree)
    task = real_world.task_of(wf)
    assert task["status"] == "FAILED" and task["reasonForIncompletion"] == "worker shutting down"


def test_worker_stdio_with_a_profile_up_to_3_mib_and_one_log_entry_per_item(real_world: RealWorld) -> None:
    """conductor-cli's command line and profile on the real server: a result just under 3 MiB is kept
    inline (not moved to external storage), and each ``logs`` item is one entry of the task log."""
    from tests.integration.test_worker_stdio_e2e import Worker, save_profile
    from tests.integration.test_worker_stdio_e2e import define as define_inputs

    define_inputs(real_world)
    save_profile(real_world, "real", server=real_world.server.url)
    size = 3 * 1024 * 1024 - 200
    big = real_world.start_workflow(mode="big", size=size)
    logs = real_world.start_workflow(mode="logs", count=3)
    args = ["--type", real_world.task_type, "--profile", "real", "--count", "2", *WORKER]
    worker = Worker(real_world, args)

    def done() -> bool:
        return all(real_world.task_of(wf).get("status") in ("COMPLETED", "FAILED") for wf in (big, logs))

    wait_until(done, timeout_seconds=90, what="both tasks to finish")
    task = real_world.task_of(big)
    assert task["status"] == "COMPLETED", task.get("reasonForIncompletion")
    assert not task.get("externalOutputPayloadStoragePath"), "the server moved the output to external storage"
    assert len(task["outputData"]["blob"]) == size
    wanted = [f"item {n}: line a\nline b" for n in range(3)]

    def entries() -> list[str]:
        return [str(e.get("log")) for e in real_world.admin.get_logs(real_world.task_of(logs)["taskId"])]

    wait_until(lambda: all(item in entries() for item in wanted), what="three log entries")
    assert [entry for entry in entries() if entry.startswith("item ")] == wanted
    assert worker.stop() == exitcodes.OK, worker.stderr
