"""Adversarial review of process supervision: credentials, private files, fd hygiene, a dying fork server,
and a sweep that must never touch a stranger. Real children and real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from leasecore.errors import SpawnError
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.linux import leftovers
from leasecore.process.linux.leftovers import sweep
from tests.support import wait_until

from .process_support import REPO, Lines, alive, make_task, running_supervisor, sample

SECRET = "s3cret-value-9f2c"


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def _environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().split(b"\0")
    return dict(e.decode(errors="replace").partition("=")[::2] for e in entries if e)


# --- credentials -------------------------------------------------------------------------------


def test_credentials_reach_no_child_grandchild_fork_server_or_state_file(tmp_path: Path) -> None:
    environ = {
        "PATH": os.environ["PATH"],
        "CONDUCTOR_AUTH_KEY": SECRET + "-key",
        "CONDUCTOR_AUTH_SECRET": SECRET,
        "conductor_auth_secret": SECRET,
        "DB_PASSWORD": SECRET + "-db",
    }
    state = tmp_path / "state"
    lines = Lines()
    command = CommandSpec(shell='sleep 300 & echo "grandchild $!"; wait', secret_env_names=("DB_*",))
    with Supervisor(state, environ=environ) as sup:
        child = sup.spawn(make_task({"a": 1}), command, worker_id="w", on_line=lines)
        assert wait_until(lambda: lines.find("stdout", "grandchild ") is not None, 30)
        grandchild = int((lines.find("stdout", "grandchild ") or "").split()[1])
        for pid in (child.pid, grandchild, sup.forkserver_pid):
            assert SECRET not in json.dumps(_environ_of(pid))
        assert _environ_of(sup.forkserver_pid) == {}
        records = list(state.glob("processes-*.json"))
        assert len(records) == 1 and SECRET not in records[0].read_text()
        assert leftovers.read_record(records[0])["trees"]  # the tree is recorded (record or journal)
        assert not [f for f in state.iterdir() if f.is_file() and SECRET in f.read_text()]
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert stat.S_IMODE(records[0].stat().st_mode) == 0o600
        child.kill_tree()
        assert child.wait(30) is not None


# A runner in its own process, with a credential in its initial environment (as systemd or a shell
# would give it); its child, the same user, tries to read the runner's environment and memory. Root
# can read anything whatever we do (and must not run tasks: docs/security.md), so under a root test
# run the runner runs as nobody.
PEEKER = textwrap.dedent(
    """
    import os, sys
    from leasecore.models import Task
    from leasecore.process import CommandSpec, Supervisor
    with Supervisor(None, protect_runner=sys.argv[1] == "protect") as sup:
        spec = CommandSpec(
            shell='cat /proc/$RUNNER/environ; head -c 100 /proc/$RUNNER/mem; echo; echo tried',
            env={"RUNNER": str(os.getpid())},
        )
        exit = sup.spawn(Task(task_id="t", workflow_id="w", task_type="x"), spec, worker_id="w").wait(30)
        print(exit.stdout_tail.replace("\\0", " "))
        print(exit.stderr_tail)
    """
)


# As root, the runner becomes nobody: it needs an interpreter nobody may run (this venv's may live
# under /root) and the package on PYTHONPATH (stdlib only, so any 3.11 will do).
_SYSTEM_PYTHON = "/usr/bin/python3"


def _peek(mode: str) -> str:
    env = {"PATH": os.environ["PATH"], "CONDUCTOR_AUTH_SECRET": SECRET, "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", PEEKER, mode]
    if os.getuid() == 0:
        argv = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", _SYSTEM_PYTHON, *argv[1:]]
    done = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "tried" in done.stdout  # the child did run its attempts
    return done.stdout + done.stderr


@pytest.mark.skipif(
    os.getuid() == 0 and (shutil.which("setpriv") is None or not os.path.exists(_SYSTEM_PYTHON)),
    reason="as root, needs setpriv and a system python3 to run the runner as nobody",
)
def test_a_child_cannot_read_the_runners_environment_or_memory() -> None:
    assert SECRET in _peek("no-protection")  # the attack is real: same user, readable environ
    seen = _peek("protect")
    assert SECRET not in seen
    assert "Permission denied" in seen


# --- fd hygiene --------------------------------------------------------------------------------


def test_no_runner_fd_leaks_into_a_child(supervisor: Supervisor, tmp_path: Path) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    served, _ = listener.accept()
    state_file = open(tmp_path / "state.json", "w")  # noqa: SIM115 (held open on purpose)
    pipe_r, pipe_w = os.pipe()
    os.set_inheritable(pipe_r, True)  # even an inheritable fd of the runner must not get through
    try:
        other = supervisor.spawn(make_task(), CommandSpec(argv=("/bin/sleep", "300")), worker_id="w")
        lines = Lines()
        child = supervisor.spawn(
            make_task(), CommandSpec(shell='echo up; read -r _ < /dev/null; sleep 300'), worker_id="w",
            on_line=lines,
        )  # fmt: skip
        assert wait_until(lambda: lines.find("stdout", "up") is not None, 30)
        ours = set()
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the fd listdir used is gone already
                ours.add(os.readlink(f"/proc/self/fd/{fd}"))
        for pid in (child.pid, other.pid):
            fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            assert set(fds) == {0, 1, 2}, fds
            assert fds[0].endswith("input.json")
        forkserver_fds = {os.readlink(f"/proc/{supervisor.forkserver_pid}/fd/{fd}")
                          for fd in os.listdir(f"/proc/{supervisor.forkserver_pid}/fd")}  # fmt: skip
        leaked = {t for t in forkserver_fds & ours if t.startswith(("socket:", "pipe:")) or "state" in t}
        # The control socket pair is the only thing the fork server shares with us: one socket.
        assert len([t for t in leaked if t.startswith("socket:")]) <= 1 and not [
            t for t in leaked if not t.startswith("socket:")
        ], leaked
        child.kill_tree()
        other.kill_tree()
        assert child.wait_gone(30) and other.wait_gone(30)
    finally:
        for closable in (listener, client, served, state_file):
            closable.close()
        os.close(pipe_r)
        os.close(pipe_w)


# --- temporary files ---------------------------------------------------------------------------


def test_temporary_files_are_removed_when_the_child_is_killed(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(shell='echo "dir $(dirname "$CONDUCTOR_INPUT_FILE")"; sleep 300')
    child = supervisor.spawn(make_task({"x": 1}), command, worker_id="w", on_line=lines)
    assert wait_until(lambda: lines.find("stdout", "dir ") is not None, 30)
    directory = Path((lines.find("stdout", "dir ") or "")[4:])
    assert directory.is_dir() and stat.S_IMODE(directory.stat().st_mode) == 0o700
    child.kill_tree()
    assert child.wait(30) is not None
    assert not directory.exists()


# --- a dying fork server -----------------------------------------------------------------------


def test_a_killed_fork_server_is_replaced_for_the_next_task(supervisor: Supervisor, tmp_path: Path) -> None:
    lines = Lines()
    first = supervisor.spawn(
        make_task(), CommandSpec(argv=sample("sleeper.sh")), worker_id="w", on_line=lines
    )
    assert wait_until(lambda: lines.find("stdout", "sleeping") is not None, 30)
    old = psutil.Process(supervisor.forkserver_pid)
    os.kill(old.pid, signal.SIGKILL)
    exit = first.wait(30)
    assert exit is not None and exit.signal == signal.SIGKILL
    assert not alive(old)
    # The next task runs normally, under a new fork server that the state record names.
    second = supervisor.spawn(make_task(), CommandSpec(shell="echo again"), worker_id="w")
    again = second.wait(30)
    assert again is not None and again.exit_code == 0 and again.stdout_tail == "again"
    assert supervisor.forkserver_pid != old.pid and alive(psutil.Process(supervisor.forkserver_pid))
    [record] = (tmp_path / "state").glob("processes-*.json")
    assert json.loads(record.read_text())["forkserver"]["pid"] == supervisor.forkserver_pid


def test_fork_server_out_of_fds_fails_one_spawn_and_keeps_serving(supervisor: Supervisor) -> None:
    forkserver = psutil.Process(supervisor.forkserver_pid)
    soft, hard = forkserver.rlimit(psutil.RLIMIT_NOFILE)
    forkserver.rlimit(psutil.RLIMIT_NOFILE, (forkserver.num_fds(), hard))  # not one fd more
    try:
        with pytest.raises(SpawnError, match="Too many open files"):
            supervisor.spawn(make_task(), CommandSpec(argv=("/bin/true",)), worker_id="w")
    finally:
        forkserver.rlimit(psutil.RLIMIT_NOFILE, (soft, hard))
    assert alive(forkserver) and supervisor.forkserver_pid == forkserver.pid
    exit = supervisor.spawn(make_task(), CommandSpec(argv=("/bin/true",)), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0


# --- the leftover sweep and strangers ----------------------------------------------------------


def _dead_runner_record(state: Path, tree_pid: int, tree_start: int) -> Path:
    """A record as a SIGKILLed runner would have left it, naming ``tree_pid`` as a tree leader."""
    state.mkdir(mode=0o700, exist_ok=True)
    path = state / "processes-999999.json"
    path.write_text(json.dumps({
        "runner": {"pid": 999999, "start_time": 1},
        "forkserver": {"pid": 999998, "start_time": 1},
        "trees": [{"key": "t1", "pid": tree_pid, "start_time": tree_start, "token": "f" * 32, "tmpdir": ""}],
    }))  # fmt: skip
    return path


def test_sweep_spares_a_stranger_that_now_has_the_recorded_pid(tmp_path: Path) -> None:
    stranger = subprocess.Popen(["/bin/sleep", "60"], start_new_session=True)
    try:
        info = psutil.Process(stranger.pid)
        record = _dead_runner_record(tmp_path / "state", stranger.pid, int(info.create_time()) + 12345)
        assert sweep(tmp_path / "state") == set()
        assert alive(info) and not record.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_sweep_spares_the_session_a_stranger_left_under_the_recorded_pid(tmp_path: Path) -> None:
    # The recorded leader pid was recycled by a stranger that started a session and exited, leaving
    # its child in that session: the session id matches, but it is not ours.
    leader = subprocess.Popen(
        ["/bin/sh", "-c", "/bin/sleep 60 & echo $!"],
        start_new_session=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert leader.stdout is not None
    orphan = psutil.Process(int(leader.stdout.readline()))
    leader.wait()
    leader.stdout.close()
    try:
        assert os.getsid(orphan.pid) == leader.pid
        _dead_runner_record(tmp_path / "state", leader.pid, 1)
        assert sweep(tmp_path / "state") == set()
        assert alive(orphan)
    finally:
        orphan.kill()


# --- runner death --------------------------------------------------------------------------------

# A runner whose task left a TERM-proof escapee in its own session, without the marker.
ESCAPING_RUNNER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from leasecore.models import Task
    from leasecore.process import CommandSpec, Supervisor
    sup = Supervisor(Path(sys.argv[1]))
    lines = []
    spec = CommandSpec(shell="trap '' TERM; setsid env -i /bin/sleep 300 & echo \\"escapee $!\\"; sleep 300")
    child = sup.spawn(Task(task_id="t", workflow_id="w", task_type="x"), spec, worker_id="w",
                      on_line=lambda s, line: lines.append(line))
    while not lines:
        time.sleep(0.01)
    print(child.pid, lines[0].split()[1], sup.forkserver_pid, flush=True)
    time.sleep(600)
    """
)


def test_sigkilled_runner_takes_an_unmarked_escapee_with_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ESCAPING_RUNNER, str(tmp_path / "state")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        processes = [psutil.Process(pid) for pid in pids]
        # Until the escapee is sleep itself: /proc/PID/environ reads empty while an exec is under way
        # (seen under load: "no token" while it was still the setsid program, before its setsid()).
        escapee = processes[1]
        assert wait_until(lambda: escapee.cmdline()[:1] == ["/bin/sleep"] and not escapee.environ(), 10)
        assert os.getsid(pids[1]) == pids[1]  # its own session: not in the task's group
        proc.kill()
        proc.wait()
        assert wait_until(lambda: not any(alive(p) for p in processes), 5)
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
