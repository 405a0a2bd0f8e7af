"""End to end, the real ``conductor-run run`` on the embedded server: task trees in cgroups.

The issue's case: a task starts a daemon that leaves the session and wipes its environment
(``setsid env -i sh -c '... sleep N' &``), then the runner and its fork server are SIGKILLed together.
Without a group nothing names that daemon any more (no session, no group, no marker token, its
parents dead); with one, the next start's sweep kills it, and only then is the task reported with
"its process tree was killed". Also: a lease lost to the server (the workflow terminated) kills it;
``--memory-max`` makes a 300 MB allocation FAILED naming the limit; the result carries ``resources``.
Skipped, saying why, where this host gives the runner no cgroups (not root, nothing mounted).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import psutil
import pytest

from cli import exitcodes
from leasecore.limits import memory_reason
from leasecore.process.linux import cgroups
from tests.daemons import Daemon, own_daemon
from tests.integration.helpers import World, gone
from tests.support import wait_until

# $1: the gate (once it exists the task just succeeds); $2: the daemon's command line, the test's own.
COMMAND = ["/bin/sh", "-c", 'if [ -e "$1" ]; then exit 0; fi; setsid env -i sh -c "$2" & wait', "job"]
daemon_cmd = own_daemon(3323)  # each test's own daemon command line, killed after it


def _setup() -> cgroups.CgroupSetup:
    if os.geteuid() != 0:
        pytest.skip("cgroups need root (or a delegated subtree) here: not root")
    setup = cgroups.detect("auto")
    if not setup.active:
        pytest.skip(f"no cgroups here: {setup.describe()}")
    return setup


def test_a_wiped_daemon_dies_after_runner_and_fork_server_are_sigkilled(
    world: World, daemon_cmd: Daemon
) -> None:
    _setup()
    world.define(response_timeout=300, retry_count=1)
    wf = world.start_workflow()
    command = [*COMMAND, str(world.gate), daemon_cmd.shell]
    proc = world.run(command=command)
    (pid,) = wait_until(world.child_pids, what="the child to start")
    (daemon,) = wait_until(daemon_cmd.running, what="the daemon to start")
    forkserver = psutil.Process(pid).ppid()
    proc.send_signal(signal.SIGSTOP)  # both die before either can clean up
    os.kill(forkserver, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not gone(daemon.pid)  # its session, group and marker are gone: only its cgroup names it
    world.gate.touch()
    code, err = world.finish(world.run("--once", "--once-wait", "20", command=command))
    assert code == exitcodes.OK, err
    assert gone(daemon.pid)
    old, retry = world.admin.get_workflow(wf)["tasks"]
    assert old["status"] == "FAILED"
    assert old["reasonForIncompletion"].endswith("its process tree was killed")
    assert retry["status"] == "COMPLETED"
    assert "task trees: cgroup" in err  # the mechanism in force, said once at start


def test_a_wiped_daemon_dies_when_the_lease_is_lost(world: World, daemon_cmd: Daemon) -> None:
    _setup()
    world.define(response_timeout=300)
    wf = world.start_workflow()
    proc = world.run("--kill-grace", "0.5", command=[*COMMAND, str(world.gate), daemon_cmd.shell])
    wait_until(world.child_pids, what="the child to start")
    (daemon,) = wait_until(daemon_cmd.running, what="the daemon to start")
    # `status` sees the mechanism and the tree's memory now (its group's).
    (snapshot,) = world.state_dir.glob("runner-*.json")

    def with_memory() -> dict[str, Any] | None:
        doc = json.loads(snapshot.read_text())
        return doc if doc["tasks"] and doc["tasks"][0]["memory_bytes"] else None

    doc = wait_until(with_memory, what="a snapshot with the task's memory")
    assert doc["runner"]["cgroup"].startswith("cgroup v")
    assert doc["tasks"][0]["memory_bytes"] > 0
    world.admin.terminate_workflow(wf, "lease loss test")  # the task is no longer ours
    wait_until(lambda: gone(daemon.pid), timeout_seconds=20, what="the daemon to be killed")
    proc.send_signal(signal.SIGTERM)
    code, err = world.finish(proc)
    assert code == exitcodes.SIGTERM, err


def _failed_naming_the_limit(world: World, proc: Any, wf: str, setup: cgroups.CgroupSetup,
                             prefix: str = "") -> None:  # fmt: skip
    """The --memory-max 64M run ended FAILED naming the limit, with the tree's resources."""
    code, err = world.finish(proc)
    assert code == exitcodes.TASK_FAILED, err
    task = world.task_of(wf)
    assert task["status"] == "FAILED"
    resources = task["outputData"]["resources"]
    assert set(resources) == {"max_rss_bytes", "cpu_user_seconds", "cpu_system_seconds"}
    assert resources["max_rss_bytes"] > 0
    if "memory" in setup.limits:  # the group's OOM record names it
        assert task["reasonForIncompletion"] == prefix + memory_reason(64 * 1024 * 1024)
        assert resources["max_rss_bytes"] <= 65 * 1024 * 1024
    else:
        assert "memory limit 64 MiB, a per-process rlimit" in task["reasonForIncompletion"]


def test_memory_max_fails_a_300mb_task_naming_the_limit_and_resources_are_reported(world: World) -> None:
    setup = _setup()
    world.define(response_timeout=30)
    wf = world.start_workflow()
    code_text = "a = bytearray(300 * 1024 * 1024); print(len(a))"
    proc = world.run("--once", "--memory-max", "64M", command=[sys.executable, "-c", code_text])
    _failed_naming_the_limit(world, proc, wf, setup)


def test_memory_max_fails_a_stdio_task_naming_the_limit_with_resources(world: World) -> None:
    """``--protocol stdio`` maps an OOM kill as the native protocol does, not as "killed by SIGKILL"."""
    setup = _setup()
    world.define(response_timeout=30)
    wf = world.start_workflow()
    code_text = ("import json, sys; sys.stdin.read(); a = bytearray(256 * 1024 * 1024); "
                 "print(json.dumps({'status': 'COMPLETED', 'output': {'n': len(a)}}))")  # fmt: skip
    proc = world.run("--once", "--protocol", "stdio", "--memory-max", "64M",
                     command=[sys.executable, "-c", code_text])  # fmt: skip
    _failed_naming_the_limit(world, proc, wf, setup, prefix="worker execution failed: ")
