"""The fork server starts a command as another user (fork, setgroups/setgid/setuid, exec)."""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.errors import SpawnError
from leasecore.process import Supervisor
from leasecore.process.linux.runas import resolve_run_as
from tests.support import wait_until

from .process_support import Lines, make_task, running_supervisor, spec

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root can run children as another user")

NOBODY = resolve_run_as("nobody")


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    yield from running_supervisor(tmp_path)


def test_the_child_runs_as_the_user_with_files_it_owns_in_a_directory_it_cannot_change(
    supervisor: Supervisor,
) -> None:
    lines = Lines()
    script = ('id -u; id -g; echo "$HOME $USER"; cat > /dev/null; dir=$(dirname "$CONDUCTOR_OUTPUT_FILE"); '
              'ls -ld "$dir"; touch "$dir/extra" 2>/dev/null && echo can-add || echo cannot-add; '
              'echo \'{"ok": true}\' > "$CONDUCTOR_OUTPUT_FILE"; '
              'grep -E "^(Uid|Gid|Groups):" /proc/self/status')
    child = supervisor.spawn(make_task({"a": 1}), spec("/bin/sh", "-c", script, cwd="/", run_as=NOBODY),
                             worker_id="w", on_line=lines)
    result = child.wait(timeout=30)
    assert result is not None and result.exit_code == 0, result
    out = [line for stream, line in lines.items if stream == "stdout"]
    assert out[:3] == [str(NOBODY.uid), str(NOBODY.gid), f"{NOBODY.home} nobody"]
    assert out[3].startswith("drwx--x---")  # the directory: root's, the group may only traverse it
    assert out[4] == "cannot-add"
    uids, gids, groups = (line.split()[1:] for line in out[5:8])
    assert set(uids) == {str(NOBODY.uid)} and set(gids) == {str(NOBODY.gid)}  # real, effective, saved
    assert groups == [str(g) for g in NOBODY.groups]  # root's supplementary groups are gone
    assert result.output == {"ok": True}


def test_task_files_belong_to_the_user_and_the_directory_to_the_runner(tmp_path: Path) -> None:
    from leasecore.process.taskfiles import TaskFiles

    files = TaskFiles.create(make_task({"a": 1}), parent=str(tmp_path), owner=(NOBODY.uid, NOBODY.gid))
    try:
        directory = os.stat(files.directory)
        assert (directory.st_uid, directory.st_gid, stat.S_IMODE(directory.st_mode)) == (0, NOBODY.gid, 0o710)
        for path in (files.input_path, files.output_path):
            st = os.stat(path)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (NOBODY.uid, NOBODY.gid, 0o600)
    finally:
        files.remove()


def test_the_secrets_file_belongs_to_the_user_who_alone_can_read_it(supervisor: Supervisor) -> None:
    lines = Lines()
    script = ('stat -c "%u %g %a" "$CONDUCTOR_SECRETS_FILE"; cat "$CONDUCTOR_SECRETS_FILE"; echo; '
              'echo "$API_TOKEN"')
    task = make_task(runtime_metadata={"API_TOKEN": "tok-run-as"})
    child = supervisor.spawn(task, spec("/bin/sh", "-c", script, cwd="/", run_as=NOBODY), worker_id="w",
                             on_line=lines)  # fmt: skip
    result = child.wait(timeout=30)
    assert result is not None and result.exit_code == 0, result
    out = [line for stream, line in lines.items if stream == "stdout"]
    assert out == [f"{NOBODY.uid} {NOBODY.gid} 600", '{"API_TOKEN": "tok-run-as"}', "tok-run-as"]


def test_an_exec_the_user_may_not_do_is_a_spawn_error_naming_the_step(
    supervisor: Supervisor, tmp_path: Path
) -> None:
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(SpawnError, match=r"Permission denied \(while doing chdir\)"):
        supervisor.spawn(make_task(), spec("/bin/true", cwd=str(private), run_as=NOBODY), worker_id="w")
    script = private / "job.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o755)
    with pytest.raises(SpawnError, match=r"Permission denied \(while doing exec\)"):
        supervisor.spawn(make_task(), spec(str(script), cwd="/", run_as=NOBODY), worker_id="w")


def test_the_users_tree_is_terminated_and_nothing_is_ignored(supervisor: Supervisor) -> None:
    lines = Lines()
    command = spec("/bin/sh", "-c", "grep SigIgn /proc/self/status; exec sleep 60", cwd="/", run_as=NOBODY)
    child = supervisor.spawn(make_task(), command, worker_id="w", on_line=lines)
    assert wait_until(lambda: lines.find("stdout", "SigIgn") is not None, 10)
    assert lines.find("stdout", "SigIgn") == "SigIgn:\t0000000000000000"  # INT/TERM/HUP not ignored
    child.terminate_tree(grace_seconds=5)
    result = child.wait(timeout=30)
    assert result is not None and result.signal == signal.SIGTERM
    assert wait_until(lambda: child.wait_gone(0), 10)
