"""Pure parts of process supervision: line capture, the child's environment, result mapping."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
from pathlib import Path

import pytest

from leasecore.errors import SpawnError
from leasecore.models import TaskStatus
from leasecore.process import ChildExit, CommandSpec, build_child_env, to_task_result
from leasecore.process.forkserver.frames import encode_frame, send_frame, take_frames
from leasecore.process.spec import INPUT_ENV_VALUE_LIMIT_BYTES, input_env_name
from leasecore.process.supervisor.caches import ExecutablePaths, WorkingDirectories
from leasecore.process.supervisor.output import StreamCapture
from leasecore.process.supervisor.prepare import new_token, working_directory
from leasecore.process.taskfiles import OUTPUT_FILE_LIMIT_BYTES, read_output_file

from .process_support import make_task

# --- StreamCapture ---------------------------------------------------------------------------


def test_capture_splits_lines_across_chunks() -> None:
    lines: list[str] = []
    capture = StreamCapture(lines.append)
    for chunk in (b"hel", b"lo\nwor", b"ld\r\n", b"tail"):
        capture.feed(chunk)
    capture.close()
    assert lines == ["hello", "world", "tail"]
    assert capture.tail() == "hello\nworld\ntail"
    assert capture.last_line() == "tail"


def test_capture_cuts_a_line_without_newlines_into_bounded_pieces() -> None:
    lines: list[str] = []
    capture = StreamCapture(lines.append, max_line_bytes=10, tail_bytes=25)
    capture.feed(b"a" * 35)
    assert lines == ["a" * 10] * 3
    capture.feed(b"b\n")
    assert lines[-1] == "aaaaab"
    # The tail never holds more than its byte budget (at least one line).
    assert len(capture.tail().replace("\n", "")) <= 25


def test_capture_tail_keeps_the_last_lines_only() -> None:
    capture = StreamCapture(tail_lines=3)
    capture.feed(b"".join(f"line {i}\n".encode() for i in range(100)))
    assert capture.tail() == "line 97\nline 98\nline 99"
    assert capture.total_bytes == sum(len(f"line {i}\n") for i in range(100))


def test_capture_replaces_invalid_utf8() -> None:
    lines: list[str] = []
    capture = StreamCapture(lines.append)
    capture.feed(b"caf\xc3\xa9 \xff\n")
    assert lines == ["café \ufffd"]


# --- the child's environment -------------------------------------------------------------------


def _env(
    input_data: dict[str, object], base: dict[str, str] | None = None, **spec_fields: object
) -> dict[str, str]:
    return build_child_env(
        base or {"PATH": "/bin"},
        CommandSpec(argv=("x",), **spec_fields),  # type: ignore[arg-type]
        make_task(input_data, reference_name="ref", retry_count=2, poll_count=5),
        worker_id="host-1",
        input_file="/in.json",
        output_file="/out.json",
        tree_token="tok",
    )


def test_child_env_has_the_task_variables() -> None:
    env = _env({})
    assert env["CONDUCTOR_TASK_ID"] == "task-1"
    assert env["CONDUCTOR_WORKFLOW_ID"] == "wf-1"
    assert env["CONDUCTOR_TASK_TYPE"] == "demo"
    assert env["CONDUCTOR_TASK_REF_NAME"] == "ref"
    assert env["CONDUCTOR_RETRY_COUNT"] == "2"
    assert env["CONDUCTOR_POLL_COUNT"] == "5"
    assert env["CONDUCTOR_WORKER_ID"] == "host-1"
    assert env["CONDUCTOR_INPUT_FILE"] == "/in.json"
    assert env["CONDUCTOR_OUTPUT_FILE"] == "/out.json"
    assert env["PATH"] == "/bin"


def test_child_env_copies_scalars_only_with_normalised_names() -> None:
    env = _env(
        {"name": "x", "max-count": 3, "ratio": 0.5, "on": True, "obj": {"a": 1}, "arr": [1], "nil": None}
    )
    assert env["CONDUCTOR_INPUT_NAME"] == "x"
    assert env["CONDUCTOR_INPUT_MAX_COUNT"] == "3"
    assert env["CONDUCTOR_INPUT_RATIO"] == "0.5"
    assert env["CONDUCTOR_INPUT_ON"] == "true"
    for name in ("CONDUCTOR_INPUT_OBJ", "CONDUCTOR_INPUT_ARR", "CONDUCTOR_INPUT_NIL"):
        assert name not in env
    assert input_env_name("a.b c") == "CONDUCTOR_INPUT_A_B_C"


def test_child_env_skips_values_too_big_for_exec() -> None:
    env = _env({"big": "x" * (INPUT_ENV_VALUE_LIMIT_BYTES + 1), "small": "y"})
    assert "CONDUCTOR_INPUT_BIG" not in env
    assert env["CONDUCTOR_INPUT_SMALL"] == "y"


def test_child_env_input_keys_cannot_take_reserved_or_ambiguous_names() -> None:
    env = _env({"file": "/etc/passwd", "a-b": "1", "A_B": "2", "a.b": "3", "c": "4"})
    assert env["CONDUCTOR_INPUT_FILE"] == "/in.json"
    assert "CONDUCTOR_INPUT_A_B" not in env  # three keys claim it: none wins
    assert env["CONDUCTOR_INPUT_C"] == "4"


def test_child_env_drops_what_exec_cannot_carry() -> None:
    base = {"PATH": "/bin", "BAD": "x\ud800", "NUL": "a\0b"}
    env = _env({"s": "bad \ud800", "n": "a\0b", "ok": "Grüße 🎉"}, base)
    assert env["CONDUCTOR_INPUT_OK"] == "Grüße 🎉"
    assert not {"BAD", "NUL", "CONDUCTOR_INPUT_S", "CONDUCTOR_INPUT_N"} & set(env)
    weird_task = build_child_env(
        {}, CommandSpec(argv=("x",)), make_task(task_id="t\0x", workflow_id="w\udc80"), worker_id="w",
        input_file="/i", output_file="/o", tree_token="tok",
    )  # fmt: skip
    assert "CONDUCTOR_TASK_ID" not in weird_task and "CONDUCTOR_WORKFLOW_ID" not in weird_task
    for name, value in env.items():
        assert "\0" not in name + value
        (name + value).encode("utf-8")


def test_child_env_budget_counts_names_and_entries() -> None:
    many = {f"key_{i:06d}_{'k' * 40}": "" for i in range(50_000)}
    env = _env(many)
    added = [name for name in env if name.startswith("CONDUCTOR_INPUT_K")]
    assert 0 < len(added) < 50_000
    assert sum(len(n) + len(v) + 10 for n, v in env.items() if n in added) <= 256 * 1024


def test_child_env_never_carries_credentials() -> None:
    base = {
        "PATH": "/bin",
        "CONDUCTOR_AUTH_KEY": "k",
        "CONDUCTOR_AUTH_SECRET": "s",
        "conductor_auth_secret": "s",
        "MY_DB_PASSWORD": "p",
        "CONDUCTOR_INPUT_STALE": "old",
    }
    env = _env({}, base, secret_env_names=("MY_DB_*",), env={"CONDUCTOR_AUTH_TOKEN": "t", "EXTRA": "1"})
    assert not [name for name in env if "AUTH" in name.upper() or name == "MY_DB_PASSWORD"]
    assert "CONDUCTOR_INPUT_STALE" not in env
    assert env["EXTRA"] == "1"


def test_command_spec_needs_exactly_one_command() -> None:
    with pytest.raises(SpawnError):
        CommandSpec().command_argv()
    with pytest.raises(SpawnError):
        CommandSpec(argv=("a",), shell="b").command_argv()
    assert CommandSpec(shell="echo $X").command_argv() == ["/bin/sh", "-c", "echo $X"]


# --- result mapping ----------------------------------------------------------------------------


def _exit(code: int | None = 0, sig: int | None = None, **fields: object) -> ChildExit:
    return ChildExit(exit_code=code, signal=sig, duration_seconds=1.23456, **fields)  # type: ignore[arg-type]


SPEC = CommandSpec(
    argv=("x",), terminal_exit_codes=frozenset({2}), in_progress_exit_code=10, callback_after_seconds=30,
    exec_timeout_seconds=30,
)  # fmt: skip


@pytest.mark.parametrize(
    ("exit", "timed_out", "status", "reason"),
    [
        (_exit(0), False, TaskStatus.COMPLETED, None),
        (_exit(2, stderr_tail="a\nbad input\n\n"), False, TaskStatus.FAILED_WITH_TERMINAL_ERROR,
         "exit code 2: bad input"),
        (_exit(3, stderr_tail="disk full"), False, TaskStatus.FAILED, "exit code 3: disk full"),
        (_exit(4), False, TaskStatus.FAILED, "exit code 4 (nothing on stderr)"),
        (_exit(None, signal.SIGKILL), False, TaskStatus.FAILED, "killed by SIGKILL"),
        (_exit(None, signal.SIGTERM), True, TaskStatus.FAILED, "exec timeout after 30s"),
        (_exit(0, output_error="CONDUCTOR_OUTPUT_FILE is not valid JSON"), False, TaskStatus.FAILED,
         "CONDUCTOR_OUTPUT_FILE is not valid JSON"),
    ],
)  # fmt: skip
def test_exit_maps_to_status_and_reason(
    exit: ChildExit, timed_out: bool, status: TaskStatus, reason: str | None
) -> None:
    result = to_task_result(make_task(), exit, SPEC, worker_id="w", timed_out=timed_out)
    assert result.status == status
    assert result.reason_for_incompletion == reason
    assert result.worker_id == "w"
    assert result.callback_after_seconds == 0


def test_in_progress_exit_code_yields_with_callback() -> None:
    result = to_task_result(make_task(), _exit(10, output={"step": 1}), SPEC, worker_id="w")
    assert result.status == TaskStatus.IN_PROGRESS
    assert result.callback_after_seconds == 30
    assert result.to_json()["callbackAfterSeconds"] == 30
    assert result.output_data["step"] == 1


def test_output_data_merges_file_object_with_exit_facts() -> None:
    exit = _exit(0, output={"answer": 42, "exitCode": "spoofed"}, stdout_tail="out", stderr_tail="err")
    output = to_task_result(make_task(), exit, SPEC, worker_id="w").output_data
    assert output == {
        "answer": 42,
        "exitCode": 0,
        "signal": None,
        "durationSeconds": 1.235,
        "stdoutTail": "out",
        "stderrTail": "err",
        "resources": {"max_rss_bytes": None, "cpu_user_seconds": None, "cpu_system_seconds": None},
    }


def test_reason_is_bounded() -> None:
    result = to_task_result(make_task(), _exit(3, stderr_tail="e" * 5000), SPEC, worker_id="w")
    assert result.reason_for_incompletion is not None
    assert len(result.reason_for_incompletion) <= 500


# --- the output file ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "output", "error_part"),
    [
        (b"", None, None),
        (b"  \n", None, None),
        (b'{"a": [1, 2]}', {"a": [1, 2]}, None),
        (b"{not json", None, "not valid JSON"),
        (b"[1, 2]", None, "must hold a JSON object, not an array"),
        (b'"text"', None, "not a string"),
        (b"\xff\xfe garbage", None, "not valid JSON"),
    ],
)
def test_output_file_is_checked(
    tmp_path: Path, content: bytes, output: object, error_part: str | None
) -> None:
    path = tmp_path / "out.json"
    path.write_bytes(content)
    value, error = read_output_file(str(path))
    assert value == output
    if error_part is None:
        assert error is None
    else:
        assert error is not None and error_part in error


def test_output_file_size_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.write_text(json.dumps({"blob": "x" * OUTPUT_FILE_LIMIT_BYTES}))
    value, error = read_output_file(str(path))
    assert value is None and error is not None and "too large" in error


def test_output_file_missing_or_not_regular(tmp_path: Path) -> None:
    assert read_output_file(str(tmp_path / "absent.json")) == (None, None)
    (tmp_path / "target.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    value, error = read_output_file(str(tmp_path / "link.json"))
    assert value is None and error is not None
    (tmp_path / "dir.json").mkdir()
    assert read_output_file(str(tmp_path / "dir.json"))[1] is not None


def test_take_frames_takes_whole_messages_however_the_bytes_arrive() -> None:
    # Several messages in one read (an exit and its tree's end), one message over several reads.
    ours, theirs = socket.socketpair()
    with ours, theirs:
        send_frame(theirs, {"op": "exited", "key": "t1"})
        send_frame(theirs, {"op": "gone", "key": "t1"})
        body = json.dumps({"op": "spawned", "argv": ["x" * 200_000]}).encode()
        theirs.sendall(struct.pack(">I", len(body)) + body[:100])
        buffer = bytearray()
        while len(buffer) < 2 * 4 + 60:
            buffer += ours.recv(1 << 16)
        assert take_frames(buffer) == [{"op": "exited", "key": "t1"}, {"op": "gone", "key": "t1"}]
        assert take_frames(buffer) == []  # the third is not whole yet: kept
        theirs.sendall(body[100:])
        while not (messages := take_frames(buffer)):
            buffer += ours.recv(1 << 16)
        assert messages == [{"op": "spawned", "argv": ["x" * 200_000]}] and buffer == bytearray()
    with pytest.raises(ValueError):
        take_frames(bytearray(struct.pack(">I", 3) + b"{no"))


@pytest.mark.parametrize("message", [
    {"op": "exited", "key": "t1", "pid": 7, "code": None, "signal": 9, "oom_kills": 0, "switch": False,
     "resources": {"max_rss_bytes": 143360, "cpu_user_seconds": 0.1, "cpu_system_seconds": 1e-06}},
    {"op": "spawn", "env": {"NAME": "caf\u00e9 \"quoted\"\n\u2603"}, "argv": ["a", "", "\x00"],
     "kill_by": [1.5, 2.0], "nan": float("nan"), "big": 10**30, "nested": [[{}], []], "none": None},
])
def test_a_frame_is_the_text_json_dumps_makes(message: dict[str, object]) -> None:
    # The encoder is made once (frames._ENCODE), not by json.dumps at each call: the same bytes.
    frame = encode_frame(message)
    assert frame == struct.pack(">I", len(frame) - 4) + json.dumps(message).encode()
    with pytest.raises(TypeError):
        encode_frame({"op": "x", "what": object()})


def test_marker_tokens_drawn_ahead_are_each_new_and_a_forked_copy_draws_its_own() -> None:
    tokens = [new_token() for _ in range(1000)]  # several draws of 64
    assert len(set(tokens)) == len(tokens)
    assert all(len(token) == 32 and int(token, 16) >= 0 for token in tokens)
    new_token()  # some left over, which a forked child must not hand out again
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        os.write(write_end, new_token().encode())
        os._exit(0)
    os.close(write_end)
    in_child = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    ours = {new_token() for _ in range(64)}
    assert len(in_child) == 32 and in_child not in ours and in_child not in tokens


def test_a_working_directory_seen_is_not_looked_at_again_within_the_cache_time(tmp_path: Path) -> None:
    now = [100.0]
    cwds = WorkingDirectories(working_directory, 5.0, monotonic=lambda: now[0])
    there, gone = tmp_path / "there", tmp_path / "gone"
    there.mkdir()
    gone.mkdir()
    assert cwds.of(CommandSpec(argv=("true",), cwd=str(there))) == str(there)
    assert cwds.of(CommandSpec(argv=("true",), cwd=str(gone))) == str(gone)
    gone.rmdir()
    now[0] += 4.9
    assert cwds.of(CommandSpec(argv=("true",), cwd=str(gone))) == str(gone)  # kept: not looked at
    now[0] += 0.2
    with pytest.raises(SpawnError, match=r"working directory .*gone.* does not exist"):
        cwds.of(CommandSpec(argv=("true",), cwd=str(gone)))  # time over: looked at again
    with pytest.raises(SpawnError, match="does not exist"):  # a missing one is never kept
        cwds.of(CommandSpec(argv=("true",), cwd=str(gone)))
    assert cwds.of(CommandSpec(argv=("true",), cwd=str(there))) == str(there)
    every_time = WorkingDirectories(working_directory, 0.0, monotonic=lambda: now[0])
    assert every_time.of(CommandSpec(argv=("true",), cwd=str(there))) == str(there)
    there.rmdir()
    with pytest.raises(SpawnError, match="does not exist"):  # 0 s: looked at for every spawn
        every_time.of(CommandSpec(argv=("true",), cwd=str(there)))


def test_a_command_found_on_path_is_kept_for_the_cache_time_unless_it_is_gone(tmp_path: Path) -> None:
    now = [100.0]
    paths = ExecutablePaths(5.0, monotonic=lambda: now[0])
    dirs = {name: tmp_path / name for name in ("zeroth", "first", "second")}

    def install(name: str) -> str:
        dirs[name].mkdir(exist_ok=True)
        script = dirs[name] / "which-one"
        script.write_text("#!/bin/sh\n")
        script.chmod(0o755)
        return str(script)

    first = install("first")
    install("second")
    path_var = os.pathsep.join(str(d) for d in dirs.values())
    assert paths.find("which-one", path_var, "/") == first
    zeroth = install("zeroth")  # earlier on PATH, installed after the lookup
    now[0] += 4.9
    assert paths.find("which-one", path_var, "/") == first  # kept: no search within the cache time
    now[0] += 0.2
    assert paths.find("which-one", path_var, "/") == zeroth  # time over: searched again
    Path(zeroth).unlink()
    assert paths.find("which-one", path_var, "/") == first  # gone: searched again at once
    with pytest.raises(SpawnError, match="command not found: 'nowhere'"):
        paths.find("nowhere", path_var, "/")
