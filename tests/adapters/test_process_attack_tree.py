"""Adversarial review of process supervision: children that try to outlive their task, each against the
real fork server.

Every child here is hostile in one way: it escapes after the TERM arrives, clears the environment
marker, bursts into many processes while being stopped, or leaves a detached daemon and exits 0.
The guarantee checked is always the same: every process the task started is dead within the kill
grace plus a margin, nothing is left unreaped, and nothing else is touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from leasecore.process import Child, CommandSpec, Supervisor
from tests.support import wait_until

from .process_support import Lines, alive, make_task, running_supervisor, zombies_of

SLACK_SECONDS = 2.0  # generous: the machine is shared; the design target is grace + 0.5 s


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def _python(code: str, **fields: object) -> CommandSpec:
    return CommandSpec(argv=(sys.executable, "-c", code), **fields)  # type: ignore[arg-type]


def _pids_from(lines: Lines, prefix: str, count: int, timeout: float = 30) -> list[int]:
    def found() -> list[int]:
        return [
            int(line.split()[1]) for s, line in list(lines.items) if s == "stdout" and line.startswith(prefix)
        ]

    assert wait_until(lambda: len(found()) >= count, timeout), lines.items
    return found()[:count]


def _processes(pids: list[int]) -> list[psutil.Process]:
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return found


def _all_dead(processes: list[psutil.Process]) -> bool:
    return not any(alive(p) for p in processes)


def _finish(child: Child, supervisor: Supervisor) -> None:
    assert child.wait(30) is not None
    assert child.wait_gone(30)
    assert wait_until(lambda: zombies_of(supervisor.forkserver_pid) == [], 5)


# A grandchild in the task's group that ignores TERM and, only once the TERM arrived, leaves the
# group (setsid) and wipes the environment marker by re-exec'ing itself under `env -i`.
SETSID_AFTER_TERM = r"""
import os, signal, sys, time
if os.fork() == 0:
    def escape(*_):
        os.setsid()
        os.execv("/usr/bin/env", ["env", "-i", sys.executable, "-c",
                 "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"])
    signal.signal(signal.SIGTERM, escape)
    print("grandchild", os.getpid(), flush=True)
    while True:
        time.sleep(1)
print("leader", os.getpid(), flush=True)
time.sleep(300)
"""


def test_grandchild_that_setsids_and_clears_its_marker_after_term_still_dies(supervisor: Supervisor) -> None:
    lines = Lines()
    grace = 1.0
    child = supervisor.spawn(make_task(), _python(SETSID_AFTER_TERM), worker_id="w", on_line=lines)
    [grandchild_pid] = _pids_from(lines, "grandchild ", 1)
    grandchild = psutil.Process(grandchild_pid)
    child.terminate_tree(grace_seconds=grace)
    # It did escape: a new session, no marker (once exec'd), yet it is still found and killed.
    assert wait_until(lambda: not alive(grandchild) or grandchild.pid == os.getsid(grandchild.pid), 10)
    assert wait_until(lambda: not alive(grandchild), grace + SLACK_SECONDS)
    _finish(child, supervisor)


# On TERM the leader bursts into 50 children that each setsid and double-fork (the middle process
# exits at once, so the daemons are orphans adopted by the fork server) and ignore TERM. "ready" is
# written unbuffered: a TERM right after its bytes, inside print's flush (where CPython runs the
# handler), would fork the daemons with stdout's lock held, and their own print would then raise.
BURST = r"""
import os, signal, sys, time
def burst(*_):
    for _ in range(50):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                print("daemon", os.getpid(), flush=True)
                time.sleep(300)
            os._exit(0)
signal.signal(signal.SIGTERM, burst)
os.write(1, b"ready %d\n" % os.getpid())
while True:
    time.sleep(1)
"""


def test_a_burst_of_daemons_during_termination_all_die(supervisor: Supervisor) -> None:
    lines = Lines()
    grace = 1.0
    child = supervisor.spawn(make_task(), _python(BURST), worker_id="w", on_line=lines)
    _pids_from(lines, "ready ", 1)
    started = time.monotonic()
    child.terminate_tree(grace_seconds=grace)
    daemons = _processes(_pids_from(lines, "daemon ", 50))
    assert wait_until(lambda: _all_dead(daemons), grace + SLACK_SECONDS + 3)
    assert time.monotonic() - started >= grace - 0.1 or not any(alive(d) for d in daemons)
    _finish(child, supervisor)
    assert psutil.Process(supervisor.forkserver_pid).children() == []


# A classic daemon that closes every fd it has (the output pipes included) and clears the marker.
CLOSING_DAEMON = r"""
import os, signal, sys, time
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(w, str(os.getpid()).encode())
        os.closerange(0, 1024)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stays ignored across exec: only KILL works
        os.execv("/usr/bin/env", ["env", "-i", "/bin/sleep", "300"])
    os._exit(0)
os.close(w)
print("daemon", os.read(r, 32).decode(), flush=True)
"""


def test_a_daemon_that_closes_all_fds_and_clears_the_marker_dies_with_the_task(
    supervisor: Supervisor,
) -> None:
    lines = Lines()
    child = supervisor.spawn(
        make_task(), _python(CLOSING_DAEMON, kill_grace_seconds=1.0), worker_id="w", on_line=lines
    )
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0
    daemon = psutil.Process(_pids_from(lines, "daemon ", 1)[0])
    assert wait_until(lambda: not alive(daemon), 1.0 + SLACK_SECONDS)
    _finish(child, supervisor)


def test_a_setsid_grandchild_without_marker_left_by_a_clean_exit_dies_with_the_task(
    supervisor: Supervisor,
) -> None:
    # The leader exits 0 at once; the grandchild left its session and its marker behind.
    command = CommandSpec(
        shell="trap '' TERM; setsid env -i /bin/sleep 300 & echo \"grandchild $!\"; exit 0",
        kill_grace_seconds=1.0,
    )
    lines = Lines()
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0
    pid = _pids_from(lines, "grandchild ", 1)[0]
    try:
        grandchild = psutil.Process(pid)  # TERM-proof: alive for the 1 s grace after the leader's exit
    except psutil.NoSuchProcess:  # a loaded machine may see the exit only after the kill: dead, as due
        grandchild = None
    if grandchild is not None:
        assert wait_until(lambda: not alive(grandchild), 1.0 + SLACK_SECONDS)
    _finish(child, supervisor)


# The escapee is adopted by the fork server, and only then starts more processes of its own.
ADOPTED_SPAWNER = r"""
import os, subprocess, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while os.getppid() != int(sys.argv[1]):  # wait until adopted by the fork server
            time.sleep(0.01)
        for _ in range(3):
            p = subprocess.Popen(["/bin/sleep", "300"], env={}, start_new_session=True)
            print("spawned", p.pid, flush=True)
        print("spawner", os.getpid(), flush=True)
        time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


def test_an_adopted_escapee_that_spawns_more_is_killed_with_all_it_spawned(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(argv=(sys.executable, "-c", ADOPTED_SPAWNER, str(supervisor.forkserver_pid)))
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    spawned = _processes([*_pids_from(lines, "spawned ", 3), *_pids_from(lines, "spawner ", 1)])
    assert len(spawned) == 4
    child.kill_tree()
    assert wait_until(lambda: _all_dead(spawned), SLACK_SECONDS)
    _finish(child, supervisor)


def test_kill_grace_zero_kills_a_term_ignorer_at_once(supervisor: Supervisor) -> None:
    lines = Lines()
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(300)"
    )
    child = supervisor.spawn(make_task(), _python(code, kill_grace_seconds=0.0), worker_id="w", on_line=lines)
    assert wait_until(lambda: lines.find("stdout", "up") is not None, 30)
    started = time.monotonic()
    child.terminate_tree()  # the spec's grace: 0
    exit = child.wait(10)
    assert exit is not None and exit.signal == signal.SIGKILL
    assert time.monotonic() - started < SLACK_SECONDS
    _finish(child, supervisor)


def test_kill_grace_zero_on_a_clean_exit_kills_leftovers_at_once(supervisor: Supervisor) -> None:
    command = CommandSpec(shell="trap '' TERM; sleep 300 & echo \"left $!\"; exit 0", kill_grace_seconds=0.0)
    lines = Lines()
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    leftover = _processes(_pids_from(lines, "left ", 1))  # may be killed already: it never exits alone
    assert child.wait(30) is not None
    assert wait_until(lambda: _all_dead(leftover), SLACK_SECONDS)
    _finish(child, supervisor)


def _force_next_pid(pid: int) -> bool:
    """Make the kernel hand out ``pid`` next (root only); False when this cannot be arranged."""
    try:
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        return True
    except OSError:
        return False


def test_the_leader_pid_is_held_until_the_tree_is_gone_so_it_cannot_be_reused(supervisor: Supervisor) -> None:
    # The leader exits at once; its TERM-ignoring child keeps the tree alive for the grace.
    command = CommandSpec(shell="trap '' TERM; sleep 300 & exit 0", kill_grace_seconds=3.0)
    child = supervisor.spawn(make_task(), command, worker_id="w")
    assert child.wait(30) is not None and not child.wait_gone(0)
    # The leader (pid = the group id the fork server signals) is still held, as a zombie: the kernel
    # cannot give its pid to anyone else, whatever we ask of it.
    assert psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE
    if _force_next_pid(child.pid):
        stranger = subprocess.Popen(["/bin/sleep", "60"])
        try:
            assert stranger.pid != child.pid
        finally:
            stranger.kill()
            stranger.wait()
    _finish(child, supervisor)


def test_signalling_a_finished_task_never_hits_the_process_that_took_its_pid(supervisor: Supervisor) -> None:
    child = supervisor.spawn(make_task(), CommandSpec(argv=("/bin/true",)), worker_id="w")
    _finish(child, supervisor)
    for _ in range(20):  # other processes on the host may grab the pid first: retry a few times
        if not _force_next_pid(child.pid):
            pytest.skip("cannot choose the next pid here (needs root and ns_last_pid)")
        stranger = subprocess.Popen(["/bin/sleep", "60"], start_new_session=True)
        if stranger.pid == child.pid:
            break
        stranger.kill()
        stranger.wait()
    else:
        pytest.skip("could not get the old pid reused")
    try:
        child.kill_tree()
        child.terminate_tree(grace_seconds=0)
        # The fork server answers in order: a spawn after the signals proves they were handled.
        supervisor.spawn(make_task(), CommandSpec(argv=("/bin/true",)), worker_id="w").wait(30)
        assert stranger.poll() is None and alive(psutil.Process(stranger.pid))
    finally:
        stranger.kill()
        stranger.wait()


# A leader that ignores TERM with a thousand sessions that obey it, their environment wiped (no
# marker): with no group, only the walk of the leader's children finds them, and the kernel gives
# that list (as a group's member list) one page per read, so one read of it is not all of it.
THOUSAND = r"""
import os, signal, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)
pids = [os.posix_spawn("/bin/sleep", ["sleep", "3317"], {}, setsid=True, setsigdef=[signal.SIGTERM])
        for _ in range(1000)]
with open(sys.argv[1], "w") as out:
    out.write(" ".join(map(str, pids)))
print("ready", len(pids), flush=True)
signal.pause()
"""


def test_each_of_a_thousand_sessions_under_one_leader_gets_the_term(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    lines = Lines()
    grace = 10.0
    listing = tmp_path / "pids"
    command = CommandSpec(argv=(sys.executable, "-c", THOUSAND, str(listing)), kill_grace_seconds=grace)
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    _pids_from(lines, "ready ", 1)
    sessions = _processes([int(pid) for pid in listing.read_text().split()])
    assert len(sessions) == 1000
    with open(f"/proc/{child.pid}/task/{child.pid}/children", "rb") as handle:
        assert len(handle.read()) > 4096  # the premise: longer than one page
    child.terminate_tree(grace_seconds=grace)
    # Each obeys the TERM: all gone long before the KILL at the grace's end (the leader is then).
    assert wait_until(lambda: _all_dead(sessions), grace / 2), f"{sum(map(alive, sessions))} missed the TERM"
    assert alive(psutil.Process(child.pid))
    child.kill_tree()
    _finish(child, supervisor)
