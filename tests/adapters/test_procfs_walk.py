"""The /proc walk the fork server makes at every exit, against real processes: the one-thread
shortcut (no listing of /proc/<pid>/task), zombies not descended into, and whole reads of long files."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from leasecore.process.linux import procfs
from tests.support import wait_until

pytestmark = pytest.mark.skipif(not procfs.IS_LINUX or not procfs.has_children_files(os.getpid()),
                                reason="needs Linux with /proc/<pid>/task/<tid>/children")

# A parent whose second thread starts a child and stays alive while its main thread only waits: the
# child is listed under that thread's children file, not the main thread's.
_THREADED_PARENT = """
import subprocess, sys, threading
def second():
    kid = subprocess.Popen(["sleep", "30"])
    print(kid.pid, flush=True)
    sys.stdin.read()
    kid.kill(); kid.wait()
t = threading.Thread(target=second)
t.start(); t.join()
"""


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def test_a_one_thread_process_is_read_as_the_listing_would(procs: list[subprocess.Popen[bytes]]) -> None:
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    procs.append(parent)
    wait_until(lambda: len(procfs.children_of(parent.pid)) == 2, timeout_seconds=10)
    info = procfs.read_stat(parent.pid)
    assert info is not None and info.threads == 1
    assert sorted(procfs.children_of(parent.pid, threads=1)) == sorted(procfs.children_of(parent.pid))
    found = procfs.walk([parent.pid])
    assert set(found) == {parent.pid, *procfs.children_of(parent.pid)}


def test_a_child_of_a_second_thread_is_found_by_the_walk(procs: list[subprocess.Popen[bytes]]) -> None:
    parent = subprocess.Popen([sys.executable, "-c", _THREADED_PARENT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    procs.append(parent)
    assert parent.stdout is not None
    grandchild = int(parent.stdout.readline())
    info = procfs.read_stat(parent.pid)
    assert info is not None and info.threads == 2
    assert grandchild not in procfs.children_of(parent.pid, threads=1)  # the main thread's file only
    found = procfs.walk([parent.pid])
    assert grandchild in found
    assert found[grandchild].ppid == parent.pid
    assert parent.stdin is not None
    parent.stdin.close()
    assert parent.wait(timeout=10) == 0


def test_a_zombie_is_listed_but_not_descended_into(
    procs: list[subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    child = subprocess.Popen(["true"])
    procs.append(child)  # reaped by the fixture: until then a zombie of ours
    wait_until(lambda: (info := procfs.read_stat(child.pid)) is not None and info.is_zombie,
               timeout_seconds=10)
    asked: list[int] = []
    real = procfs.children_of

    def counted(pid: int, **kw: int) -> list[int]:
        asked.append(pid)
        return real(pid, **kw)

    monkeypatch.setattr(procfs, "children_of", counted)
    found = procfs.walk([child.pid])
    assert found[child.pid].is_zombie and found[child.pid].threads == 1
    assert asked == []


def test_a_list_longer_than_one_read_is_read_whole(procs: list[subprocess.Popen[bytes]]) -> None:
    for _ in range(12):
        procs.append(subprocess.Popen(["sleep", "30"]))
    tid = threading.get_native_id()
    fd = os.open(f"/proc/{os.getpid()}/task/{tid}/children", os.O_RDONLY)
    try:
        whole = procfs.read_all(fd, size=8)  # "12345 " is 6 bytes or more: many reads
    finally:
        os.close(fd)
    listed = {int(part) for part in whole.split()}
    assert {proc.pid for proc in procs} <= listed
