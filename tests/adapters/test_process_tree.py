"""Owning the whole tree: TERM -> grace -> KILL, escapees, no zombies, exit not held by pipes."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from leasecore.models import TaskStatus
from leasecore.process import Child, CommandSpec, Supervisor, to_task_result
from tests.support import wait_until

from .process_support import (
    Lines,
    alive,
    make_task,
    processes_with_marker,
    running_supervisor,
    sample,
    zombies_of,
)

SLACK_SECONDS = 0.5  # the guarantee: every process gone within grace + 0.5 s


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _escapee_pid(lines: Lines) -> int:
    assert wait_until(lambda: lines.find("stdout", "daemon ") is not None, 30)
    line = lines.find("stdout", "daemon ")
    assert line is not None
    return int(line.split()[1])


def test_terminate_stops_a_sleeper_at_once(supervisor: Supervisor) -> None:
    child = supervisor.spawn(
        make_task({"seconds": 300}), CommandSpec(argv=sample("sleeper.sh")), worker_id="w"
    )
    assert wait_until(lambda: len(_tree(child.pid)) >= 2, 15)  # sh + sleep
    tree = _tree(child.pid)
    started = time.monotonic()
    child.terminate_tree(grace_seconds=10)
    exit = child.wait(15)
    assert exit is not None and exit.signal == signal.SIGTERM
    assert wait_until(lambda: not any(alive(p) for p in tree), 5)
    assert time.monotonic() - started < 5  # well before the 10 s grace: TERM was enough
    result = to_task_result(make_task(), exit, CommandSpec(argv=("x",)), worker_id="w")
    assert (result.status, result.reason_for_incompletion) == (TaskStatus.FAILED, "killed by SIGTERM")


def test_term_ignorer_is_killed_after_the_grace(supervisor: Supervisor) -> None:
    grace = 1.5
    lines = Lines()
    child = supervisor.spawn(
        make_task(), CommandSpec(argv=sample("term_ignorer.sh")), worker_id="w", on_line=lines
    )
    assert wait_until(lambda: lines.find("stdout", "ignoring TERM") is not None, 15)
    assert wait_until(lambda: len(_tree(child.pid)) >= 2, 15)
    tree = _tree(child.pid)
    started = time.monotonic()
    child.terminate_tree(grace_seconds=grace)
    assert wait_until(lambda: not any(alive(p) for p in tree), grace + SLACK_SECONDS)
    elapsed = time.monotonic() - started
    assert elapsed >= grace - 0.1, "killed before the grace ran out"
    exit = child.wait(10)
    assert exit is not None and exit.signal == signal.SIGKILL


@pytest.mark.parametrize("since_offset", [-2.5, 100.0], ids=["decided-earlier", "future-is-now"])
def test_the_grace_counts_from_when_the_stop_was_decided(supervisor: Supervisor, since_offset: float) -> None:
    """A TERM handed out late (a runner stopping 500 trees sends them one by one) keeps the KILL at the
    fence's time + grace: ``since`` = when the runner decided. A ``since`` in the future counts as now."""
    grace = 3.0
    lines = Lines()
    child = supervisor.spawn(
        make_task(), CommandSpec(argv=sample("term_ignorer.sh")), worker_id="w", on_line=lines
    )
    assert wait_until(lambda: lines.find("stdout", "ignoring TERM") is not None, 15)
    tree = _tree(child.pid)
    started = time.monotonic()
    child.terminate_tree(grace_seconds=grace, since=started + since_offset)
    due = started + (grace + since_offset if since_offset < 0 else grace)  # 0.5 s, or 3 s
    assert wait_until(lambda: not any(alive(p) for p in tree), due - started + SLACK_SECONDS)
    assert time.monotonic() >= due - 0.1, "killed before the grace ran out"
    exit = child.wait(10)
    assert exit is not None and exit.signal == signal.SIGKILL


def test_escapee_that_left_the_group_is_killed_with_the_tree(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(argv=sample("daemonizer.py"), kill_grace_seconds=1.0)
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    daemon = psutil.Process(_escapee_pid(lines))
    assert daemon.ppid() == supervisor.forkserver_pid  # adopted by the subreaper
    assert daemon.pid != child.pid and daemon.pid not in {p.pid for p in _tree(child.pid)}
    tree = [*_tree(child.pid), daemon]
    child.kill_tree()
    assert wait_until(lambda: not any(alive(p) for p in tree), SLACK_SECONDS + 0.5)
    assert child.wait_gone(10)
    assert zombies_of(supervisor.forkserver_pid) == []


def test_the_tree_dies_with_the_task_when_it_exits_normally(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(argv=sample("daemonizer.py"), kill_grace_seconds=1.0)
    child = supervisor.spawn(make_task({"then": "exit"}), command, worker_id="w", on_line=lines)
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0 and exit.output is not None
    daemon_pid = int(exit.output["daemon_pid"])
    assert child.wait_gone(1.0 + SLACK_SECONDS + 5)
    assert not psutil.pid_exists(daemon_pid) or not alive(psutil.Process(daemon_pid))
    assert zombies_of(supervisor.forkserver_pid) == []


def test_a_grandchild_holding_stdout_does_not_keep_the_task_open(supervisor: Supervisor) -> None:
    started = time.monotonic()
    command = CommandSpec(argv=sample("grandchild_holds_stdout.sh"), kill_grace_seconds=1.0)
    child = supervisor.spawn(make_task(), command, worker_id="w")
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0
    assert time.monotonic() - started < 10  # not the grandchild's 300 s
    assert exit.stdout_tail.startswith("started a grandchild: ")
    grandchild_pid = int(exit.stdout_tail.split(": ")[1])
    assert child.wait_gone(15)
    assert not psutil.pid_exists(grandchild_pid) or not alive(psutil.Process(grandchild_pid))


def test_no_zombies_after_many_short_tasks(supervisor: Supervisor) -> None:
    command = CommandSpec(shell="true & true & (sleep 0.01 &) ; exit 0", kill_grace_seconds=1.0)
    children = [supervisor.spawn(make_task(), command, worker_id="w") for _ in range(20)]
    for child in children:
        assert child.wait(30) is not None
        assert child.wait_gone(15)
    assert wait_until(lambda: zombies_of(supervisor.forkserver_pid) == [], 5)
    assert psutil.Process(supervisor.forkserver_pid).children() == []


def test_close_kills_every_tree_still_held(tmp_path: object) -> None:
    sup = Supervisor(None)
    lines = Lines()
    children = [
        sup.spawn(make_task(), CommandSpec(argv=sample("term_ignorer.sh")), worker_id="w"),
        sup.spawn(make_task(), CommandSpec(argv=sample("daemonizer.py")), worker_id="w", on_line=lines),
    ]
    daemon = psutil.Process(_escapee_pid(lines))
    tree = [daemon, *(p for c in children for p in _tree(c.pid))]
    forkserver = psutil.Process(sup.forkserver_pid)
    sup.close(grace_seconds=0.5)
    assert wait_until(lambda: not any(alive(p) for p in tree), 0.5 + SLACK_SECONDS)
    assert not alive(forkserver)
    for child in children:
        exit = child.wait(5)
        assert exit is not None and exit.signal in (signal.SIGTERM, signal.SIGKILL)


def test_marker_token_is_unique_per_task(supervisor: Supervisor) -> None:
    first = supervisor.spawn(make_task(), CommandSpec(argv=sample("sleeper.sh")), worker_id="w")
    second = supervisor.spawn(make_task(), CommandSpec(argv=sample("sleeper.sh")), worker_id="w")
    try:

        def both_marked() -> bool:
            return {first.pid, second.pid} <= {p.pid for p in processes_with_marker()}

        assert wait_until(both_marked, 15)
        # Only these two: other marked processes (another test run's, on a shared host) may end meanwhile.
        tokens = {pid: psutil.Process(pid).environ()["CONDUCTOR_RUN_TREE"] for pid in (first.pid, second.pid)}
        assert tokens[first.pid] != tokens[second.pid]
    finally:
        first.kill_tree()
        second.kill_tree()
    assert first.wait_gone(10) and second.wait_gone(10)


ESCAPEE_UNDER_LEADER = 'sleep 600 & a=$!; setsid sleep 600 & b=$!; echo "pids $$ $a $b"; wait'


def _term_a_tree_with_an_escapee_under_its_leader(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(shell=ESCAPEE_UNDER_LEADER, kill_grace_seconds=60.0)
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    assert wait_until(lambda: lines.find("stdout", "pids ") is not None, 30)
    line = lines.find("stdout", "pids ")
    assert line is not None
    pids = {int(p) for p in line.split()[1:]}
    assert len(pids) == 3  # the shell, its sleep in the group, the setsid'ed sleep
    procs = [psutil.Process(p) for p in pids]
    child.terminate_tree()
    assert wait_until(lambda: not any(alive(p) for p in procs), 10), "a member waited for the KILL"
    assert child.wait_gone(10)


def test_term_reaches_an_escapee_the_leader_still_parents(supervisor: Supervisor) -> None:
    """The leader's own setsid'ed child is TERMed with the tree, not left for the KILL after the grace
    (60 s here): its members are found before the group is signalled. Found by the kill-latency bench:
    an obeys-term tree sometimes took kill_grace to die; this shape failed every time."""
    for _ in range(5):
        _term_a_tree_with_an_escapee_under_its_leader(supervisor)


def test_a_member_started_by_a_term_handler_gets_its_own_term_before_the_kill(supervisor: Supervisor) -> None:
    """A TERM handler that starts a setsid'ed helper on its way out: the helper appeared after the tree's
    TERM, so it is TERMed when the next walk finds it, not left for the KILL after the grace (60 s).

    The helper starts with TERM at its default and blocked until its exec (posix_spawn): a child
    forked by the handling process itself (a shell's ``trap ... &``) runs with the inherited handler
    until it execs, and a TERM that reaches it in that moment is caught and lost, and the exec'd helper
    keeps the pid, so it is not new at the next walk. Such a helper dies by the KILL at the grace,
    which the guarantee allows (sending TERM again after an exec would cut short a cleanup program a
    trap execs); that window made this test fail now and then when the shell forked the helper.

    "ready" is written unbuffered: the TERM can come as soon as its bytes are out, and a ``print``
    still inside its flush holds stdout's lock, where CPython runs the handler (after each write of
    the flush), whose own ``print`` then raises "reentrant call" and "late" never comes. That made
    this test fail now and then under load (the handler ran once: no second TERM)."""
    lines = Lines()
    leader = (
        "import os, signal, sys\n"
        "def on_term(*_):\n"
        "    pid = os.posix_spawnp('sleep', ['sleep', '600'], os.environ, setsid=True,\n"
        "                          setsigdef=[signal.SIGTERM])\n"
        "    print('late', pid, flush=True)\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "os.write(1, b'ready\\n')\n"
        "while True:\n"
        "    signal.pause()\n"
    )
    command = CommandSpec(argv=(sys.executable, "-c", leader), kill_grace_seconds=60.0)
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    assert wait_until(lambda: lines.find("stdout", "ready") is not None, 30)
    child.terminate_tree()
    assert wait_until(lambda: lines.find("stdout", "late ") is not None, 30)
    line = lines.find("stdout", "late ")
    assert line is not None
    try:
        late = psutil.Process(int(line.split()[1]))
    except psutil.NoSuchProcess:
        late = None  # TERMed and gone before we looked: what the test wants
    assert late is None or wait_until(lambda: not alive(late), 10), "the late member waited for the KILL"
    assert child.wait_gone(10)


def _term_together(supervisor: Supervisor, children: list[Child]) -> None:
    """TERM every tree in one batch of requests (they queue up behind the stopped fork server, as they
    do behind a busy walk) and check each died of that TERM, not of the KILL after a 60 s grace."""
    forkserver = psutil.Process(supervisor.forkserver_pid)
    forkserver.suspend()
    try:
        for child in children:
            child.terminate_tree(grace_seconds=60)
    finally:
        forkserver.resume()
    for child in children:
        exit = child.wait(15)
        assert exit is not None and exit.signal == signal.SIGTERM


def test_signals_asked_together_cost_one_walk_of_proc(supervisor: Supervisor) -> None:
    """A runner that stops sends a TERM per tree at once. The fork server reads every request already
    waiting, walks /proc once and signals them all; a walk per request (O(processes) each) made the
    last TERM of 200 tasks, and so its KILL, seconds late (the shutdown bench)."""
    trees = 30
    children = [
        supervisor.spawn(make_task(task_id=f"t{i}"), CommandSpec(argv=("sleep", "300")), worker_id="w")
        for i in range(trees)
    ]
    assert wait_until(lambda: all(len(_tree(c.pid)) == 1 and _tree(c.pid)[0].name() == "sleep"
                                  for c in children), 30)  # fmt: skip
    before = supervisor.forkserver_stats()
    assert before["trees"] == trees
    _term_together(supervisor, children)
    for child in children:
        assert child.wait_gone(15)
    walks = supervisor.forkserver_stats()["walks"] - before["walks"]
    # One walk for the 30 TERMs, then the walks of the ticks that see the trees end (one every
    # 50 ms at most, plus a confirming one): far fewer than one per tree.
    assert walks < trees // 2, f"{walks} walks of /proc for {trees} trees signalled together"


def test_a_tree_ending_among_many_running_ones_walks_only_its_own_processes(supervisor: Supervisor) -> None:
    """While a task's leftovers are being killed, the fork server re-walks /proc every tick; the
    running trees' processes are not read (it is a subreaper: a member of the ending tree, or a stray,
    can only be below that tree's leader or re-parented to the fork server itself). A full walk every
    50 ms with 1000 tasks running took most of the fork server's CPU (the heartbeat bench)."""
    quiet = [
        supervisor.spawn(make_task(task_id=f"q{i}"), CommandSpec(argv=("sleep", "300")), worker_id="w")
        for i in range(40)
    ]
    assert wait_until(lambda: all(_tree(c.pid)[0].name() == "sleep" for c in quiet), 30)
    lines = Lines()
    ending = supervisor.spawn(
        make_task(task_id="ending"),
        CommandSpec(shell='trap "" TERM; sleep 300 & echo "left $!"; exit 0', kill_grace_seconds=0.5),
        worker_id="w",
        on_line=lines,
    )
    assert wait_until(lambda: lines.find("stdout", "left ") is not None, 30)
    line = lines.find("stdout", "left ")
    assert line is not None
    leftover = psutil.Process(int(line.split()[1]))
    before = supervisor.forkserver_stats()
    assert ending.wait_gone(15), "the leftover was not killed"
    assert not alive(leftover)
    after = supervisor.forkserver_stats()
    walks, walked = after["walks"] - before["walks"], after["walked"] - before["walked"]
    assert walks >= 2  # the grace (TERM ignored) spans several ticks
    assert walked / walks < 5, f"{walked} processes read in {walks} walks: the 40 running trees were read"
    assert all(alive(psutil.Process(c.pid)) for c in quiet)


def test_an_exit_among_many_running_trees_checks_only_that_tree(supervisor: Supervisor) -> None:
    """Each leader's exit wakes the fork server through its pidfd: a SIGCHLD does not ``waitid`` every
    tree it holds (with 1000 running, that took a quarter of its CPU in the heartbeat bench)."""
    quiet = [
        supervisor.spawn(make_task(task_id=f"q{i}"), CommandSpec(argv=("sleep", "300")), worker_id="w")
        for i in range(40)
    ]
    before = supervisor.forkserver_stats()
    short = [
        supervisor.spawn(make_task(task_id=f"s{i}"), CommandSpec(argv=("true",)), worker_id="w")
        for i in range(10)
    ]
    for child in short:
        exit = child.wait(15)
        assert exit is not None and exit.exit_code == 0
        assert child.wait_gone(15)
    checks = supervisor.forkserver_stats()["waitids"] - before["waitids"]
    assert checks <= 2 * len(short), f"{checks} exit checks for {len(short)} exits among {len(quiet)} trees"
    assert all(alive(psutil.Process(c.pid)) for c in quiet)


def test_a_fork_server_whose_socket_is_above_fd_1023_serves_a_burst_of_requests(tmp_path: Path) -> None:
    """The fork server gets the runner's own fd number for its socket; a runner with ~1000 tasks (pipes
    for each) starting a new fork server hands it one above 1023, where select() cannot look."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"fd limit {soft}: cannot open fds above 1023")
    ballast = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        for supervisor in running_supervisor(tmp_path):
            assert supervisor._link.sock.fileno() > 1023  # the socket the fork server was handed
            sleeper = CommandSpec(argv=("sleep", "300"))
            children = [supervisor.spawn(make_task(task_id=f"t{i}"), sleeper, worker_id="x") for i in "abc"]
            _term_together(supervisor, children)  # select() raised here: the fork server died
            assert psutil.Process(supervisor.forkserver_pid).is_running()
    finally:
        for fd in ballast:
            os.close(fd)


_PTRACE_SEIZE = 0x4206


def _traced_by(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("TracerPid:"):
                return int(line.split()[1])
    return 0


def test_a_leader_exiting_while_traced_is_reported_once_its_tracer_lets_go(supervisor: Supervisor) -> None:
    """A traced leader's exit makes its pidfd readable, but only the tracer can wait for it until it
    has: the fork server must not spin on that pidfd (it falls back to SIGCHLD), and reports the exit
    once the tracer is done. The tracer is this test (PTRACE_SEIZE: the tracee runs on untouched)."""
    libc = ctypes.CDLL(None, use_errno=True)
    child = supervisor.spawn(make_task(), CommandSpec(argv=("sleep", "0.5")), worker_id="w")
    if libc.ptrace(_PTRACE_SEIZE, child.pid, None, None) != 0:
        pytest.skip(f"cannot trace here: {os.strerror(ctypes.get_errno())}")
    assert _traced_by(child.pid) == os.getpid()
    assert wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, 10)
    forkserver = psutil.Process(supervisor.forkserver_pid)
    busy_before = sum(forkserver.cpu_times()[:2])
    time.sleep(0.4)  # a window to measure CPU over (spinning, it used all of it), not a wait
    busy = sum(forkserver.cpu_times()[:2]) - busy_before
    assert busy < 0.1, f"the fork server used {busy:.2f} s of CPU in 0.4 s while only the tracer saw the exit"
    assert child.wait(0.1) is None  # not reported while only the tracer can see it
    os.waitpid(child.pid, 0)  # the tracer takes the exit: now the real parent is told
    exit = child.wait(15)
    assert exit is not None and exit.exit_code == 0
    assert child.wait_gone(15)


def test_a_task_ignores_nothing_the_fork_server_ignores_and_a_term_right_after_spawn_ends_it(
    supervisor: Supervisor,
) -> None:
    """The fork server ignores INT/TERM/HUP (and Python ignores PIPE/XFSZ), and an ignored signal stays
    ignored across exec: each task must start with every disposition at default, or a TERM sent right
    after the spawn (a runner stopped at once) is discarded and the task runs on until the KILL, a whole
    grace later."""
    with open(f"/proc/{supervisor.forkserver_pid}/status") as status:
        forkserver_ignored = int(next(x for x in status if x.startswith("SigIgn:")).split()[1], 16)
    assert forkserver_ignored & (1 << (signal.SIGTERM - 1)), "the fork server should ignore TERM"
    lines = Lines()
    show = CommandSpec(argv=("grep", "^SigIgn:", "/proc/self/status"))
    exit = supervisor.spawn(make_task(), show, worker_id="w", on_line=lines).wait(30)
    assert exit is not None and exit.exit_code == 0
    assert wait_until(lambda: lines.find("stdout", "SigIgn:") is not None, 10)
    line = lines.find("stdout", "SigIgn:")
    assert line is not None
    # Of the signals there are: glibc's posix_spawn leaves its two reserved ones (32, 33: thread
    # cancellation and set*id) ignored, and a C library's start-up takes them back for itself.
    usable = sum(1 << (sig - 1) for sig in signal.valid_signals())
    assert int(line.split()[1], 16) & usable == 0, line
    child = supervisor.spawn(make_task(), CommandSpec(argv=("sleep", "300")), worker_id="w")
    child.terminate_tree(grace_seconds=60)
    exit = child.wait(10)
    assert exit is not None, "the TERM was lost: the child waits for the KILL 60 s later"
    assert exit.signal == signal.SIGTERM


def test_a_task_starts_with_no_signal_blocked_whatever_the_runner_started_with(tmp_path: Path) -> None:
    """A mask passes through fork, posix_spawn and exec: a runner started with TERM blocked (by whatever
    started it) gave its fork server, and each task, a TERM that never arrives."""
    blocked = {signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        supervisors = running_supervisor(tmp_path)
        supervisor = next(supervisors)  # its fork server starts now, with our mask
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    try:
        lines = Lines()
        show = CommandSpec(argv=("grep", "^SigBlk:", "/proc/self/status"))
        child = supervisor.spawn(make_task(), show, worker_id="w", on_line=lines)
        exit = child.wait(30)
        assert exit is not None and exit.exit_code == 0
        assert wait_until(lambda: lines.find("stdout", "SigBlk:") is not None, 10)
        line = lines.find("stdout", "SigBlk:")
        assert line is not None and int(line.split()[1], 16) == 0, line
        # Nor the fork server (a blocked SIGCHLD would hide exits from it where it has no pidfds).
        with open(f"/proc/{supervisor.forkserver_pid}/status") as status:
            forkserver_blocked = next(x for x in status if x.startswith("SigBlk:"))
        assert int(forkserver_blocked.split()[1], 16) == 0, forkserver_blocked
    finally:
        supervisors.close()
