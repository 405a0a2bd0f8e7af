"""End to end, ``conductor-run worker stdio``: conductor-cli's own command lines and profile files,
run by the real ``conductor-run`` process against the embedded server, with a conductor-cli script
(``sample_tasks/cli_stdio_worker.py``). HOME points at a temporary directory holding
``.conductor-cli/config-<profile>.yaml``, as ``conductor config save --profile`` writes it.

What is checked here: the command line and the profile are honoured (the server, the credentials,
the flags after the command's words); the shutdown habit (a first signal lets the running task
finish and exits 0; a second ends the tree and exits 130); what the child is told about the server,
with and without ``--pass-credentials``; the result size on both sides of the 3 MiB limit; one task
log entry per ``logs`` item.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from cli import exitcodes
from tests.integration.helpers import AUTH_KEY, AUTH_SECRET, ROOT, World, all_gone, tree_of
from tests.support import wait_until

WORKER = [sys.executable, str(ROOT / "sample_tasks" / "cli_stdio_worker.py")]
INPUTS = ("mode", "name", "seconds", "lookFor", "size", "count")
MIB = 1024 * 1024
CREDENTIAL_NAMES = {"CONDUCTOR_AUTH_KEY", "CONDUCTOR_AUTH_SECRET", "CONDUCTOR_AUTH_TOKEN",
                    "CONDUCTOR_ACCESS_KEY_ID", "CONDUCTOR_ACCESS_KEY_SECRET"}  # fmt: skip


def define(world: World, *, response_timeout: int = 30, retry_count: int = 0) -> None:
    world.define(response_timeout=response_timeout, retry_count=retry_count, inputs=INPUTS)


def save_profile(world: World, name: str | None, **settings: str) -> Path:
    """``~/.conductor-cli/config[-name].yaml`` under the test's HOME, as conductor-cli writes it."""
    directory = world.tmp / "home" / ".conductor-cli"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ("config.yaml" if name is None else f"config-{name}.yaml")
    path.write_text("".join(f"{key}: {value}\n" for key, value in settings.items()))
    path.chmod(0o600)
    return path


class Worker:
    """One ``conductor-run worker stdio ...`` process: stdout and stderr kept in files."""

    def __init__(self, world: World, args: list[str], env: dict[str, str] | None = None) -> None:
        base = {k: v for k, v in os.environ.items() if not k.upper().startswith("CONDUCTOR")}
        base["HOME"] = str(world.tmp / "home")
        (world.tmp / "home").mkdir(exist_ok=True)
        n = len(world.procs)
        self.out_path, self.err_path = world.tmp / f"worker-{n}.out", world.tmp / f"worker-{n}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "worker", "stdio", *args], cwd=world.tmp,
                env=base | {"CONDUCTOR_RUN_STATE_DIR": str(world.state_dir)} | (env or {}),
                stdout=out, stderr=err, text=True,
            )  # fmt: skip
        world.procs.append(self.proc)

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


def done(world: World, workflow_id: str) -> bool:
    return world.task_of(workflow_id).get("status") in ("COMPLETED", "FAILED", "FAILED_WITH_TERMINAL_ERROR")


def test_a_conductor_cli_command_line_and_profile_work_unchanged(world: World) -> None:
    define(world)
    # conductor-cli saves the URL as typed; /api is appended by both.
    save_profile(world, "staging", server=world.server.url.removesuffix("/api"), **{"server-type": "OSS"})
    wf = world.start_workflow(mode="complete", name="Ada")
    # Word for word a conductor-cli line, flags after the command's words included (cobra reads them).
    worker = Worker(
        world,
        [
            "--type",
            world.task_type,
            "--profile",
            "staging",
            *WORKER,
            "--count",
            "2",
            "--exec-timeout",
            "300",
            "--worker-id",
            "w-cli",
            "--poll-timeout",
            "200",
            "-v",
        ],
    )
    wait_until(lambda: done(world, wf), timeout_seconds=60, what="the task to finish")
    assert worker.stop() == exitcodes.OK, worker.stderr  # a first signal, nothing running: exit 0
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED", (task, worker.stderr)
    assert task["workerId"] == "w-cli"
    out = task["outputData"]
    assert out["greeting"] == "hello Ada"
    assert out["serverUrl"] == world.server.url  # the URL came from the profile, and the child has it
    assert not CREDENTIAL_NAMES & set(out["envNames"])
    assert "=== Task Input ===" in worker.stdout and "=== Task Result ===" in worker.stdout  # --verbose
    assert '"greeting": "hello Ada"' in worker.stdout
    assert "config-staging.yaml" in worker.stderr  # it says which file it read
    assert "Traceback" not in worker.stderr


def test_the_first_signal_lets_the_task_finish_and_exits_0(world: World) -> None:
    define(world, response_timeout=2)  # the task outlives R: only heartbeats keep it
    wf = world.start_workflow(mode="sleep", seconds=4)
    worker = Worker(world, ["--type", world.task_type, "--server", world.server.url, *WORKER])
    wait_until(world.child_pids, timeout_seconds=30, what="the child to start")
    worker.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "letting 1 task(s) finish" in worker.stderr, what="the drain to begin")
    assert worker.proc.wait(timeout=60) == exitcodes.OK, worker.stderr
    task = world.task_of(wf)
    assert task["status"] == "COMPLETED", (task, worker.stderr)
    assert task["outputData"] == {"slept": 4} and task["retryCount"] == 0  # no retry was spent
    assert world.workflow_status(wf) == "COMPLETED"


def test_a_second_signal_ends_the_tree_reports_it_and_exits_130(world: World) -> None:
    define(world)
    wf = world.start_workflow(mode="sleep", seconds=120)
    worker = Worker(world, ["--type", world.task_type, "--server", world.server.url, *WORKER])
    (pid,) = wait_until(world.child_pids, timeout_seconds=30, what="the child to start")
    wait_until(lambda: len(tree_of(pid)) >= 2, what="the script's own child (a grandchild)")
    tree = tree_of(pid)
    worker.proc.send_signal(signal.SIGINT)
    wait_until(lambda: "letting 1 task(s) finish" in worker.stderr, what="the drain to begin")
    assert not all_gone(tree)  # draining: the task still runs
    assert worker.stop(signal.SIGINT) == exitcodes.FORCED == 130, worker.stderr
    assert all_gone(tree), "the task's tree outlived the runner"
    task = world.task_of(wf)
    assert task["status"] == "FAILED", task  # reported, so the server retries it now rather than after R
    assert "shutting down" in (task.get("reasonForIncompletion") or ""), task


def test_credentials_from_a_profile_reach_the_child_only_with_pass_credentials(auth_world: World) -> None:
    world = auth_world
    define(world)
    save_profile(world, "prod", server=world.server.url, **{"auth-key": AUTH_KEY, "auth-secret": AUTH_SECRET})
    seen: dict[bool, dict[str, Any]] = {}
    for passing in (False, True):
        wf = world.start_workflow(mode="complete", lookFor=[AUTH_KEY, AUTH_SECRET])
        extra = ["--pass-credentials"] if passing else []
        # The profile's credentials are what the runner polls with (the server refuses anonymous polls).
        worker = Worker(
            world, ["--type", world.task_type, *extra, *WORKER], env={"CONDUCTOR_PROFILE": "prod"}
        )
        wait_until(lambda: done(world, wf), timeout_seconds=60, what="the task to finish")  # noqa: B023
        assert worker.stop() == exitcodes.OK, worker.stderr
        seen[passing] = world.task_of(wf)["outputData"]
        assert ("every child gets this runner's Conductor credentials" in worker.stderr) is passing
        assert AUTH_SECRET not in worker.stderr
    assert seen[False]["serverUrl"] == seen[True]["serverUrl"] == world.server.url
    assert seen[False]["secretsSeen"] == [] and not CREDENTIAL_NAMES & set(seen[False]["envNames"])
    assert set(seen[True]["secretsSeen"]) == {
        "CONDUCTOR_AUTH_KEY",
        "CONDUCTOR_AUTH_SECRET",
        "CONDUCTOR_ACCESS_KEY_ID",
        "CONDUCTOR_ACCESS_KEY_SECRET",
    }


def test_results_up_to_3_mib_complete_and_past_it_fail_saying_the_size(world: World) -> None:
    define(world)
    fits = world.start_workflow(mode="big", size=int(1.5 * MIB))  # conductor-cli completed this one
    near = world.start_workflow(mode="big", size=3 * MIB - 100)
    over = world.start_workflow(mode="big", size=3 * MIB + 100)
    worker = Worker(world, ["--type", world.task_type, "--server", world.server.url, "--count", "3", *WORKER])
    wait_until(
        lambda: all(done(world, wf) for wf in (fits, near, over)), timeout_seconds=90, what="three results"
    )
    assert worker.stop() == exitcodes.OK, worker.stderr
    for wf, size in ((fits, int(1.5 * MIB)), (near, 3 * MIB - 100)):
        task = world.task_of(wf)
        assert task["status"] == "COMPLETED", task.get("reasonForIncompletion")
        assert len(task["outputData"]["blob"]) == size
    task = world.task_of(over)
    assert task["status"] == "FAILED"
    printed = len(json.dumps({"status": "COMPLETED", "output": {"blob": "x" * (3 * MIB + 100)}})) + 1
    assert task["reasonForIncompletion"].startswith(
        f"worker stdout is too large: {printed} bytes, over the 3145728-byte (3 MiB) limit"
    )


def test_each_logs_item_is_one_entry_of_the_task_log(world: World) -> None:
    define(world)
    wf = world.start_workflow(mode="logs", count=3)
    worker = Worker(world, ["--type", world.task_type, "--server", world.server.url, *WORKER])
    wait_until(lambda: done(world, wf), timeout_seconds=60, what="the task to finish")
    wanted = [f"item {n}: line a\nline b" for n in range(3)]

    def entries() -> list[str]:
        return [str(entry.get("log")) for entry in world.admin.get_logs(world.task_of(wf)["taskId"])]

    wait_until(lambda: all(item in entries() for item in wanted), what="three entries")
    assert worker.stop() == exitcodes.OK
    assert [entry for entry in entries() if entry.startswith("item ")] == wanted


def test_credential_flags_leave_the_runners_command_line_and_still_authenticate(auth_world: World) -> None:
    """``--auth-secret`` on conductor-cli's command line would sit in /proc/<pid>/cmdline, which every
    process of the host (the task's included) can read: the runner re-executes itself without it."""
    world = auth_world
    define(world)
    world.start_workflow(mode="sleep", seconds=60)
    worker = Worker(world, ["--type", world.task_type, "--server", world.server.url, "--auth-key", AUTH_KEY,
                            f"--auth-secret={AUTH_SECRET}", *WORKER])  # fmt: skip
    wait_until(world.child_pids, timeout_seconds=30, what="the child to start (the flags' credentials work)")
    cmdline = Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes().decode()
    environ = Path(f"/proc/{worker.proc.pid}/environ").read_bytes().decode()
    assert AUTH_SECRET not in cmdline and AUTH_KEY not in cmdline and AUTH_SECRET not in environ
    assert "--type" in cmdline and world.task_type in cmdline  # the rest of the line is kept
    assert "--auth-secret was on the command line" in worker.stderr
    worker.proc.send_signal(signal.SIGTERM)  # the task would run 60 s: drain, then force
    wait_until(lambda: "letting 1 task(s) finish" in worker.stderr, what="the drain to begin")
    assert worker.stop() == exitcodes.FORCED, worker.stderr


def test_run_too_hands_the_child_its_server_url_and_no_credential(auth_world: World) -> None:
    """The native protocol under ``run``: CONDUCTOR_SERVER_URL is the runner's (from --server), the
    credentials of the runner's environment stay out, and --pass-credentials brings them in. The
    child reports a digest of each value (what it really got) and the value itself, which the runner
    masks in the output like every credential it knows (docs/secrets.md)."""
    world = auth_world
    world.define(response_timeout=30)
    write_env = ("import hashlib, json, os; names = ('CONDUCTOR_SERVER_URL', 'CONDUCTOR_AUTH_KEY', "
                 "'CONDUCTOR_AUTH_SECRET', 'CONDUCTOR_ACCESS_KEY_ID', 'CONDUCTOR_ACCESS_KEY_SECRET'); "
                 "got = {n: os.environ[n] for n in names if n in os.environ}; "
                 "got.update({'sha256 ' + n: hashlib.sha256(v.encode()).hexdigest() "
                 "for n, v in got.items()}); "
                 "open(os.environ['CONDUCTOR_OUTPUT_FILE'], 'w').write(json.dumps(got))")  # fmt: skip
    credentials = {"CONDUCTOR_AUTH_KEY": AUTH_KEY, "CONDUCTOR_AUTH_SECRET": AUTH_SECRET}
    seen, digests = {}, {}
    for extra in ([], ["--pass-credentials"]):
        wf = world.start_workflow()
        proc = world.run("--once", *extra, command=[sys.executable, "-c", write_env], env=credentials)
        code, log = world.finish(proc)
        assert code == exitcodes.OK, log
        output = world.task_of(wf)["outputData"]
        seen[bool(extra)] = {name: output[name] for name in output if name.startswith("CONDUCTOR_")}
        digests[bool(extra)] = {name[7:]: output[name] for name in output if name.startswith("sha256 ")}
    assert seen[False] == {"CONDUCTOR_SERVER_URL": world.server.url}
    handed = {**credentials, "CONDUCTOR_ACCESS_KEY_ID": AUTH_KEY, "CONDUCTOR_ACCESS_KEY_SECRET": AUTH_SECRET}
    assert digests[True] == {name: hashlib.sha256(value.encode()).hexdigest()
                             for name, value in {"CONDUCTOR_SERVER_URL": world.server.url, **handed}.items()}
    # What the child printed of them is masked on its way to the server.
    assert seen[True] == {"CONDUCTOR_SERVER_URL": world.server.url, **dict.fromkeys(handed, "***")}
