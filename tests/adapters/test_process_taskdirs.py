"""Where a task's private files go (``taskfiles.TaskDirs``): a tmpfs where one is usable, the temp dir
for a memory-limited tree, a user's own TMPDIR always, and the disk when the tmpfs is full."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from leasecore.limits import Limits
from leasecore.process import CommandSpec, Supervisor
from leasecore.process.taskfiles import SHM_DIR, TaskDirs, TaskFiles, _is_tmpfs

from .process_support import make_task

ROOT = Path(__file__).resolve().parents[2]
BARE_ENV = {"PATH": os.environ.get("PATH", os.defpath)}  # no TMPDIR, TEMP or TMP


def _shm_usable() -> bool:
    return TaskDirs.pick(environ=BARE_ENV).fast is not None


def test_the_mount_table_tells_a_tmpfs_from_a_disk(tmp_path: Path) -> None:
    if not _is_tmpfs(SHM_DIR):
        pytest.skip(f"{SHM_DIR} is no tmpfs on this machine")
    assert _is_tmpfs(SHM_DIR + "/") and _is_tmpfs(os.path.join(SHM_DIR, "not-there-yet"))
    assert not _is_tmpfs("/proc/self")  # proc, not tmpfs
    assert _is_tmpfs(str(tmp_path)) is _is_tmpfs(tempfile.gettempdir())


def test_a_directory_chosen_by_the_embedder_or_the_user_is_used_for_every_task(tmp_path: Path) -> None:
    chosen = TaskDirs.pick(str(tmp_path), environ=BARE_ENV)
    assert chosen == TaskDirs(str(tmp_path)) and chosen.parent(False) == chosen.parent(True) == str(tmp_path)
    for name in ("TMPDIR", "TEMP", "TMP"):  # tempfile.gettempdir() reads these: the user's choice
        named = TaskDirs.pick(environ={**BARE_ENV, name: str(tmp_path)})
        assert named.fast is None, name
        assert named.disk == tempfile.gettempdir()


def test_without_a_user_choice_a_writable_tmpfs_takes_the_trees_without_a_memory_limit() -> None:
    if not _is_tmpfs(SHM_DIR) or _is_tmpfs(tempfile.gettempdir()):
        pytest.skip(f"needs a tmpfs {SHM_DIR} and a temp dir that is not one")
    dirs = TaskDirs.pick(environ=BARE_ENV)
    assert dirs == TaskDirs(tempfile.gettempdir(), SHM_DIR)
    assert dirs.parent(memory_limited=False) == SHM_DIR
    assert dirs.parent(memory_limited=True) == tempfile.gettempdir()
    not_tmpfs = TaskDirs.pick(environ=BARE_ENV, shm="/proc/self")
    assert not_tmpfs == TaskDirs(tempfile.gettempdir())


def test_a_child_finds_its_files_on_the_tmpfs_and_a_memory_limited_one_on_the_disk(tmp_path: Path) -> None:
    if not _shm_usable():
        pytest.skip(f"no usable tmpfs at {SHM_DIR}, or the temp dir is one already")
    dirs = TaskDirs.pick(environ=BARE_ENV)
    shell = ('printf "%s %s" "$CONDUCTOR_INPUT_FILE" "$CONDUCTOR_OUTPUT_FILE"; '
             'echo "{\\"ok\\": 1}" > "$CONDUCTOR_OUTPUT_FILE"')
    with Supervisor(tmp_path / "state", environ=BARE_ENV) as sup:
        assert sup.task_dirs == dirs
        plain = sup.spawn(make_task({"a": 1}), CommandSpec(shell=shell), worker_id="w").wait(30)
        limited_spec = CommandSpec(shell=shell, limits=Limits(memory_max=1 << 30))
        limited = sup.spawn(make_task({"a": 2}), limited_spec, worker_id="w").wait(30)
    assert plain is not None and plain.exit_code == 0 and plain.output == {"ok": 1}, plain
    assert limited is not None and limited.exit_code == 0 and limited.output == {"ok": 1}, limited
    in_shm = plain.stdout_tail.split()
    on_disk = limited.stdout_tail.split()
    assert all(Path(p).parent.parent == Path(SHM_DIR) for p in in_shm), in_shm
    assert all(Path(p).parent.parent == Path(dirs.disk) for p in on_disk), on_disk
    assert not any(Path(p).parent.exists() for p in in_shm + on_disk)  # removed after use


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and unshare for a tmpfs of the test's own")
def test_a_full_tmpfs_sends_the_task_to_the_disk_instead(tmp_path: Path) -> None:
    """A real full tmpfs (64 KiB, mounted by this test in a mount namespace of its own): a task whose
    input does not fit gets its files on the disk; one that fits stays on the tmpfs."""
    small = tmp_path / "small-tmpfs"
    small.mkdir()
    disk = tmp_path / "disk"
    disk.mkdir()
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from leasecore.process.taskfiles import TaskDirs, TaskFiles
        from tests.adapters.process_support import make_task
        dirs = TaskDirs({str(disk)!r}, {str(small)!r})
        fits = TaskFiles.create_in(dirs, make_task({{"a": "x" * 100}}), memory_limited=False,
                                   unique="ab" * 16)
        big = TaskFiles.create_in(dirs, make_task({{"a": "x" * 200_000}}), memory_limited=False,
                                  unique="cd" * 16)
        print(json.dumps([fits.directory, big.directory, len(open(big.input_path).read())]))
        fits.remove(); big.remove()
        """)
    mount = (f'mount -t tmpfs -o size=64k,mode=1777 conductor-run-test {small} '
             f'&& exec {sys.executable} -c "$0"')
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, script]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0 and "mount" in done.stderr.lower() and "permission" in done.stderr.lower():
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    fits_dir, big_dir, size = json.loads(done.stdout)
    assert Path(fits_dir).parent == small
    assert Path(big_dir).parent == disk and size > 200_000
    assert list(disk.iterdir()) == []  # removed (the tmpfs went with its namespace)


def test_create_in_raises_what_is_not_a_full_tmpfs(tmp_path: Path) -> None:
    gone = TaskDirs(str(tmp_path / "disk-missing"), str(tmp_path / "shm-missing"))
    with pytest.raises(FileNotFoundError):  # not ENOSPC: no fallback, the spawn fails saying why
        TaskFiles.create_in(gone, make_task({"a": 1}), memory_limited=False, unique="ef" * 16)
