"""The task's output and checkpoint files left empty are told by one ``lstat`` (``plainly_empty``);
anything else (a link to an empty file, a FIFO, a directory, a file this process may not open) is
still opened and refused or read as before, by real children; and a child's pipes, closed at EOF
without a last read when epoll says they hold nothing, lose no byte."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.process import CommandSpec, Supervisor
from leasecore.process.taskfiles import TaskFiles, plainly_empty, read_output_file

from .process_support import make_task, running_supervisor


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def test_only_an_empty_regular_file_is_plainly_empty(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.touch(mode=0o600)
    full = tmp_path / "full"
    full.write_text("{}")
    link = tmp_path / "link"
    link.symlink_to(empty)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    directory = tmp_path / "dir"
    directory.mkdir()
    assert plainly_empty(str(empty))
    for path in (full, link, fifo, directory, tmp_path / "missing"):
        assert not plainly_empty(str(path)), path
    # what the shortcut passes on is read as before: the link is refused, not taken as empty
    assert read_output_file(str(link)) == (None, "CONDUCTOR_OUTPUT_FILE is a symbolic link (not followed): "
                                           "write the JSON into the file itself")  # fmt: skip
    assert read_output_file(str(empty)) == (None, None)
    assert read_output_file(str(full)) == ({}, None)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_for_another_user_an_empty_file_it_may_not_read_is_opened_as_before() -> None:
    """A non-root runner whose child made its empty output unreadable gets the open's error, as
    before the shortcut (root opens anything, so only the uid and mode bits are looked at)."""
    shared = Path(tempfile.mkdtemp())  # (pytest's tmp_path sits in a directory only root may enter)
    shared.chmod(0o777)
    code = (
        "import os, sys\n"
        "from leasecore.process.taskfiles import TaskFiles, plainly_empty, read_output_file\n"
        "os.setgid(65534); os.setuid(65534)  # (everything imported first: the stdlib may be root's)\n"
        "path = os.path.join(sys.argv[1], 'out')\n"
        "os.mknod(path, 0o600 | 0o100000)\n"
        "readable = plainly_empty(path)\n"
        "os.chmod(path, 0)\n"
        "print(readable, plainly_empty(path), read_output_file(path)[1])\n"
    )
    try:
        done = subprocess.run([sys.executable, "-c", code, str(shared)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert stat.S_IMODE(os.lstat(shared / "out").st_mode) == 0
    finally:
        shutil.rmtree(shared)
    refused = "CONDUCTOR_OUTPUT_FILE could not be read: Permission denied\n"
    assert done.stdout.split(" ", 2) == ["True", "False", refused]


def test_a_child_that_links_its_files_to_empty_ones_is_still_refused(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.touch()
    out, checkpoint = '"$CONDUCTOR_OUTPUT_FILE"', '"$CONDUCTOR_CHECKPOINT_FILE"'
    shell = f"rm {out} {checkpoint}; ln -s {empty} {out}; ln -s {empty} {checkpoint}"
    exit = supervisor.spawn(make_task(), CommandSpec(shell=shell), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0
    assert exit.output is None
    assert exit.output_error is not None and "symbolic link (not followed)" in exit.output_error
    assert exit.checkpoint is not None and exit.checkpoint.error is not None
    assert "symbolic link (not followed)" in exit.checkpoint.error


def test_a_child_that_leaves_both_files_empty_has_no_output_and_no_checkpoint(supervisor: Supervisor) -> None:
    exit = supervisor.spawn(make_task(), CommandSpec(shell="true"), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0
    assert exit.output is None and exit.output_error is None
    assert exit.checkpoint is not None and exit.checkpoint.text is None and exit.checkpoint.error is None
    shell = 'printf \'{"a": 1}\' > "$CONDUCTOR_OUTPUT_FILE"; printf 7 > "$CONDUCTOR_CHECKPOINT_FILE"'
    written = supervisor.spawn(make_task(), CommandSpec(shell=shell), worker_id="w").wait(30)
    assert written is not None and written.output == {"a": 1}
    assert written.checkpoint is not None and written.checkpoint.value == 7


def test_every_byte_a_short_child_writes_before_its_exit_is_read(supervisor: Supervisor) -> None:
    """A pipe at EOF is closed without a read only when it holds nothing (EPOLLHUP without EPOLLIN):
    30 children at once write on both streams and exit at once, their last bytes unterminated."""
    loop = 'i=0; while [ $i -lt 200 ]; do echo "o$i"; echo "e$i" >&2; i=$((i+1)); done'
    shell = f"{loop}; printf END; printf ERR >&2"
    lines: dict[str, list[str]] = {}

    def sink(stream: str, line: str, bucket: dict[str, list[str]] = lines) -> None:
        bucket.setdefault(stream, []).append(line)

    children = [supervisor.start(make_task(), CommandSpec(shell=shell), worker_id="w") for _ in range(30)]
    for child in children:
        exit = child.wait(60)
        assert exit is not None and exit.exit_code == 0
        assert exit.stdout_tail.endswith("o199\nEND") and exit.stderr_tail.endswith("e199\nERR")
    one = supervisor.spawn(make_task(), CommandSpec(shell=shell), worker_id="w", on_line=sink).wait(60)
    assert one is not None
    assert lines["stdout"] == [f"o{i}" for i in range(200)] + ["END"]
    assert lines["stderr"] == [f"e{i}" for i in range(200)] + ["ERR"]


def test_task_directories_are_named_as_os_path_join_would_in_any_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory's name is kept per absolute parent; a relative parent still follows the cwd."""
    for where in ("a", "b"):
        (tmp_path / where / "tasks").mkdir(parents=True)
        monkeypatch.chdir(tmp_path / where)
        for parent in ("tasks", str(tmp_path / where / "tasks") + "/", str(tmp_path / where / "tasks")):
            files = TaskFiles.create(make_task({"k": "v"}), parent=parent, unique="0123456789abcdef" + where)
            try:
                expected = str(tmp_path / where / "tasks" / "conductor-run-task-0123456789abcdef")
                assert files.directory == expected
                assert files.input_path == os.path.join(expected, "input.json")
                assert Path(files.input_path).read_bytes() == b'{"k": "v"}'
                assert stat.S_IMODE(os.lstat(files.output_path).st_mode) == 0o600
                assert stat.S_IMODE(os.lstat(files.directory).st_mode) == 0o700
            finally:
                files.remove()
            assert not os.path.exists(files.directory)
    empty = TaskFiles.create(make_task({}), parent=str(tmp_path))
    try:
        assert Path(empty.input_path).read_bytes() == b"{}"
    finally:
        empty.remove()


def test_a_child_whose_pipe_outlives_it_is_finished_after_the_drain_time(tmp_path: Path) -> None:
    """A member left holding stdout (its own background process) does not hold the task: the child
    is finished once its drain time after the exit is over, with what it wrote; two at once."""
    sup = Supervisor(tmp_path / "state", environ={"PATH": os.environ.get("PATH", os.defpath)},
                     output_drain_seconds=0.5)  # fmt: skip
    try:
        # The member ignores the TERM its tree gets at the leader's exit: it holds the pipe till the KILL.
        shell = "echo first; (trap '' TERM; sleep 30; echo never) & sleep 0.2; exit 0"
        command = CommandSpec(shell=shell, kill_grace_seconds=30.0)
        started = time.monotonic()
        children = [sup.start(make_task(), command, worker_id="w") for _ in range(2)]
        for child in children:
            exit = child.wait(20)
            assert exit is not None and exit.exit_code == 0
            assert exit.stdout_tail == "first"
        assert time.monotonic() - started < 15  # the drain time, not the sleep
        for child in children:
            child.kill_tree()
            assert child.wait_gone(20)
    finally:
        sup.close()
