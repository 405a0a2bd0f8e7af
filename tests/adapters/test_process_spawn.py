"""Spawning real children: the child's interface, hostile input, output, spawn errors, cleanup."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from leasecore.errors import SpawnError
from leasecore.models import TaskStatus
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.taskfiles import TaskFiles
from tests.support import wait_until

from .process_support import Lines, make_task, running_supervisor, sample, spec


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


HOSTILE = {
    "subst": "$(touch pwned-subst)",
    "backticks": "`touch pwned-tick`",
    "quotes": 'it\'s "quoted" ; touch pwned-semi',
    "newlines": "line1\nline2\n; touch pwned-nl",
    "glob": "* ?",
    "big": "B" * (1024 * 1024),
}


def test_child_sees_input_on_stdin_file_and_env(supervisor: Supervisor, tmp_path: Path) -> None:
    task = make_task({"name": "Ada", "count": 3, "nested": {"a": [1, 2]}})
    child = supervisor.spawn(task, spec(*sample("echo_input.py"), cwd=str(tmp_path)), worker_id="w1")
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0, exit
    assert exit.output is not None
    assert exit.output["stdin"] == {"name": "Ada", "count": 3, "nested": {"a": [1, 2]}}
    assert exit.output["file_matches_stdin"] is True
    assert exit.output["env"] == {"CONDUCTOR_INPUT_NAME": "Ada", "CONDUCTOR_INPUT_COUNT": "3"}
    assert exit.output["task_id"] == "task-1"
    assert exit.stdout_tail == "echoed 3 input keys"


def test_hostile_input_is_data_never_code(tmp_path: Path) -> None:
    environ = {"PATH": os.environ["PATH"], "CONDUCTOR_AUTH_KEY": "key", "CONDUCTOR_AUTH_SECRET": "secret"}
    with Supervisor(None, environ=environ) as sup:
        task = make_task(HOSTILE)
        # A shell command that expands the inputs, quoted, as a careful script would.
        shell = 'printf "%s" "$CONDUCTOR_INPUT_SUBST" "$CONDUCTOR_INPUT_BACKTICKS"; cat >/dev/null'
        shelled = sup.spawn(task, CommandSpec(shell=shell, cwd=str(tmp_path)), worker_id="w")
        echoed = sup.spawn(task, spec(*sample("echo_input.py"), cwd=str(tmp_path)), worker_id="w")
        shell_exit, echo_exit = shelled.wait(30), echoed.wait(30)
    assert shell_exit is not None and shell_exit.exit_code == 0
    assert shell_exit.stdout_tail == HOSTILE["subst"] + HOSTILE["backticks"]
    assert echo_exit is not None and echo_exit.output is not None
    canonical = json.dumps(HOSTILE, sort_keys=True).encode()
    assert echo_exit.output["stdin_sha256"] == hashlib.sha256(canonical).hexdigest()  # 1 MB included
    assert echo_exit.output["file_matches_stdin"] is True
    env = echo_exit.output["env"]
    for key in ("subst", "backticks", "quotes", "newlines", "glob"):
        assert env[f"CONDUCTOR_INPUT_{key.upper()}"] == HOSTILE[key]
    assert "CONDUCTOR_INPUT_BIG" not in env  # too big for exec's limits: stdin / file only
    assert echo_exit.output["auth_vars"] == []
    assert list(tmp_path.iterdir()) == []  # nothing was executed: no pwned-* files


def test_exit_codes_map_to_statuses(supervisor: Supervisor) -> None:
    command = CommandSpec(argv=sample("failer.sh"), terminal_exit_codes=frozenset({2}))
    results = {}
    for code in (0, 2, 3):
        task = make_task({"code": code})
        exit = supervisor.spawn(task, command, worker_id="w").wait(30)
        assert exit is not None
        results[code] = to_task_result(task, exit, command, worker_id="w")
    assert results[0].status == TaskStatus.COMPLETED
    assert results[2].status == TaskStatus.FAILED_WITH_TERMINAL_ERROR
    assert results[3].status == TaskStatus.FAILED
    assert results[3].reason_for_incompletion == "exit code 3: could not reach the widget service"
    assert results[3].output_data["stdoutTail"] == "working..."


def test_in_progress_exit_code(supervisor: Supervisor) -> None:
    command = CommandSpec(argv=sample("in_progress.sh"), in_progress_exit_code=10, callback_after_seconds=5)
    early, late = make_task({"polls": 2}, poll_count=1), make_task({"polls": 2}, poll_count=2)
    first = supervisor.spawn(early, command, worker_id="w").wait(30)
    second = supervisor.spawn(late, command, worker_id="w").wait(30)
    assert first is not None and second is not None
    yielded = to_task_result(early, first, command, worker_id="w")
    assert (yielded.status, yielded.callback_after_seconds) == (TaskStatus.IN_PROGRESS, 5)
    done = to_task_result(late, second, command, worker_id="w")
    assert done.status == TaskStatus.COMPLETED and done.output_data["ready"] is True


def _failed_for(supervisor: Supervisor, command: CommandSpec) -> str:
    """Run ``command`` (it exits 0); its result must be FAILED: the reason."""
    task = make_task()
    exit = supervisor.spawn(task, command, worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0 and exit.output is None
    result = to_task_result(task, exit, command, worker_id="w")
    assert result.status == TaskStatus.FAILED and result.reason_for_incompletion is not None
    return result.reason_for_incompletion


def test_invalid_output_file_fails_the_task(supervisor: Supervisor) -> None:
    reason = _failed_for(supervisor, CommandSpec(shell='echo "[1, 2" > "$CONDUCTOR_OUTPUT_FILE"'))
    assert reason.startswith("CONDUCTOR_OUTPUT_FILE is not valid JSON")


@pytest.mark.parametrize(
    ("shell", "reason"),
    [
        ('echo \'{"x": NaN}\' > "$CONDUCTOR_OUTPUT_FILE"',
         "CONDUCTOR_OUTPUT_FILE is not valid JSON: NaN is not a JSON value"),
        ('echo \'{"x": -Infinity}\' > "$CONDUCTOR_OUTPUT_FILE"',
         "CONDUCTOR_OUTPUT_FILE is not valid JSON: -Infinity is not a JSON value"),
    ],
    ids=["nan", "infinity"],  # a symbolic link: tests/adapters/test_process_attack_io.py
)  # fmt: skip
def test_an_output_file_the_server_could_not_take_fails_the_task_saying_why(
    supervisor: Supervisor, shell: str, reason: str
) -> None:
    # NaN/Infinity: Python's json reads them and writes them back, a Java server refuses them.
    assert _failed_for(supervisor, CommandSpec(shell=shell)) == reason


@pytest.mark.parametrize("depth", [300, 990, 1500, 100_000])
def test_an_output_file_nested_too_deep_fails_the_task(supervisor: Supervisor, depth: int) -> None:
    # A few KB of brackets made json.loads raise RecursionError, which is not a ValueError: the task
    # was never finished (no report, its slot and its lease held, a stop waiting for ever).
    command = CommandSpec(argv=(sys.executable, "-c", f"""
import os
with open(os.environ["CONDUCTOR_OUTPUT_FILE"], "w") as f:
    f.write('{{"a": ' + '[' * {depth} + ']' * {depth} + '}}')
"""))  # fmt: skip
    assert _failed_for(supervisor, command).startswith("CONDUCTOR_OUTPUT_FILE is not valid JSON: nested too")


def test_an_input_nested_too_deep_to_write_back_is_a_spawn_error(supervisor: Supervisor) -> None:
    # Parsed on the poller's thread, written to the input file on the runner's main thread (deeper
    # stack): a RecursionError there escaped the runner's spawn error handling (review).
    deep: list[Any] = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(SpawnError, match="the task's input is nested too deeply to pass on"):
        supervisor.spawn(make_task({"deep": deep}), CommandSpec(argv=("true",)), worker_id="w")


def test_a_task_whose_files_cannot_be_read_still_finishes(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whatever goes wrong reading the output file, the child is finished (result, files removed):
    # an exception there used to leave it unfinished for ever.
    def broken(self: Any) -> tuple[None, str]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(TaskFiles, "read_output", broken)
    task = make_task()
    child = supervisor.spawn(task, CommandSpec(argv=("true",)), worker_id="w")
    exit = child.wait(30)
    assert exit is not None and exit.exit_code == 0 and exit.output is None
    assert exit.output_error == "CONDUCTOR_OUTPUT_FILE could not be read (internal error: RuntimeError)"
    assert not os.path.exists(child._files.directory)
    assert to_task_result(task, exit, CommandSpec(argv=("true",)), worker_id="w").status == TaskStatus.FAILED


def test_lines_stream_to_the_sink_while_the_child_runs(supervisor: Supervisor) -> None:
    lines = Lines()
    command = CommandSpec(shell="echo one; echo two >&2; read -r _ < /dev/null; sleep 30")
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    try:
        assert wait_until(lambda: ("stdout", "one") in lines.items and ("stderr", "two") in lines.items, 15)
        assert not child.exited
    finally:
        child.kill_tree()
    exit = child.wait(30)
    assert exit is not None and exit.stdout_tail == "one" and exit.stderr_tail == "two"


def test_one_output_thread_reads_every_child_and_keeps_their_output_apart(supervisor: Supervisor) -> None:
    # Given 12 children at once, each printing its own lines on both streams, one of them silent
    # until the others are done (its pipes stay registered while theirs come and go)
    sinks = [Lines() for _ in range(12)]
    slow = supervisor.spawn(
        make_task(), CommandSpec(shell="sleep 1; echo late"), worker_id="w", on_line=sinks[0]
    )
    children = [
        supervisor.spawn(
            make_task(),
            CommandSpec(shell=f"for i in 1 2 3; do echo out{n}-$i; echo err{n}-$i >&2; done"),
            worker_id="w",
            on_line=sinks[n],
        )
        for n in range(1, 12)
    ]
    # Then one thread reads them all
    readers = [t for t in threading.enumerate() if t.name == "child-output"]
    assert len(readers) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("output-")]
    # And every child's lines reached its own sink only, in order, and its own tails
    for n, child in enumerate(children, start=1):
        exit = child.wait(30)
        assert exit is not None and exit.exit_code == 0
        assert [line for stream, line in sinks[n].items if stream == "stdout"] == [
            f"out{n}-{i}" for i in (1, 2, 3)
        ]
        assert [line for stream, line in sinks[n].items if stream == "stderr"] == [
            f"err{n}-{i}" for i in (1, 2, 3)
        ]
        assert (exit.stdout_tail, exit.stderr_tail) == (
            f"out{n}-1\nout{n}-2\nout{n}-3",
            f"err{n}-1\nerr{n}-2\nerr{n}-3",
        )
    late = slow.wait(30)
    assert late is not None and late.stdout_tail == "late" and sinks[0].items == [("stdout", "late")]


def test_temporary_files_are_private_and_removed(supervisor: Supervisor) -> None:
    command = CommandSpec(
        shell='stat -c "%a" "$(dirname "$CONDUCTOR_INPUT_FILE")" "$CONDUCTOR_INPUT_FILE"'
        ' "$CONDUCTOR_OUTPUT_FILE"; echo "$CONDUCTOR_INPUT_FILE"'
    )
    exit = supervisor.spawn(make_task({"a": 1}), command, worker_id="w").wait(30)
    assert exit is not None
    modes_and_path = exit.stdout_tail.splitlines()
    assert modes_and_path[:3] == ["700", "600", "600"]
    assert not Path(modes_and_path[3]).exists()
    assert not Path(modes_and_path[3]).parent.exists()


def test_a_task_directory_named_by_its_token_falls_back_when_the_name_is_taken(tmp_path: Path) -> None:
    # Named by the tree's random token (no mkdtemp draw per task); a name already there, even a
    # symlink to somewhere else, is never used: mkdtemp picks another.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "conductor-run-task-0123456789abcdef").symlink_to(elsewhere)
    taken = TaskFiles.create(make_task({"a": 1}), parent=str(tmp_path), unique="0123456789abcdef" * 2)
    fresh = TaskFiles.create(make_task({"a": 2}), parent=str(tmp_path), unique="fedcba9876543210" * 2)
    try:
        assert Path(fresh.directory) == tmp_path / "conductor-run-task-fedcba9876543210"
        assert Path(taken.directory).parent == tmp_path and not Path(taken.directory).is_symlink()
        assert Path(taken.directory).name.startswith("conductor-run-task-")
        assert list(elsewhere.iterdir()) == []
        assert json.loads(Path(taken.input_path).read_text()) == {"a": 1}
        assert (Path(fresh.directory).stat().st_mode & 0o777) == 0o700
    finally:
        taken.remove()
        fresh.remove()
    assert not Path(taken.directory).exists() and not Path(fresh.directory).exists()


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (CommandSpec(argv=("no-such-command-xyz",)), "command not found"),
        (CommandSpec(argv=("./script-without-shebang",)), "Exec format error.*#!"),
        (CommandSpec(argv=("true",), cwd="/no/such/dir"), "does not exist"),
        (CommandSpec(), "exactly one"),
    ],
)
def test_spawn_errors_are_clear(
    command: CommandSpec,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    script = tmp_path / "script-without-shebang"
    script.write_text("echo hi\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    # A private parent for the task's temporary directory: other tests (and other pytest runs on
    # this machine) create and remove their own in the shared /tmp at the same time.
    tasks_tmp = tmp_path / "task-tmp"
    tasks_tmp.mkdir()
    environ = {"PATH": os.environ.get("PATH", os.defpath)}
    with Supervisor(tmp_path / "state", environ=environ, tmp_dir=str(tasks_tmp)) as supervisor:
        with pytest.raises(SpawnError) as raised:  # an exec failure too: posix_spawn returns its errno
            supervisor.spawn(make_task(), command, worker_id="w")
        assert re.search(message, str(raised.value)), raised.value
    assert list(tasks_tmp.iterdir()) == []  # the task's files are gone, whatever failed


def test_a_300mb_flood_without_newlines_keeps_memory_bounded(supervisor: Supervisor) -> None:
    counts = {"stdout": 0, "stderr": 0}
    longest = [0]

    def count(stream: str, line: str) -> None:  # keeps nothing: only the runner's memory is measured
        counts[stream] += 1
        longest[0] = max(longest[0], len(line))

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    exit = supervisor.spawn(make_task(), spec(*sample("flooder.py")), worker_id="w", on_line=count).wait(240)
    assert exit is not None and exit.exit_code == 0, exit
    rss_growth_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert rss_growth_kib < 50 * 1024, f"runner grew by {rss_growth_kib} KiB for a 300 MB flood"
    assert len(exit.stdout_tail) <= 64 * 1024
    assert exit.stderr_tail.endswith("flood done")
    assert counts["stdout"] == 300 * 1024 * 1024 // (64 * 1024)
    assert longest[0] == 64 * 1024
    print(f"300 MB flood read in {time.monotonic() - started:.1f}s", file=sys.stderr)


def test_json_output_stays_small(supervisor: Supervisor) -> None:
    command = CommandSpec(shell='yes "a line of output" | head -c 5000000; yes err | head -c 3000000 >&2')
    task = make_task()
    exit = supervisor.spawn(task, command, worker_id="w").wait(60)
    assert exit is not None
    body = json.dumps(to_task_result(task, exit, command, worker_id="w").to_json())
    assert len(body) < 300 * 1024


def test_a_relative_working_directory_is_the_same_one_for_every_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server changes its own directory to each task's before the spawn: a relative ``cwd``
    must be taken from the runner's directory every time, not from the last task's."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path)
    for supervisor in running_supervisor(tmp_path):
        for _ in range(2):
            lines = Lines()
            pwd = CommandSpec(argv=("pwd",), cwd="work")
            exit = supervisor.spawn(make_task(), pwd, worker_id="w", on_line=lines).wait(30)
            assert exit is not None and exit.exit_code == 0, exit
            assert wait_until(lambda lines=lines: lines.find("stdout", "/") is not None, 10)
            assert lines.find("stdout", "/") == str(tmp_path / "work")


def test_a_task_directory_the_child_filled_is_removed_whole(supervisor: Supervisor) -> None:
    """The directory is removed with three calls when it holds only our two files; files and
    directories the child added there (and an output file it replaced by a directory) are removed
    too."""
    lines = Lines()
    command = CommandSpec(
        shell='d=$(dirname "$CONDUCTOR_INPUT_FILE"); echo "dir $d"; mkdir -p "$d/sub/deeper"; '
        'touch "$d/sub/x" "$d/y"; rm "$CONDUCTOR_OUTPUT_FILE"; mkdir "$CONDUCTOR_OUTPUT_FILE"'
    )
    exit = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines).wait(30)
    assert exit is not None and exit.exit_code == 0, exit
    line = lines.find("stdout", "dir ")
    assert line is not None
    assert wait_until(lambda: not Path(line.split(" ", 1)[1]).exists(), 10)  # removed off the reader


def test_a_command_found_on_path_is_looked_up_again_once_it_is_gone(tmp_path: Path) -> None:
    """A PATH search is cached for a few seconds (a stat per directory per task otherwise), but never
    past the command's removal: the next spawn finds the copy further down PATH. With the cache time
    over (``path_cache_seconds``; 0 here), a copy installed in an earlier directory is picked up."""
    dirs = [tmp_path / name for name in ("first", "second", "zeroth")]
    for directory in dirs:
        directory.mkdir()

    def install(directory: Path) -> None:
        script = directory / "which-one"
        script.write_text(f"#!/bin/sh\necho {directory.name}\n")
        script.chmod(0o755)

    def run(supervisor: Supervisor) -> str | None:
        lines = Lines()
        which = CommandSpec(argv=("which-one",))
        exit = supervisor.spawn(make_task(), which, worker_id="w", on_line=lines).wait(30)
        assert exit is not None and exit.exit_code == 0, exit
        assert wait_until(lambda: lines.items, 10)
        return lines.items[0][1]

    install(dirs[0])
    install(dirs[1])
    path_var = os.pathsep.join(str(d) for d in (dirs[2], dirs[0], dirs[1], "/usr/bin", "/bin"))
    with Supervisor(tmp_path / "state", environ={"PATH": path_var}) as supervisor:
        assert run(supervisor) == "first"
        (dirs[0] / "which-one").unlink()
        assert run(supervisor) == "second"
    with Supervisor(tmp_path / "state", environ={"PATH": path_var}, path_cache_seconds=0.0) as supervisor:
        assert run(supervisor) == "second"  # found, and kept no time
        install(dirs[2])
        assert run(supervisor) == "zeroth"


def test_a_working_directory_removed_within_the_cache_time_still_fails_the_spawn(tmp_path: Path) -> None:
    """The working directory, seen to exist, is not looked at again for ``path_cache_seconds``: one
    removed meanwhile fails the next spawn in the fork server's chdir, with nothing left behind."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    where = CommandSpec(argv=("true",), cwd=str(workdir))
    files = tmp_path / "files"
    files.mkdir()
    with Supervisor(tmp_path / "state", tmp_dir=str(files), path_cache_seconds=600.0) as supervisor:
        exit = supervisor.spawn(make_task(), where, worker_id="w").wait(30)
        assert exit is not None and exit.exit_code == 0, exit
        workdir.rmdir()
        with pytest.raises(SpawnError, match=r"No such file or directory \(while doing chdir\)"):
            supervisor.spawn(make_task(task_id="task-2"), where, worker_id="w")
        assert wait_until(lambda: not list(files.iterdir()), 10)  # its task files removed
    with Supervisor(tmp_path / "state", path_cache_seconds=0.0) as supervisor, \
            pytest.raises(SpawnError, match=r"working directory .* does not exist"):  # fmt: skip
        supervisor.spawn(make_task(task_id="task-3"), where, worker_id="w")


def test_each_command_spec_gets_its_own_environment(supervisor: Supervisor) -> None:
    """The inherited part of the environment is computed once per spec and kept: two specs (two
    task types) must each keep theirs, and a secret named by one is not dropped for the other."""
    specs = [
        CommandSpec(shell='echo "v=$FLAVOUR k=${KEPT-unset}"', env={"FLAVOUR": "one", "KEPT": "yes"}),
        CommandSpec(shell='echo "v=$FLAVOUR k=${KEPT-unset}"', env={"FLAVOUR": "two", "KEPT": "no"},
                    secret_env_names=("KEPT",)),
    ]
    seen = []
    for command in [*specs, *specs]:
        lines = Lines()
        exit = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines).wait(30)
        assert exit is not None and exit.exit_code == 0, exit
        assert wait_until(lambda lines=lines: lines.find("stdout", "v=") is not None, 10)
        seen.append(lines.find("stdout", "v="))
    assert seen == ["v=one k=yes", "v=two k=unset"] * 2


def test_a_filled_task_directory_is_removed_off_the_reader_thread(
    supervisor: Supervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Removing a directory the child filled is unbounded work (rmtree of whatever it left): it must
    not hold the reader thread, which every other task's output, exit and spawn answer go through.
    Here that removal is held until the test lets it go; another task still ends meanwhile."""
    release = threading.Event()
    held: list[str] = []
    real_rmtree = shutil.rmtree

    def held_rmtree(path: str, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(str(path)).startswith("conductor-run-task-"):
            held.append(str(path))
            release.wait(30)
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", held_rmtree)
    try:
        filler = CommandSpec(shell='touch "$(dirname "$CONDUCTOR_INPUT_FILE")/left-behind"')
        first = supervisor.spawn(make_task(task_id="filler"), filler, worker_id="w").wait(30)
        assert first is not None and first.exit_code == 0, first
        assert wait_until(lambda: bool(held), 10)  # its directory's removal is under way, and held
        second = supervisor.spawn(make_task(task_id="next"), spec("true"), worker_id="w").wait(30)
        assert second is not None and second.exit_code == 0, second
        assert os.path.exists(held[0])
    finally:
        release.set()
    assert wait_until(lambda: not os.path.exists(held[0]), 10)
