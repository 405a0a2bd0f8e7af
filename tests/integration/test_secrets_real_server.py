"""Secrets the Conductor way against the REAL Conductor OSS server (docs/secrets.md): the session's
server runs with ``CONDUCTOR_SECRET_CR_TEST_SECRET`` and ``CONDUCTOR_ENV_CR_TEST_ENV`` in its
environment (``tests/realserver.py``'s ``SESSION_SERVER_ENV``); a task definition declaring those
names gets them resolved into the polled task's ``runtimeMetadata``. The child sees the values (its
own record says so), while the task the server stores (output, tails, reason) and its execution log
do not hold them; a declared name the server cannot resolve fails the task terminally unrun."""

from __future__ import annotations

import json
import sys

import pytest

from cli import exitcodes
from tests.integration.realworld import RealWorld
from tests.integration.test_secrets_e2e import CHILD, logs_of
from tests.realserver import TEST_ENV_NAME, TEST_ENV_VALUE, TEST_SECRET_NAME, TEST_SECRET_VALUE
from tests.support import wait_until

pytestmark = pytest.mark.real_server

# The e2e child reads CR_API_TOKEN and CR_REGION: the same script, fed the session server's names.
REAL_CHILD = CHILD.replace("CR_API_TOKEN", TEST_SECRET_NAME).replace("CR_REGION", TEST_ENV_NAME)


def test_the_child_sees_the_servers_secret_and_the_server_stores_none(real_world: RealWorld) -> None:
    real_world.define(response_timeout=30, runtimeMetadata=[TEST_SECRET_NAME, TEST_ENV_NAME])
    wf = real_world.start_workflow()
    record = real_world.tmp / "record.json"
    command = [sys.executable, "-c", REAL_CHILD, str(record), "-"]
    code, log = real_world.finish(real_world.run("--once", command=command))
    assert code == exitcodes.TASK_FAILED, log
    seen = json.loads(record.read_text())
    assert seen["token"] == TEST_SECRET_VALUE and seen["region"] == TEST_ENV_VALUE
    assert seen["file"] == {TEST_SECRET_NAME: TEST_SECRET_VALUE, TEST_ENV_NAME: TEST_ENV_VALUE}
    assert seen["mode"] == 0o600

    task = real_world.task_of(wf)
    assert task["status"] == "FAILED"
    assert TEST_SECRET_VALUE not in json.dumps(task)
    assert task["reasonForIncompletion"] == "exit code 3: failing with ***"
    out = task["outputData"]
    assert out["echo"] == "***" and "the token is *** in a longer line" in out["stdoutTail"]
    assert "split: *** end" in out["stdoutTail"]
    lines = wait_until(lambda: (got := logs_of(real_world, task["taskId"])) and
                       any("failing with" in line for line in got) and got, what="the task log")  # fmt: skip
    assert TEST_SECRET_VALUE not in "\n".join(lines) and "the token is ***" in "\n".join(lines)
    assert TEST_SECRET_VALUE not in log
    # Nor the server's own log (it logged the task's update and log posts, if anything).
    server_log = real_world.server.log_path.read_text(errors="replace")  # type: ignore[attr-defined]
    assert TEST_SECRET_VALUE not in server_log


def test_a_declared_name_the_real_server_cannot_resolve_fails_terminally_unrun(real_world: RealWorld) -> None:
    real_world.define(response_timeout=30, retry_count=2,
                      runtimeMetadata=[TEST_SECRET_NAME, "CR_NOT_ON_THE_SERVER"])  # fmt: skip
    wf = real_world.start_workflow()
    record = real_world.tmp / "record.json"
    command = [sys.executable, "-c", REAL_CHILD, str(record), "-"]
    code, log = real_world.finish(real_world.run("--once", command=command))
    assert code == exitcodes.TASK_FAILED, log
    assert not record.exists()  # the command never ran
    task = real_world.task_of(wf)
    assert task["status"] == "FAILED_WITH_TERMINAL_ERROR"
    assert task["retryCount"] == 0
    assert "CR_NOT_ON_THE_SERVER" in task["reasonForIncompletion"]
    assert TEST_SECRET_VALUE not in json.dumps(task)
    # Terminal: no retry was scheduled though the definition allows two.
    assert real_world.workflow_status(wf) == "FAILED"
    assert len(real_world.admin.get_workflow(wf)["tasks"]) == 1

