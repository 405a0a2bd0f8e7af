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
