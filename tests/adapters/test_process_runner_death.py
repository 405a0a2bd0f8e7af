"""Children never outlive their runner: SIGKILLed runner, dead fork server, leftover sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import leftovers
from tests.support import wait_until

from .process_support import REPO, Lines, alive, make_task, sample

# A runner in its own process: spawns a TERM-ignorer and a daemonizer (whose daemon leaves the group
# by setsid + double fork), prints every pid of both trees as JSON, then waits to be killed.
RUNNER = """
import json, sys, time
from pathlib import Path
import psutil
from leasecore.models import Task
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import leftovers

state_dir, ignorer, daemonizer = sys.argv[1], sys.argv[2], sys.argv[3:]
sup = Supervisor(Path(state_dir))
lines = []
task = Task(task_id="t", workflow_id="w", task_type="x")
a = sup.spawn(task, CommandSpec(argv=(ignorer,)), worker_id="w")
b = sup.spawn(task, CommandSpec(argv=tuple(daemonizer)), worker_id="w", on_line=lambda s, l: lines.append(l))
deadline = time.monotonic() + 30
while not any(l.startswith("daemon ") for l in lines) and time.monotonic() < deadline:
    time.sleep(0.01)
daemon = int(next(l for l in lines if l.startswith("daemon ")).split()[1])
while len(psutil.Process(a.pid).children()) < 1 and time.monotonic() < deadline:
    time.sleep(0.01)
pids = [daemon]
for c in (a, b):
    pids += [c.pid] + [p.pid for p in psutil.Process(c.pid).children(recursive=True)]
print(json.dumps({"forkserver": sup.forkserver_pid, "pids": pids}), flush=True)
time.sleep(600)
"""


@pytest.fixture
def runner(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, list[int] | int]]]:
    argv = [sys.executable, "-c", RUNNER, str(tmp_path / "state"), *sample("term_ignorer.sh"),
            *sample("daemonizer.py")]  # fmt: skip
    # Its own process group, as a runner started by a shell or a service manager has.
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, cwd=REPO, process_group=0)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        yield proc, info
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


def _processes(pids: list[int]) -> list[psutil.Process]:
    """The live ones (the daemonizer's short-lived middle process may already be gone)."""
    found = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if alive(process):
            found.append(process)
    return found


def test_sigkilled_runner_takes_every_task_process_with_it(
    runner: tuple[subprocess.Popen[str], dict[str, list[int] | int]], tmp_path: Path
) -> None:
    proc, info = runner
    assert isinstance(info["pids"], list) and isinstance(info["forkserver"], int)
    tree = _processes(info["pids"])
    forkserver = psutil.Process(info["forkserver"])
    assert tree[0].pid == info["pids"][0] and len(tree) >= 4  # daemon, sh, sleep, daemonizer
    (record,) = (tmp_path / "state").glob("processes-*.json")
    tmpdirs = [Path(tree["tmpdir"]) for tree in leftovers.read_record(record)["trees"]]
    assert len(tmpdirs) == 2 and all(t.is_dir() for t in tmpdirs)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not any(alive(p) for p in [*tree, forkserver]), 5)
    # The tasks' directories (their input) go with them; the record stays, for the next start to report.
    assert not any(t.exists() for t in tmpdirs)
    assert record.exists()


def test_a_sigkill_to_the_runners_process_group_still_kills_every_tree(
    runner: tuple[subprocess.Popen[str], dict[str, list[int] | int]],
) -> None:
    """``kill -9 -PGID`` (or a supervisor that kills the group it started) must not take the fork server
    along: it is in a group of its own, sees the runner die, and kills every tree, the setsid'ed daemon
    and the TERM-ignorer's grandchild included."""
    proc, info = runner
    assert isinstance(info["pids"], list) and isinstance(info["forkserver"], int)
    tree = _processes(info["pids"])
    forkserver = psutil.Process(info["forkserver"])
    assert os.getpgid(forkserver.pid) != os.getpgid(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert wait_until(lambda: not any(alive(p) for p in tree), 10), [p.pid for p in tree if alive(p)]
    assert wait_until(lambda: not alive(forkserver), 10)


def test_leftovers_of_a_dead_runner_and_fork_server_are_swept(
    runner: tuple[subprocess.Popen[str], dict[str, list[int] | int]], tmp_path: Path
) -> None:
    proc, info = runner
    assert isinstance(info["pids"], list) and isinstance(info["forkserver"], int)
    tree = _processes(info["pids"])
    daemon = tree[0]
    assert daemon.pid == info["pids"][0]
    direct = [p for p in tree if p.ppid() == info["forkserver"] and p.pid != daemon.pid]
    # Both die before either can clean up: freeze the runner, kill the fork server, kill the runner.
    proc.send_signal(signal.SIGSTOP)
    os.kill(info["forkserver"], signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # Nothing of ours is left to kill the trees (the tasks are started with posix_spawn, which cannot set a
    # parent-death signal): every process of them lives on until the next start's sweep.
    assert direct and all(alive(p) for p in direct)
    assert alive(daemon)
    records = list((tmp_path / "state").glob("processes-*.json"))
    assert len(records) == 1
    tmpdirs = [tree["tmpdir"] for tree in leftovers.read_record(records[0])["trees"]]
    assert len(tmpdirs) == 2 and all(Path(t).is_dir() for t in tmpdirs)
    with Supervisor(tmp_path / "state") as sup:
        killed = sup.sweep_leftovers()
    assert daemon.pid in killed and {p.pid for p in direct} <= killed
    assert wait_until(lambda: not any(alive(p) for p in tree), 5)
    assert not records[0].exists()
    assert not any(Path(t).exists() for t in tmpdirs)


def test_sweep_leaves_live_runners_and_strangers_alone(tmp_path: Path) -> None:
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with Supervisor(tmp_path / "state") as first:
            child = first.spawn(make_task(), CommandSpec(argv=sample("sleeper.sh")), worker_id="w")
            with Supervisor(tmp_path / "state") as second:
                assert second.sweep_leftovers() == set()  # first's runner (this process) is alive
            assert not child.exited
        assert alive(psutil.Process(stranger.pid))
    finally:
        stranger.kill()
        stranger.wait()


def test_a_dead_fork_server_takes_its_trees_with_it(tmp_path: Path) -> None:
    lines = Lines()
    with Supervisor(tmp_path / "state") as sup:
        child = sup.spawn(
            make_task(), CommandSpec(argv=sample("daemonizer.py")), worker_id="w", on_line=lines
        )
        assert wait_until(lambda: lines.find("stdout", "daemon ") is not None, 30)
        line = lines.find("stdout", "daemon ")
        assert line is not None
        daemon = psutil.Process(int(line.split()[1]))
        main = psutil.Process(child.pid)
        os.kill(sup.forkserver_pid, signal.SIGKILL)
        exit = child.wait(10)
        assert exit is not None and exit.signal == signal.SIGKILL
        assert wait_until(lambda: not alive(daemon) and not alive(main), 5)
