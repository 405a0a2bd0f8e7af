"""End to end, secrets the Conductor way (docs/secrets.md; DESIGN.md §3) on the embedded server: the
task definition declares ``runtimeMetadata`` names, the server resolves them at the poll from its own
``CONDUCTOR_SECRET_<NAME>`` / ``CONDUCTOR_ENV_<NAME>`` environment, the child gets each value as a
variable and in ``CONDUCTOR_SECRETS_FILE``, and no value reaches anything the runner writes: the
task log, the output and its tails, the reason, the status files, the runner's own log. A declared
name the server cannot resolve fails the task terminally without running the command.

What the child saw is read from the file it writes (its own record), not from the runner's log."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from cli import exitcodes
from tests.integration.helpers import AUTH_KEY, AUTH_SECRET, World
from tests.support import wait_until

SECRET = "pa55-e2e-" + os.urandom(6).hex()  # the value the server resolves for CR_API_TOKEN
ENV_VALUE = "region-e2e-" + os.urandom(4).hex()  # ... and for CR_REGION (an environment value)

# The child: records what it got, then prints the secret in every way the runner must mask it.
CHILD = r"""
import json, os, stat, sys, time
record, gate = sys.argv[1], sys.argv[2]
path = os.environ.get("CONDUCTOR_SECRETS_FILE")
info = os.stat(path) if path else None
with open(record, "w") as f:
    json.dump({"token": os.environ.get("CR_API_TOKEN"), "region": os.environ.get("CR_REGION"),
               "path": path, "file": json.load(open(path)) if path else None,
               "mode": stat.S_IMODE(info.st_mode) if info else None,
               "owner": info.st_uid if info else None}, f)
token = os.environ["CR_API_TOKEN"]
print("the token is " + token + " in a longer line", flush=True)
half = len(token) // 2
sys.stdout.write("split: " + token[:half]); sys.stdout.flush()   # two writes: two pipe reads
time.sleep(0.3)
sys.stdout.write(token[half:] + " end\n"); sys.stdout.flush()
while gate != "-" and not os.path.exists(gate):
    time.sleep(0.02)
json.dump({"echo": token, token: "as a key", "nested": [{"deep": "x" + token + "y"}]},
          open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w"))
print("failing with " + token, file=sys.stderr, flush=True)
sys.exit(3)
"""


def child(world: World, gate: str = "-") -> list[str]:
    return [sys.executable, "-c", CHILD, str(world.tmp / "record.json"), gate]


def define_with_metadata(world: World, names: list[str]) -> None:
    world.server.store.runtime_environ = {  # type: ignore[attr-defined]
        "CONDUCTOR_SECRET_CR_API_TOKEN": SECRET, "CONDUCTOR_ENV_CR_REGION": ENV_VALUE,
    }  # fmt: skip
    world.define(response_timeout=30, runtimeMetadata=names)


def files_under(path: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in path.rglob("*") if p.is_file())


def logs_of(world: World, task_id: str) -> list[str]:
    return [str(entry.get("log")) for entry in world.admin.get_logs(task_id)]


def test_the_child_gets_each_value_and_nothing_the_runner_writes_shows_one(world: World) -> None:
    define_with_metadata(world, ["CR_API_TOKEN", "CR_REGION"])
    wf = world.start_workflow()
    gate = world.tmp / "gate"
    proc = world.run("--once", "--terminal-exit-code", "9", command=child(world, str(gate)))
    record_path = world.tmp / "record.json"
    wait_until(record_path.exists, what="the child's record")
    # While it runs: its status snapshot shows the masked lines, never the value.
    wait_until(lambda: "split: ***" in files_under(world.state_dir), what="the masked lines in status")
    assert SECRET not in files_under(world.state_dir)
    gate.touch()
    code, log = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, log
    record: dict[str, Any] = json.loads(record_path.read_text())
    assert record["token"] == SECRET and record["region"] == ENV_VALUE
    assert record["file"] == {"CR_API_TOKEN": SECRET, "CR_REGION": ENV_VALUE}
    assert record["mode"] == 0o600 and record["owner"] == os.getuid()
    assert not os.path.exists(record["path"])  # removed with the task's files

    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    whole = json.dumps(task)
    assert SECRET not in whole and ENV_VALUE not in whole
    out = task["outputData"]
    assert out["echo"] == "***" and out["***"] == "as a key" and out["nested"] == [{"deep": "x***y"}]
    assert "the token is *** in a longer line" in out["stdoutTail"]
    assert "split: *** end" in out["stdoutTail"]  # a value split across two reads
    assert task["reasonForIncompletion"] == "exit code 3: failing with ***"
    lines = wait_until(lambda: (got := logs_of(world, task["taskId"])) and
                       any("failing with" in line for line in got) and got, what="the task log")  # fmt: skip
    text = "\n".join(lines)
    assert "the token is *** in a longer line" in text and SECRET not in text
    assert SECRET not in log and ENV_VALUE not in log  # the runner's own log
    assert SECRET not in files_under(world.state_dir)


def test_a_declared_name_the_server_cannot_resolve_fails_terminally_without_running(world: World) -> None:
    define_with_metadata(world, ["CR_API_TOKEN", "CR_NOT_ON_THE_SERVER"])
    wf = world.start_workflow()
    code, log = world.finish(world.run("--once", command=child(world)))
    assert code == exitcodes.TASK_FAILED, log
    assert not (world.tmp / "record.json").exists()  # the command never ran
    task = world.task_of(wf)
    assert task["status"] == "FAILED_WITH_TERMINAL_ERROR"
    reason = task["reasonForIncompletion"]
    assert "CR_NOT_ON_THE_SERVER" in reason and "declared by the task definition" in reason
    assert "CR_API_TOKEN" not in reason and SECRET not in json.dumps(task)
    assert world.workflow_status(wf) == "FAILED"  # terminal: no retry, though the def allows none anyway


def test_a_name_the_worker_requires_and_the_server_lacks_fails_the_same_way(world: World) -> None:
    define_with_metadata(world, ["CR_API_TOKEN"])
    (world.tmp / "conductor.toml").write_text('[worker]\nrequired_secrets = ["CR_DB_PASSWORD"]\n')
    wf = world.start_workflow()
    code, log = world.finish(world.run("--once", command=child(world)))
    assert code == exitcodes.TASK_FAILED, log
    assert not (world.tmp / "record.json").exists()
    task = world.task_of(wf)
    assert task["status"] == "FAILED_WITH_TERMINAL_ERROR"
    assert "CR_DB_PASSWORD" in task["reasonForIncompletion"]
    assert "required_secrets" in task["reasonForIncompletion"]


STDIO_CHILD = r"""
import json, os, sys
task = json.load(sys.stdin)
token = os.environ["CR_API_TOKEN"]
secrets_file = json.load(open(os.environ["CONDUCTOR_SECRETS_FILE"]))
print("stderr " + token, file=sys.stderr)
print(json.dumps({"status": "FAILED", "reason": "bad " + token,
                  "output": {"seen": token, "fromFile": secrets_file["CR_API_TOKEN"] == token,
                             "inTask": task["runtimeMetadata"]["CR_API_TOKEN"] == token},
                  "logs": ["log " + token]}))
"""


def test_the_stdio_protocol_gets_the_same_variables_and_masking(world: World) -> None:
    define_with_metadata(world, ["CR_API_TOKEN"])
    wf = world.start_workflow()
    proc = world.run("--once", "--protocol", "stdio", command=[sys.executable, "-c", STDIO_CHILD])
    code, log = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert task["status"] == "FAILED" and task["reasonForIncompletion"] == "bad ***"
    out = task["outputData"]
    assert out["seen"] == "***" and out["fromFile"] is True and out["inTask"] is True
    lines = wait_until(lambda: (got := logs_of(world, task["taskId"])) and
                       any("log" in line for line in got) and got, what="the task log")  # fmt: skip
    assert SECRET not in "\n".join(lines) and "log ***" in "\n".join(lines)
    assert SECRET not in json.dumps(task) and SECRET not in log


def test_a_result_saved_to_the_outbox_holds_no_secret(world: World) -> None:
    """The final update cannot get through (a blackholed proxy) and a second SIGTERM stops its
    retries: the result stays on disk, in the outbox, masked as it would have been sent."""
    define_with_metadata(world, ["CR_API_TOKEN"])
    world.start_workflow()
    gate = world.tmp / "gate"
    with world.proxy() as proxy:
        proc = world.run(url=proxy.url_for("/api"), command=child(world, str(gate)))
        wait_until((world.tmp / "record.json").exists, what="the child's record")
        proxy.set_mode("blackhole")
        gate.touch()
        wait_until(lambda: "reporting FAILED" in world.stderr(proc), what="the child to finish")
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "received SIGTERM" in world.stderr(proc), what="the first signal handled")
        proc.send_signal(signal.SIGTERM)  # stop retrying: the result is kept on disk
        _code, log = world.finish(proc)
        proxy.set_mode("reset")
    (outbox,) = world.state_dir.rglob("outbox")
    saved = files_under(outbox)
    assert '"reasonForIncompletion": "exit code 3: failing with ***"' in saved, log  # the result is there...
    assert SECRET not in saved and SECRET not in files_under(world.state_dir)  # ...masked


def test_the_runners_own_credential_is_masked_wherever_a_child_prints_it(auth_world: World) -> None:
    """The child never gets the runner's credentials nor the variables named in ``secrets``, but one
    that learns such a value some other way (here: on its command line) cannot show it either."""
    world = auth_world
    world.define(response_timeout=30)
    wf = world.start_workflow()
    script = "import sys; print('cred ' + sys.argv[1]); sys.exit(4)"
    env = {"CONDUCTOR_AUTH_KEY": AUTH_KEY, "CONDUCTOR_AUTH_SECRET": AUTH_SECRET}
    (world.tmp / "conductor.toml").write_text('[worker]\nsecrets = ["DB_PASSWORD"]\n')
    env["DB_PASSWORD"] = db_password = "db-" + os.urandom(6).hex()  # kept from the child: masked too
    command = [sys.executable, "-c", script, AUTH_SECRET + " " + db_password]
    proc = world.run("--once", command=command, env=env)
    code, log = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, log
    task = world.task_of(wf)
    assert "cred *** ***" in task["outputData"]["stdoutTail"]
    assert AUTH_SECRET not in json.dumps(task) and db_password not in json.dumps(task)
    assert AUTH_SECRET not in log and db_password not in log
