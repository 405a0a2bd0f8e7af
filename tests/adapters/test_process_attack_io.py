"""Adversarial review of process supervision: hostile output and hostile input, against real children."""

from __future__ import annotations

import errno
import json
import os
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.errors import SpawnError
from leasecore.models import TaskStatus
from leasecore.process import CommandSpec, Supervisor, to_task_result

from .process_support import Lines, make_task, running_supervisor, sample, spec


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def _python(code: str, **fields: object) -> CommandSpec:
    return CommandSpec(argv=(sys.executable, "-c", code), **fields)  # type: ignore[arg-type]


# --- output ------------------------------------------------------------------------------------


def test_300mb_on_stderr_while_stdout_stays_silent(supervisor: Supervisor) -> None:
    seen = {"stdout": 0, "stderr": 0}

    def count(stream: str, line: str) -> None:
        seen[stream] += 1

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    command = CommandSpec(shell="head -c 314572800 /dev/zero >&2; echo done")
    exit = supervisor.spawn(make_task(), command, worker_id="w", on_line=count).wait(240)
    assert exit is not None and exit.exit_code == 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024
    assert seen == {"stdout": 1, "stderr": 300 * 1024 * 1024 // (64 * 1024)}
    assert exit.stdout_tail == "done" and len(exit.stderr_tail) <= 64 * 1024


def test_binary_output_and_invalid_utf8_become_valid_json(supervisor: Supervisor) -> None:
    lines = Lines()
    code = (
        "import os, sys; os.write(1, b'ok \\xff\\xfe\\x00 bin\\n' + bytes(range(256)) + b'\\n'); "
        "os.write(2, b'\\xed\\xa0\\x80 lone surrogate bytes\\n')"
    )
    task = make_task()
    command = _python(code)
    exit = supervisor.spawn(task, command, worker_id="w", on_line=lines).wait(30)
    assert exit is not None and exit.exit_code == 0
    assert lines.items[0] == ("stdout", "ok \ufffd\ufffd\x00 bin")
    body = json.dumps(to_task_result(task, exit, command, worker_id="w").to_json(), ensure_ascii=False)
    body.encode("utf-8")  # strictly encodable: no lone surrogates reach the server
    assert "lone surrogate bytes" in body


def test_a_single_10mb_line_arrives_in_bounded_pieces(supervisor: Supervisor) -> None:
    sizes: list[int] = []
    command = CommandSpec(shell="head -c 10485760 /dev/zero | tr '\\0' a; echo")
    exit = supervisor.spawn(
        make_task(), command, worker_id="w", on_line=lambda _stream, line: sizes.append(len(line))
    ).wait(60)
    assert exit is not None and exit.exit_code == 0
    assert sum(sizes) == 10 * 1024 * 1024 and max(sizes) == 64 * 1024
    assert len(exit.stdout_tail) <= 64 * 1024 + 200


def test_closing_stdout_early_does_not_end_the_task(supervisor: Supervisor) -> None:
    code = (
        "import os, time; print('bye', flush=True); os.close(1); os.close(2); "
        "time.sleep(1.5); raise SystemExit(7)"
    )
    started = time.monotonic()
    exit = supervisor.spawn(make_task(), _python(code), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 7 and exit.stdout_tail == "bye"
    assert time.monotonic() - started >= 1.4  # the exit, not the EOF, ended it


def test_many_short_lines_are_all_delivered_fast(supervisor: Supervisor) -> None:
    count = [0]

    def sink(stream: str, line: str) -> None:
        count[0] += 1

    total = 1_000_000
    started = time.monotonic()
    exit = supervisor.spawn(make_task(), CommandSpec(shell=f"seq {total}"), worker_id="w", on_line=sink).wait(
        120
    )
    elapsed = time.monotonic() - started
    assert exit is not None and exit.exit_code == 0
    assert count[0] == total and exit.stdout_tail.endswith(f"\n{total}")
    print(f"{total / elapsed:,.0f} lines/s through on_line", file=sys.stderr)
    assert elapsed < 60


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        ('rm "$F"; mkfifo "$F"', "not a regular file"),
        ('rm "$F"; ln -s /etc/passwd "$F"', "is a symbolic link (not followed)"),
        ('head -c 5000000 /dev/zero > "$F"', "too large"),
        ('printf "{oops" > "$F"', "not valid JSON"),
        ('printf "[1, 2]" > "$F"', "must hold a JSON object, not an array"),
        ('rm "$F"; mkdir "$F"', "not a regular file"),
    ],
)
def test_hostile_output_files_fail_the_task_with_a_reason(
    supervisor: Supervisor, setup: str, expected: str
) -> None:
    command = CommandSpec(shell=f'F="$CONDUCTOR_OUTPUT_FILE"; {setup}')
    task = make_task()
    started = time.monotonic()
    exit = supervisor.spawn(task, command, worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0
    assert time.monotonic() - started < 10  # a FIFO never blocks the reader
    result = to_task_result(task, exit, command, worker_id="w")
    assert result.status == TaskStatus.FAILED
    assert result.reason_for_incompletion is not None
    assert expected in result.reason_for_incompletion
    assert "root:" not in json.dumps(result.to_json())  # /etc/passwd was not read


# --- input -------------------------------------------------------------------------------------


def test_hostile_keys_never_overwrite_the_task_variables(supervisor: Supervisor, tmp_path: Path) -> None:
    # "file" would become CONDUCTOR_INPUT_FILE: the input file's path must not be chosen by the input.
    task = make_task({"file": "/etc/passwd", "FILE": "/etc/shadow", "a-b": "1", "A_B": "2", "x y": "3"})
    exit = supervisor.spawn(task, spec(*sample("echo_input.py"), cwd=str(tmp_path)), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0, exit
    assert exit.output is not None
    assert exit.output["file_matches_stdin"] is True  # the real input file, not /etc/passwd
    env = exit.output["env"]
    assert "CONDUCTOR_INPUT_A_B" not in env  # two keys claim it: ambiguous, so neither is set
    assert env["CONDUCTOR_INPUT_X_Y"] == "3"


def test_awkward_values_are_passed_or_skipped_never_fatal(supervisor: Supervisor, tmp_path: Path) -> None:
    task = make_task(
        {
            "nul": "a\x00b",
            "surrogate": "bad \ud800 text",
            "nested": {"deep": [1, {"x": None}]},
            "unicode": "Grüße, 世界 🎉",
            "big": "B" * (1024 * 1024),
            "empty": "",
            "": "no name",
        }
    )
    exit = supervisor.spawn(task, spec(*sample("echo_input.py"), cwd=str(tmp_path)), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0, exit
    assert exit.output is not None and exit.output["file_matches_stdin"] is True
    env = exit.output["env"]
    assert env["CONDUCTOR_INPUT_UNICODE"] == "Grüße, 世界 🎉"
    assert env["CONDUCTOR_INPUT_EMPTY"] == ""
    for absent in ("NUL", "SURROGATE", "NESTED", "BIG"):
        assert f"CONDUCTOR_INPUT_{absent}" not in env


def test_many_keys_cannot_push_the_environment_past_exec_limits(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    task = make_task({f"key_{i:06d}_{'k' * 40}": "" for i in range(60_000)} | {"last": "x"})
    exit = supervisor.spawn(task, spec(*sample("echo_input.py"), cwd=str(tmp_path)), worker_id="w").wait(60)
    assert exit is not None and exit.exit_code == 0, exit
    assert exit.output is not None and exit.output["file_matches_stdin"] is True


def test_a_task_id_with_a_nul_byte_is_a_spawn_error_or_runs(supervisor: Supervisor) -> None:
    try:
        exit = supervisor.spawn(
            make_task(task_id="t\x00x"), CommandSpec(argv=("/bin/true",)), worker_id="w"
        ).wait(30)
    except SpawnError:
        return
    assert exit is not None and exit.exit_code == 0


def test_a_bad_spawn_request_fails_that_task_and_never_the_fork_server(supervisor: Supervisor) -> None:
    """The fork server calls posix_spawn itself: an argument it raises on (a NUL byte: ValueError, not
    OSError) killed it, and with it every task tree it held. The Supervisor refuses such a command
    first, and the fork server answers a request that gets through with a failure."""
    sleeper = supervisor.spawn(make_task(task_id="s"), CommandSpec(argv=("sleep", "300")), worker_id="w")
    forkserver = supervisor.forkserver_pid
    with pytest.raises(SpawnError, match="NUL byte"):
        supervisor.spawn(make_task(), CommandSpec(argv=("echo", "a\x00b")), worker_id="w")
    fds = [os.open(os.devnull, flags) for flags in (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)]
    try:
        reply = supervisor._call(
            {"op": "spawn", "key": "raw", "path": "/bin/echo", "argv": ["echo", "a\x00b"], "env": {},
             "cwd": "/", "token": "x" * 32, "grace": 1.0, "dir": ""}, fds,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    assert reply["op"] == "spawn_failed" and reply["errno"] == errno.EINVAL, reply
    assert supervisor.forkserver_pid == forkserver and sleeper.wait(0.1) is None  # nothing else ended
    exit = supervisor.spawn(make_task(), CommandSpec(argv=("true",)), worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0


HOSTILE_VALUES = ["$(touch pwned1)", "`touch pwned2`", "; touch pwned3", "* ?", "$((1+1))", "a'b\"c", "\\n"]


@pytest.mark.parametrize("form", ["argv", "shell"])
def test_input_is_never_executed_in_either_form(supervisor: Supervisor, tmp_path: Path, form: str) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "existing-file").write_text("")
    task = make_task({f"v{i}": value for i, value in enumerate(HOSTILE_VALUES)})
    script = (
        'for v in "$CONDUCTOR_INPUT_V0" "$CONDUCTOR_INPUT_V1" "$CONDUCTOR_INPUT_V2" "$CONDUCTOR_INPUT_V3" '
        '"$CONDUCTOR_INPUT_V4" "$CONDUCTOR_INPUT_V5" "$CONDUCTOR_INPUT_V6"; do printf "%s\\n" "$v"; done; '
        "cat > /dev/null"
    )
    if form == "shell":
        command = CommandSpec(shell=script, cwd=str(work))
    else:
        command = CommandSpec(argv=("/bin/sh", "-c", script), cwd=str(work))
    exit = supervisor.spawn(task, command, worker_id="w").wait(30)
    assert exit is not None and exit.exit_code == 0
    assert exit.stdout_tail.splitlines() == HOSTILE_VALUES
    assert sorted(p.name for p in work.iterdir()) == ["existing-file"]  # no glob, no pwned* file
