"""End to end: the runner's secret is out of every child's reach through /proc, even as root.

A real `conductor-run run --once` (the console entry point, so it re-executes itself without its
secrets) against the embedded server with auth; its child, running as root like the test, reads every
``/proc/*/environ`` and ``/proc/*/cmdline`` on the machine and reports where the secret is. A decoy
process started with the secret in its environment proves the scan sees what is there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cli import exitcodes
from tests.support import wait_until

from .helpers import AUTH_KEY, AUTH_SECRET, World

KEY, SECRET = AUTH_KEY, AUTH_SECRET  # the secret is unique: no other process on the machine holds it

# The secret reaches the child as data (the task's input object, on stdin: objects are never put in
# CONDUCTOR_INPUT_* variables), so the child's own environment does not hold it.
SCAN = (
    "import glob, json, os, sys\n"
    "wanted = json.load(sys.stdin)['x']['v'].encode()\n"
    "found = []\n"
    "for path in glob.glob('/proc/[0-9]*/environ') + glob.glob('/proc/[0-9]*/cmdline'):\n"
    "    try:\n"
    "        with open(path, 'rb') as f:\n"
    "            if wanted in f.read():\n"
    "                found.append(path)\n"
    "    except OSError:\n"
    "        pass\n"
    "with open(os.environ['CONDUCTOR_OUTPUT_FILE'], 'w') as f:\n"
    "    json.dump({'found': sorted(found), 'uid': os.geteuid(), 'me': os.getpid()}, f)\n"
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the guarantee is about a child running as root")


@pytest.fixture
def decoy() -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                            env={"DECOY_SECRET": SECRET, "PATH": os.environ.get("PATH", "")})
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _scan_with(world: World, env: dict[str, str], *args: str) -> tuple[int, str, dict[str, object]]:
    world.define(response_timeout=30)
    workflow = world.start_workflow(x={"v": SECRET})
    proc = world.run("--once", *args, command=[sys.executable, "-c", SCAN], env=env)
    code, err = world.finish(proc)
    return code, err, dict(world.task_of(workflow).get("outputData") or {})


def test_no_process_shows_the_secret_in_environ_or_cmdline_to_a_root_child(
    auth_world: World, decoy: int
) -> None:
    code, err, output = _scan_with(auth_world, {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET})
    assert code == exitcodes.OK, err
    assert output["uid"] == 0
    # Only the decoy: not the runner (re-executed without it), not its fork server, not the child.
    assert output["found"] == [f"/proc/{decoy}/environ"], output
    assert SECRET not in err


def test_a_declared_secret_leaves_the_runners_environment_too(auth_world: World, decoy: int) -> None:
    config = auth_world.tmp / "conductor.toml"
    config.write_text('[worker]\nsecrets = ["MY_*"]\n')
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET, "MY_DB_PASSWORD": SECRET}
    code, err, output = _scan_with(auth_world, env, "--config", str(config))
    assert code == exitcodes.OK, err
    assert output["found"] == [f"/proc/{decoy}/environ"], output


def test_the_secret_from_a_private_file(auth_world: World, decoy: int) -> None:
    path = auth_world.tmp / "secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    env = {"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET_FILE": str(path)}
    code, err, output = _scan_with(auth_world, env)
    assert code == exitcodes.OK, err
    assert output["found"] == [f"/proc/{decoy}/environ"], output


def test_a_world_readable_secret_file_is_refused(auth_world: World) -> None:
    path = auth_world.tmp / "secret"
    path.write_text(SECRET)
    path.chmod(0o644)
    proc = auth_world.run("--once", command=["/bin/true"],
                     env={"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET_FILE": str(path)})
    code, err = auth_world.finish(proc)
    assert code == exitcodes.CONFIG, err
    assert f"auth_secret_file {path} (from env CONDUCTOR_AUTH_SECRET_FILE)" in err and "mode 0644" in err
    assert SECRET not in err and err.count("\n") == 1


def test_the_runner_keeps_its_pid_across_the_re_exec(auth_world: World) -> None:
    """The re-exec replaces the image, not the process: a supervisor (systemd, a container's pid 1)
    still holds the pid it started."""
    auth_world.define(response_timeout=30)
    auth_world.start_workflow()
    proc = auth_world.run("--once", command=["/bin/sh", "-c", "sleep 1"],
                     env={"CONDUCTOR_AUTH_KEY": KEY, "CONDUCTOR_AUTH_SECRET": SECRET})
    wait_until(lambda: "started: pid" in auth_world.stderr(proc), 30, what="the child to start")
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    assert not any(SECRET.encode() in item for item in environ)
    assert not any(item.startswith(b"CONDUCTOR_AUTH_") for item in environ)
    code, err = auth_world.finish(proc)
    assert code == exitcodes.OK, err
