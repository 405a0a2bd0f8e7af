"""Spawns that go wrong between the request and its record: no answer in time, a fork server that
dies right after starting the command, a working directory through a symbolic link.

The fork server starts commands with posix_spawn, so no parent-death signal covers a command whose
tree the runner has not recorded yet; these are the windows that signal used to close.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import psutil
import pytest

from leasecore.errors import ProcessError, SpawnError
from leasecore.process import CommandSpec, Supervisor
from tests.daemons import Daemon
from tests.support import wait_until

from .process_support import (
    Lines,
    forkserver_boot_around_spawn,
    killing_leftovers,
    live_with_cmdline,
    make_task,
    spec,
)

# A sleep no other test, nor another run of this module on the machine, starts: how its processes are
# found (tests.daemons: 3217.<random digits>, which sleep reads as seconds).
MARK_SECONDS = Daemon(3217).argv[1]


def _ours() -> list[psutil.Process]:
    return live_with_cmdline(["sleep", MARK_SECONDS])


_no_leftovers = killing_leftovers(["sleep", MARK_SECONDS])


def test_a_spawn_answered_too_late_is_cleaned_up_and_its_command_killed(tmp_path: Path) -> None:
    """A spawn the fork server does not answer in time (a hung exec) fails that task; its pipes,
    directory and entry must not be left behind, and when the command does start later (the runner has
    reported the task FAILED by then, and the server will retry it) it is killed, not left running
    unrecorded. The fork server holds that spawn until the test opens a gate (a file)."""
    gate = tmp_path / "gate"
    boot = forkserver_boot_around_spawn(
        f"while {MARK_SECONDS!r} in argv and not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)")
    tasks_tmp = tmp_path / "task-tmp"
    tasks_tmp.mkdir()
    # 1 s for an answer: the held spawn is given up after it (the others are answered at once).
    with Supervisor(tmp_path / "state", tmp_dir=str(tasks_tmp), forkserver_boot=boot,
                    reply_timeout_seconds=1.0) as supervisor:  # fmt: skip
        child = supervisor.spawn(make_task(), CommandSpec(argv=("true",)), worker_id="w")
        first = child.wait(30)
        assert first is not None and first.exit_code == 0  # the fork server is up
        # Its tree's end, too: that opens the state record's journal (an fd kept from then on).
        assert child.wait_gone(30)
        fds_before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ProcessError, match="did not answer"):
            supervisor.spawn(make_task(), CommandSpec(argv=("sleep", MARK_SECONDS)), worker_id="w")
        gate.touch()  # the held spawn goes ahead now, after its task was given up
        assert list(tasks_tmp.iterdir()) == []
        assert len(os.listdir("/proc/self/fd")) <= fds_before
        assert wait_until(lambda: supervisor.forkserver_stats()["trees"] == 0, 15)
        assert not _ours()


@pytest.mark.parametrize("threads", [True, False], ids=["spawner-thread", "main-thread"])
def test_a_command_started_just_before_its_fork_server_died_is_killed(tmp_path: Path, threads: bool) -> None:
    """The fork server dies right after posix_spawn, before it could answer: the runner has no record
    of the tree yet, and no parent-death signal takes the command along. It is found by its marker
    token and killed."""
    boot = forkserver_boot_around_spawn(after="os._exit(1)", threads=threads)
    with Supervisor(tmp_path / "state", forkserver_boot=boot) as supervisor:
        with pytest.raises(SpawnError, match="fork server lost"):
            supervisor.spawn(make_task(), CommandSpec(argv=("sleep", MARK_SECONDS)), worker_id="w")
        assert wait_until(lambda: not _ours(), 10)


def test_a_working_directory_through_a_symbolic_link_means_what_chdir_makes_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    lines = Lines()
    with Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)}) as supervisor:
        pwd = CommandSpec(argv=("pwd", "-P"), cwd="link/..")
        exit = supervisor.spawn(make_task(), pwd, worker_id="w", on_line=lines).wait(30)
    assert exit is not None and exit.exit_code == 0, exit
    assert lines.find("stdout", "/") == os.path.realpath(tmp_path / "real")


def test_a_temp_dir_or_fd_table_that_fails_fails_the_task_not_the_runner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A full /tmp (ENOSPC) or no fd left (EMFILE) used to raise a bare OSError out of spawn, which
    # the runner only expects for bugs: it ended the run. Each is a SpawnError for this task now,
    # with nothing left behind, and the next spawn works.
    tasks_tmp = tmp_path / "not-yet"
    sup = Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)},
                     tmp_dir=str(tasks_tmp))
    try:
        with pytest.raises(SpawnError, match="cannot make the task's files"):
            sup.spawn(make_task({}), spec("true"), worker_id="w")
        tasks_tmp.mkdir()  # the temp dir is usable again
        real_pipe = os.pipe
        made: list[int] = []

        def pipe_then_emfile() -> tuple[int, int]:
            if made:
                raise OSError(errno.EMFILE, "Too many open files")
            fds = real_pipe()
            made.extend(fds)
            return fds

        monkeypatch.setattr(os, "pipe", pipe_then_emfile)
        with pytest.raises(SpawnError, match="output pipes: Too many open files"):
            sup.spawn(make_task({}), spec("true"), worker_id="w")
        monkeypatch.setattr(os, "pipe", real_pipe)
        for fd in made:  # the first pipe was closed again
            with pytest.raises(OSError):
                os.fstat(fd)
        assert not len(sup._trees) and not len(sup._inflight)
        assert list(tasks_tmp.iterdir()) == []
        exit_ = sup.spawn(make_task({}), spec("true"), worker_id="w").wait(30)
        assert exit_ is not None and exit_.exit_code == 0
    finally:
        sup.close()


def test_a_state_record_that_cannot_be_written_at_a_trees_end_stops_nothing(tmp_path: Path) -> None:
    # Found in review: 'gone' removed the tree's record before waking wait_gone, on the one reader
    # thread; a failing write (a full disk) left wait_gone waiting for ever. Now the tree still
    # ends, and the reader goes on to the next task.
    sup = Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)})
    try:
        def full(key: str) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        sup._trees.record.remove = full  # type: ignore[method-assign]
        child = sup.spawn(make_task({}), spec("true"), worker_id="w")
        assert child.wait(30) is not None
        assert child.wait_gone(30)
        again = sup.spawn(make_task({}), spec("true"), worker_id="w").wait(30)
        assert again is not None and again.exit_code == 0
    finally:
        sup.close()
