"""``Supervisor.start``: a spawn that does not wait for the exec, as the runner uses it.

Its answer comes on the reader thread: ``on_started`` with the pid once the command runs, or
``on_done`` with a ``start_error`` when it never will (an exec that fails, no answer in time, a fork
server that dies first). A fork server held before its ``posix_spawn`` (until the test creates a
gate file) shows that ``start`` returned before the exec, and lets a signal overtake the answer.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import psutil
import pytest

from leasecore.errors import ProcessError
from leasecore.process import Child, ChildExit, CommandSpec, Supervisor
from leasecore.process.linux import procfs
from leasecore.process.supervisor.background import Chores
from leasecore.process.supervisor.forkserver_link import FORKSERVER_BOOT, REPLY_TIMEOUT_SECONDS
from leasecore.process.supervisor.supervisor import MAX_STARTING
from tests.daemons import Daemon
from tests.support import wait_until

from .process_support import (
    forkserver_boot_around_spawn,
    killing_leftovers,
    live_with_cmdline,
    make_task,
    spec,
)

# A sleep no other test, nor another run of this module on the machine, starts: how its processes are
# found (tests.daemons: 3218.<random digits>, which sleep reads as seconds).
MARK_SECONDS = Daemon(3218).argv[1]


def _ours() -> list[psutil.Process]:
    return live_with_cmdline(["sleep", MARK_SECONDS])


_no_leftovers = killing_leftovers(["sleep", MARK_SECONDS])


class Seen:
    """What one child's callbacks were called with, in order, and on which threads."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []
        self.threads: set[int] = set()
        self.done = threading.Event()
        self.started = threading.Event()

    def on_started(self, child: Child) -> None:
        self.threads.add(threading.get_ident())
        self.events.append(("started", child.pid))
        self.started.set()

    def on_done(self, exit_: ChildExit) -> None:
        self.threads.add(threading.get_ident())
        self.events.append(("done", exit_))
        self.done.set()

    def start(self, supervisor: Supervisor, command: CommandSpec, task_id: str = "task-1") -> Child:
        """``supervisor.start`` of ``command``, its callbacks reported here."""
        return supervisor.start(make_task(task_id=task_id), command, worker_id="w",
                                on_started=self.on_started, on_done=self.on_done)  # fmt: skip

    def exit(self) -> ChildExit:
        assert self.done.wait(30), self.events
        (exit_,) = [value for name, value in self.events if name == "done"]
        assert isinstance(exit_, ChildExit)
        return exit_


def _held_boot(gate: Path, *, threads: bool = True) -> str:
    """A fork server that holds the spawn of ``sleep MARK_SECONDS`` (only) until ``gate`` exists: on a
    spawner thread, or (``threads=False``) on its main thread, which then serves nothing meanwhile."""
    return forkserver_boot_around_spawn(
        f"while {MARK_SECONDS!r} in argv and not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)",
        threads=threads)


# 1 s for a spawn's answer (its reader checks the unanswered ones a third of that apart).
SHORT_REPLY_TIMEOUT_SECONDS = 1.0


def _supervisor(
    tmp_path: Path,
    *,
    boot: str = FORKSERVER_BOOT,
    reply_timeout_seconds: float = REPLY_TIMEOUT_SECONDS,
    max_starting: int = MAX_STARTING,
) -> Supervisor:
    tasks_tmp = tmp_path / "task-tmp"
    tasks_tmp.mkdir(exist_ok=True)
    return Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)},
                      tmp_dir=str(tasks_tmp), forkserver_boot=boot,
                      reply_timeout_seconds=reply_timeout_seconds, max_starting=max_starting)  # fmt: skip


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _warm(supervisor: Supervisor) -> None:
    """One task through it first: the state record's journal stays open from then on (fd counts)."""
    child = supervisor.spawn(make_task(), spec("true"), worker_id="w")
    assert child.wait(30) is not None and child.wait_gone(30)


def test_start_returns_before_the_exec_and_on_started_brings_the_pid(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    seen = Seen()
    with _supervisor(tmp_path, boot=_held_boot(gate)) as supervisor:
        child = seen.start(supervisor, spec("sleep", MARK_SECONDS))
        # The fork server has not even started it: start() did not wait for that.
        assert child.pid == 0 and not seen.started.is_set() and not _ours()
        gate.touch()
        assert seen.started.wait(30)
        ((name, pid),) = seen.events
        assert name == "started" and pid == child.pid > 0
        assert [p.pid for p in _ours()] == [child.pid]
        child.kill_tree()
        exit_ = seen.exit()
    assert exit_.signal == signal.SIGKILL and exit_.start_error is None
    assert [name for name, _ in seen.events] == ["started", "done"]
    assert seen.threads and threading.get_ident() not in seen.threads  # the reader thread's calls


def test_a_start_whose_exec_fails_ends_in_on_done_with_why_and_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "no-shebang"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    seen = Seen()
    with _supervisor(tmp_path) as supervisor:
        _warm(supervisor)
        fds = _fd_count()
        child = seen.start(supervisor, CommandSpec(argv=(str(script),)))
        exit_ = seen.exit()
        assert child.wait(0) is exit_ and child.wait_gone(0)
        assert not len(supervisor._inflight) and not len(supervisor._trees)
        assert _fd_count() <= fds
    assert [name for name, _ in seen.events] == ["done"]  # never "started"
    assert exit_.exit_code is None and exit_.signal is None
    assert exit_.start_error is not None and "Exec format error" in exit_.start_error
    assert "#!" in exit_.start_error
    assert list((tmp_path / "task-tmp").iterdir()) == []


@pytest.mark.parametrize("threads", [True, False], ids=["spawner-thread", "main-thread"])
def test_a_tree_signalled_before_its_start_is_answered_is_killed(tmp_path: Path, threads: bool) -> None:
    # The runner may fence a task whose start is still under way (shutdown, a lease lost): the fork
    # server takes requests in order, so the signal reaches the tree it starts just before; or, its
    # start on a spawner thread, waits for that tree and reaches it the moment it is held.
    gate = tmp_path / "gate"
    seen = Seen()
    with _supervisor(tmp_path, boot=_held_boot(gate, threads=threads)) as supervisor:
        child = seen.start(supervisor, spec("sleep", MARK_SECONDS))
        child.kill_tree()
        gate.touch()
        exit_ = seen.exit()
        assert child.wait_gone(30)
    assert exit_.signal == signal.SIGKILL
    assert not _ours()


def test_a_start_waiting_for_its_exec_on_a_spawner_thread_holds_up_no_other_task(tmp_path: Path) -> None:
    # What the spawner threads are for: a start whose command has not reached its exec (beside a busy
    # process, its vfork child waiting for a core) held up every other start, exit and kill of the
    # fork server while it waited on its main thread. On a spawner thread it holds up only itself.
    gate = tmp_path / "gate"
    held, quick, running = Seen(), Seen(), Seen()
    with _supervisor(tmp_path, boot=_held_boot(gate)) as supervisor:
        _warm(supervisor)
        sleeper = running.start(supervisor, spec("sleep", "300"), task_id="running")
        assert running.started.wait(30)
        held_child = held.start(supervisor, spec("sleep", MARK_SECONDS), task_id="held")
        quick.start(supervisor, spec("echo", "quick"), task_id="quick")
        assert quick.exit().exit_code == 0  # started, ran and ended while the other start waits
        sleeper.kill_tree()
        assert running.exit().signal == signal.SIGKILL  # a kill went through too
        assert not held.started.is_set() and not _ours()
        gate.touch()
        assert held.started.wait(30)
        held_child.kill_tree()
        assert held.exit().signal == signal.SIGKILL
        assert supervisor.forkserver_stats()["spawner_threads"] >= 1


def test_the_fork_server_takes_to_spawner_threads_when_its_starts_wait_for_their_exec(tmp_path: Path) -> None:
    # Its own rule (no threads forced): each posix_spawn made to wait 3 ms for its exec, as beside a
    # busy process; after some such starts on its main thread it starts them on spawner threads.
    boot = forkserver_boot_around_spawn(after="time.sleep(0.003)", threads=None)
    with _supervisor(tmp_path, boot=boot) as supervisor:
        assert supervisor.forkserver_stats()["spawner_threads"] == 0
        for i in range(40):
            seen = Seen()
            seen.start(supervisor, spec("true"), task_id=f"t{i}")
            assert seen.exit().exit_code == 0
        assert supervisor.forkserver_stats()["spawner_threads"] >= 1


def test_a_start_left_unanswered_fails_after_the_reply_timeout_and_its_late_command_is_killed(
    tmp_path: Path,
) -> None:
    gate = tmp_path / "gate"
    seen = Seen()
    with _supervisor(tmp_path, boot=_held_boot(gate),
                     reply_timeout_seconds=SHORT_REPLY_TIMEOUT_SECONDS) as supervisor:  # fmt: skip
        _warm(supervisor)
        fds = _fd_count()
        seen.start(supervisor, spec("sleep", MARK_SECONDS))
        exit_ = seen.exit()  # the reader thread gives it up: nobody waits on this start
        assert exit_.start_error == "the fork server did not answer a spawn request"
        assert list((tmp_path / "task-tmp").iterdir()) == []
        assert _fd_count() <= fds
        gate.touch()  # it starts now, after its task was given up: it must not run on
        assert wait_until(lambda: supervisor.forkserver_stats()["trees"] == 0, 15)
        assert wait_until(lambda: not _ours(), 10)
    assert [name for name, _ in seen.events] == ["done"]


@pytest.mark.parametrize("threads", [True, False], ids=["spawner-thread", "main-thread"])
def test_a_start_under_way_when_the_fork_server_dies_ends_and_its_command_is_killed(
    tmp_path: Path, threads: bool
) -> None:
    seen = Seen()
    boot = forkserver_boot_around_spawn(after="os._exit(1)", threads=threads)
    with _supervisor(tmp_path, boot=boot) as supervisor:
        seen.start(supervisor, spec("sleep", MARK_SECONDS))
        exit_ = seen.exit()
        assert exit_.start_error is not None and "fork server lost" in exit_.start_error
        assert wait_until(lambda: not _ours(), 10)
    assert [name for name, _ in seen.events] == ["done"]


def test_many_starts_in_flight_at_once_each_run_once_and_end(tmp_path: Path) -> None:
    # Starts queue up at the fork server unanswered (the caller does not wait between them); each
    # answer must find its own child, pipes and output.
    count = 40
    seen = [Seen() for _ in range(count)]
    lines: dict[int, list[str]] = {i: [] for i in range(count)}
    with _supervisor(tmp_path) as supervisor:
        children = []
        for i in range(count):
            children.append(supervisor.start(
                make_task(task_id=f"t{i}"), spec("echo", f"child {i}"), worker_id="w",
                on_started=seen[i].on_started, on_done=seen[i].on_done,
                on_lines=lambda _stream, got, i=i: lines[i].extend(got),
            ))  # fmt: skip
        exits = [s.exit() for s in seen]
    assert all(e.exit_code == 0 and e.start_error is None for e in exits)
    assert all(e.stdout_tail == f"child {i}" for i, e in enumerate(exits))
    assert all(lines[i] == [f"child {i}"] for i in range(count))
    assert all([name for name, _ in s.events] == ["started", "done"] for s in seen)
    pids = [c.pid for c in children]
    assert len(set(pids)) == count and all(pid > 0 for pid in pids)
    assert list((tmp_path / "task-tmp").iterdir()) == []


def test_start_waits_while_the_fork_server_is_a_full_queue_behind(tmp_path: Path) -> None:
    # Spawns queued at the fork server are bounded: beyond max_starting unanswered ones, start()
    # waits for an answer, so a runner's claims follow what actually starts.
    gate = tmp_path / "gate"
    seen = [Seen() for _ in range(4)]
    with _supervisor(tmp_path, boot=_held_boot(gate), max_starting=3) as supervisor:

        def start(i: int) -> Child:
            return seen[i].start(supervisor, spec("sleep", MARK_SECONDS), task_id=f"t{i}")

        children = [start(i) for i in range(3)]  # the first is held in the fork server; two queue behind
        fourth: list[Child] = []
        waiting = threading.Thread(target=lambda: fourth.append(start(3)), daemon=True)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not fourth  # a window: it must still be waiting for room
        gate.touch()
        waiting.join(30)
        assert fourth and all(s.started.wait(30) for s in seen)
        for child in [*children, *fourth]:
            child.kill_tree()
        assert all(s.exit().signal == signal.SIGKILL for s in seen)


def test_given_up_starts_still_count_against_the_bound_until_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A start given up is still queued at the (stalled) fork server: feeding it more would fail every
    # task polled meanwhile and start each one late. So they count until their late answer comes.
    gate = tmp_path / "gate"
    seen = [Seen() for _ in range(2)]
    sent_from: list[str] = []
    with _supervisor(tmp_path, boot=_held_boot(gate), max_starting=2,
                     reply_timeout_seconds=SHORT_REPLY_TIMEOUT_SECONDS) as supervisor:  # fmt: skip
        real_request = supervisor._request

        def request(message: dict[str, object], fds: list[int] | None = None, **how: object) -> None:
            if message.get("op") == "signal":
                sent_from.append(threading.current_thread().name)
            real_request(message, fds, **how)  # type: ignore[arg-type]

        monkeypatch.setattr(supervisor, "_request", request)
        _warm(supervisor)
        for i in range(2):
            seen[i].start(supervisor, spec("sleep", MARK_SECONDS), task_id=f"t{i}")
        assert all(s.exit().start_error == "the fork server did not answer a spawn request" for s in seen)
        with pytest.raises(ProcessError, match="has not answered its last 2 spawn requests"):
            supervisor.start(make_task(task_id="t2"), spec("true"), worker_id="w")
        gate.touch()  # both start now, late: each is killed, and their room is free again
        assert wait_until(lambda: len(sent_from) == 2, 15)
        assert wait_until(lambda: supervisor.forkserver_stats()["trees"] == 0, 15)
        assert wait_until(lambda: not _ours(), 10)
        last = Seen()
        last.start(supervisor, spec("true"), task_id="t3")
        assert last.exit().exit_code == 0
    # The late kills were sent from the chores thread: a send may block, and the reader must not.
    assert sent_from == ["supervisor-chores", "supervisor-chores"]


def test_a_given_up_start_is_killed_when_its_fork_server_dies_before_answering(tmp_path: Path) -> None:
    # The fork server starts a command whose start was given up, then dies before its answer: the
    # tree was in no record; it is known by its marker token and killed with the fork server's trees.
    gate = tmp_path / "gate"
    boot = forkserver_boot_around_spawn(
        f"while {MARK_SECONDS!r} in argv and not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)",
        f"if {MARK_SECONDS!r} in argv:\n    os._exit(1)")
    seen = Seen()
    with _supervisor(tmp_path, boot=boot,
                     reply_timeout_seconds=SHORT_REPLY_TIMEOUT_SECONDS) as supervisor:  # fmt: skip
        _warm(supervisor)
        seen.start(supervisor, spec("sleep", MARK_SECONDS))
        assert seen.exit().start_error == "the fork server did not answer a spawn request"
        gate.touch()
        assert wait_until(lambda: bool(_ours()) or supervisor._lost, 10)
        assert wait_until(lambda: not _ours(), 10)


def test_a_child_whose_pipes_cannot_be_watched_still_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Registering a child's pipes with the reader's epoll can fail (out of epoll watches): its
    # output is lost, said in the log, but its exit must still end the task, not strand it for ever.
    seen = Seen()
    with _supervisor(tmp_path) as supervisor:
        _warm(supervisor)
        reader = supervisor._output
        real_watch = reader._watch

        def watch(fd: int, whose: object) -> None:
            if isinstance(whose, Child):
                raise OSError(28, "No space left on device")
            real_watch(fd, whose)  # type: ignore[arg-type]

        monkeypatch.setattr(reader, "_watch", watch)
        fds = _fd_count()
        seen.start(supervisor, spec("sh", "-c", "exit 3"))
        exit_ = seen.exit()
        assert exit_.exit_code == 3 and exit_.start_error is None
        assert wait_until(lambda: _fd_count() <= fds, 10)


def test_a_start_that_fails_on_a_bug_leaves_nothing_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _supervisor(tmp_path) as supervisor:
        _warm(supervisor)
        fds = _fd_count()

        def broken(message: dict[str, object], fds: list[int] | None = None, **how: object) -> None:
            raise RuntimeError("a bug in sending")

        monkeypatch.setattr(supervisor, "_request", broken)
        with pytest.raises(RuntimeError, match="a bug in sending"):
            supervisor.start(make_task(), spec("true"), worker_id="w")
        assert not len(supervisor._inflight) and not len(supervisor._trees)
        assert _fd_count() <= fds
        assert list((tmp_path / "task-tmp").iterdir()) == []
        monkeypatch.undo()  # the close below talks to the fork server


def test_chores_run_on_their_thread_then_inline_once_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    chores = Chores()
    ran_on: list[str] = []
    done = threading.Event()
    chores.submit(lambda: (ran_on.append(threading.current_thread().name), done.set()))
    assert done.wait(10)
    chores.submit(lambda: 1 / 0)  # a failing chore is logged; the thread goes on to the next
    chores.submit(lambda: ran_on.append(threading.current_thread().name))
    chores.close(10)
    chores.submit(lambda: ran_on.append(threading.current_thread().name))
    assert ran_on == ["supervisor-chores", "supervisor-chores", threading.current_thread().name]
    unstartable = Chores()

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    unstartable.submit(lambda: ran_on.append("inline"))
    assert ran_on[-1] == "inline"
    unstartable.close(1)


def test_an_urgent_chore_goes_before_the_rmtrees_waiting() -> None:
    # A late-started command's kill must not wait behind the removal of directories children filled.
    chores = Chores()
    order: list[str] = []
    release = threading.Event()
    busy = threading.Event()

    def first() -> None:
        busy.set()
        release.wait(10)
        order.append("first")

    chores.submit(first)
    assert busy.wait(10)
    chores.submit(lambda: order.append("rmtree"))
    chores.submit(lambda: order.append("kill"), urgent=True)
    release.set()
    chores.close(10)
    assert order == ["first", "kill", "rmtree"]


@pytest.mark.parametrize("threads", [True, False])
def test_each_recorded_start_time_is_the_leaders_own_though_most_were_not_read(
    tmp_path: Path, threads: bool
) -> None:
    # The fork server takes a posix_spawned leader's start time from its boot clock read around the
    # spawn (``procfs.StartTimes``); the record that a later sweep trusts must still be /proc's.
    starts = 30
    with _supervisor(tmp_path, boot=forkserver_boot_around_spawn(threads=threads)) as supervisor:
        children = []
        for i in range(starts):
            seen = Seen()
            children.append((seen.start(supervisor, spec("sleep", MARK_SECONDS), task_id=f"t{i}"), seen))
            assert seen.started.wait(30)
        recorded = {tree.pid: tree.start_time for tree in supervisor._trees.trees()}
        assert len(recorded) == starts
        for pid, start_time in recorded.items():
            info = procfs.read_stat(pid)
            assert info is not None and info.start_time == start_time
        stats = supervisor.forkserver_stats()
        assert not stats["start_times_off"]
        assert stats["start_times_read"] < starts  # the first few checked, most never read
        for child, seen in children:
            child.kill_tree()
            assert seen.exit().signal == signal.SIGKILL
    assert not _ours()
