"""Linux process facts from /proc, and signals that cannot hit a recycled pid.

Owns the reading of ``/proc/<pid>/stat``, ``environ`` (the tree marker), ``children`` and ``status``
(resident memory), an exited child's rusage from its zombie (``zombie_rusage``), of
``/proc/self/mountinfo`` (``mounts``, ``fstype_of``), a child's start time from the boot clock read
around its spawn (``StartTimes``, checked against /proc), the walks built on them (a subtree, the
descendants of a set, the live ones), the boot id, and the three ways to signal: ``signal_verified`` (a
pidfd opened *before* re-checking the start time: once open it names that exact process, so a pid
recycled between the scan and the signal is never hit), ``signal_all`` over a scan's processes,
``killpg_quietly``. Every function tolerates processes that vanish while being read (they are simply
left out).

Must not touch: any state of its own beyond the cached boot id (a ``StartTimes`` is its caller's), and
the rest of the package: it is stdlib only and light, since the fork server imports it (no
``dataclasses``: it pulls in ``inspect`` and friends, resident in the fork server for as long as the
runner lives).

Threads: the fork server's (under its lock); on the runner's side the sweep (``leftovers.py``, at start
and when the fork server died: the reader thread) and ``Child.memory_bytes`` (any caller).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

IS_LINUX = sys.platform.startswith("linux")
_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> None:
    """Make the calling process a child subreaper (Linux; elsewhere nothing): orphans below it
    (a setsid'ed daemon, a double fork) are re-parented to it instead of to init."""
    if IS_LINUX:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


class Mount(NamedTuple):
    """One line of ``/proc/self/mountinfo``: the mounted root, where, the type, the super options."""

    root: str
    point: str
    fstype: str
    options: frozenset[str]


def mounts(mountinfo: str) -> list[Mount]:
    """The mounts of a ``/proc/<pid>/mountinfo`` text, in its order (a later one over an earlier)."""
    found = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        options = frozenset(tail[2].split(","))
        found.append(Mount(_unescape(fields[3]), _unescape(fields[4]), tail[0], options))
    return found


def _unescape(text: str) -> str:
    return text.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def fstype_of(path: str) -> str | None:
    """The type of the file system ``path`` is on (its deepest mount, symlinks resolved); None when
    the mount table cannot be read."""
    try:
        with open("/proc/self/mountinfo") as handle:
            table = mounts(handle.read())
    except OSError:
        return None
    real = os.path.realpath(path)
    best: Mount | None = None
    for mount in table:
        inside = real == mount.point or real.startswith(mount.point.rstrip("/") + "/")
        if inside and (best is None or len(mount.point) >= len(best.point)):
            best = mount
    return None if best is None else best.fstype

# The variable every task tree carries (a random token per task): escapees that left the process
# group and lost their parent are still recognised by it, by the fork server and by the leftover sweep.
TREE_MARKER = "CONDUCTOR_RUN_TREE"


class ProcInfo(NamedTuple):
    """One process as seen in /proc/<pid>/stat."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    start_time: int  # clock ticks since boot: (pid, start_time) names one process for ever
    state: str
    threads: int = 0  # its threads when read (0: not known); 1 lets a walk skip /proc/<pid>/task

    @property
    def is_zombie(self) -> bool:
        return self.state in ("Z", "X")


@functools.cache
def boot_id() -> str:
    """This boot of the kernel (a random id, new at every boot; "" elsewhere than Linux). A pid and
    start time (clock ticks since boot) name one process only within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def read_stat(pid: int) -> ProcInfo | None:
    """The process ``pid`` as /proc shows it now, or None when it is gone (or not Linux)."""
    try:  # os-level: a buffered open() costs four more syscalls, and this runs for every task and scan
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)  # a few hundred bytes; procfs hands a small file over in one read
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data:
        return None
    # The command name is in parentheses and may itself contain ") ": split at the last one.
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcInfo(
        pid=pid,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
        sid=int(fields[3]),
        start_time=int(fields[19]),
        state=fields[0].decode("ascii", "replace"),
        threads=int(fields[17]),
    )


# /proc/<pid>/stat's start time is the kernel's boot-clock time of the process's creation, in clock
# ticks (nanoseconds floored to USER_HZ). A child made between two CLOCK_BOOTTIME readings of its parent
# that fall in the same tick started in that tick: no read of its stat needed (which, right after a
# posix_spawn, waits for the child's exec: ~0.13 ms of the fork server's turn per task, docs/benchmarks.md).
_USER_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0
_TICK_NS = 1_000_000_000 // _USER_HZ if _USER_HZ > 0 and 1_000_000_000 % _USER_HZ == 0 else 0
BOOT_CLOCK = getattr(time, "CLOCK_BOOTTIME", None)


def boot_clock_ns() -> int:
    """CLOCK_BOOTTIME now, in ns; where there is none, the monotonic clock (good for durations; then
    ``StartTimes`` always reads /proc)."""
    return time.clock_gettime_ns(BOOT_CLOCK) if BOOT_CLOCK is not None else time.monotonic_ns()


class StartTimes:
    """Start times of children this process made between two ``boot_clock_ns`` readings. The first
    ``checks`` that the readings pin down are also read from /proc and compared: one that differs
    (a kernel that counts otherwise) turns the shortcut off for good. Not thread-safe (the fork server
    calls it under its lock)."""

    def __init__(self, checks: int = 8) -> None:
        self.checks = checks
        self.off = not (IS_LINUX and _TICK_NS and BOOT_CLOCK is not None)
        self.read = 0  # how many came from /proc (unpinned, checked, or shortcut off)

    def of(self, pid: int, before_ns: int, after_ns: int) -> int:
        """The start time of ``pid``, made after ``before_ns`` and before ``after_ns`` (0 if unknown)."""
        pinned = not self.off and before_ns // _TICK_NS == after_ns // _TICK_NS
        ticks = before_ns // _TICK_NS if pinned else None
        if ticks is not None and self.checks <= 0:
            return ticks
        self.read += 1
        info = read_stat(pid)
        start = info.start_time if info is not None else 0
        if ticks is not None and info is not None:
            self.checks -= 1
            self.off = start != ticks
        return start


def scan(uid: int | None = None) -> dict[int, ProcInfo]:
    """Every process on the host (only those owned by ``uid``, default: ours), by pid."""
    uid = os.getuid() if uid is None else uid
    found: dict[int, ProcInfo] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
        except OSError:
            continue
        info = read_stat(int(name))
        if info is not None:
            found[info.pid] = info
    return found


def read_marker(pid: int) -> str | None:
    """The value of ``TREE_MARKER`` in the environment ``pid`` was started with, if any."""
    prefix = TREE_MARKER.encode() + b"="
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    for entry in data.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode("ascii", "replace")
    return None


def children_map(procs: dict[int, ProcInfo]) -> dict[int, list[int]]:
    """ppid -> the pids in ``procs`` whose parent it is (build once, pass to many ``descendants``)."""
    children: dict[int, list[int]] = {}
    for info in procs.values():
        children.setdefault(info.ppid, []).append(info.pid)
    return children


def descendants(
    procs: dict[int, ProcInfo], roots: Iterable[int], children: dict[int, list[int]] | None = None
) -> set[int]:
    """``roots`` (those present) plus every process whose parent chain reaches one of them.

    ``children`` (from :func:`children_map` of the same ``procs``) saves rebuilding it per call: a
    caller asking for many trees' descendants would otherwise pay O(processes) for each.
    """
    if children is None:
        children = children_map(procs)
    found: set[int] = set()
    stack = [pid for pid in roots if pid in procs]
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        found.add(pid)
        stack.extend(children.get(pid, ()))
    return found


def tree_of(procs: dict[int, ProcInfo], leader: int, token: str | None) -> set[int]:
    """The processes of one task tree: its session/group, its marked escapees, and their descendants.

    ``leader`` is the task's direct child (it led a new session, so ``sid == pgid == leader`` for
    every process that did not leave). The caller guarantees ``leader`` still names our task: either
    it is an unreaped child of the caller, or its start time was checked by the leftover sweep.
    The fork server passes only its own subtree as ``procs``.
    """
    pool = procs
    roots = {info.pid for info in pool.values() if leader in (info.sid, info.pgid)}
    roots.add(leader)
    if token:
        roots |= {pid for pid in pool if pid not in roots and read_marker(pid) == token}
    return descendants(pool, roots)


def children_of(pid: int, *, threads: int = 0) -> list[int]:
    """Direct children of ``pid`` (every thread's), from /proc/<pid>/task/*/children.

    ``threads=1`` (the process had one thread when its stat was read, or is the single-threaded
    caller itself) reads the one thread's file without listing /proc/<pid>/task: three system calls
    instead of eight, at every exit for every process walked. A thread started after that stat was
    read is missed, as one started after the listing would be; walks are repeated for that reason.
    """
    if threads == 1:
        return _children_file(f"/proc/{pid}/task/{pid}/children")
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        found.extend(_children_file(f"/proc/{pid}/task/{tid}/children"))
    return found


def _children_file(path: str) -> list[int]:
    # os-level, as read_stat: a text open() costs five more system calls (fstat twice, the tty
    # check, two seeks) and a file object, and the fork server reads these at every task's exit.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        data = read_all(fd)
    except OSError:
        return []
    finally:
        os.close(fd)
    return [int(part) for part in data.split()]


def read_all(fd: int, size: int = 65536) -> bytes:
    """The whole of a /proc or cgroup file from ``fd``, read until the empty read that ends it.

    A short read is not the end: a list such as ``children`` or ``cgroup.procs`` is a seq_file that
    hands out at most the kernel's buffer (one page) per read whatever ``size`` asks, so a list of
    more than ~700 pids comes in several short reads (tests/adapters/test_process_attack_tree.py)."""
    chunks = []
    while chunk := os.read(fd, size):
        chunks.append(chunk)
    return b"".join(chunks)  # one chunk: returned as it is, not copied


def subtree(root: int, *, threads: int = 0) -> dict[int, ProcInfo]:
    """Every descendant of ``root`` (not ``root`` itself), by pid.

    Walks the ``children`` files, so the cost follows the size of the subtree, not of the host: the
    fork server calls this at every task exit. Falls back to a full scan when the kernel lacks
    CONFIG_PROC_CHILDREN. ``threads``: as for :func:`children_of`, of ``root``.
    """
    if not has_children_files(root):
        procs = scan()
        return {pid: procs[pid] for pid in descendants(procs, [root]) if pid != root}
    return walk(children_of(root, threads=threads))


def has_children_files(pid: int) -> bool:
    """Whether the kernel lists children in /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN)."""
    return os.path.exists(f"/proc/{pid}/task/{pid}/children")


def walk(roots: Iterable[int]) -> dict[int, ProcInfo]:
    """``roots`` and every descendant of theirs, by pid, from the ``children`` files (the caller
    checked the kernel has them: :func:`has_children_files`)."""
    found: dict[int, ProcInfo] = {}
    stack = list(roots)
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        info = read_stat(pid)
        if info is None:
            continue
        found[pid] = info
        if info.threads == 1 and info.is_zombie:
            continue  # exited: its children went to the reaper before it showed as a zombie
        stack.extend(children_of(pid, threads=info.threads))
    return found


def signal_verified(pid: int, start_time: int, sig: int) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process that started at ``start_time``."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return False  # gone already (ESRCH) or no pidfd support: never guess
    try:
        info = read_stat(pid)
        if info is None or info.start_time != start_time:
            return False
        signal.pidfd_send_signal(pidfd, sig)
        return True
    except OSError:
        return False  # it exited between the check and the signal: nothing to do
    finally:
        os.close(pidfd)


def signal_all(procs: dict[int, ProcInfo], pids: Iterable[int], sig: int) -> int:
    """Signal each of ``pids`` (as recorded in ``procs``) safely; return how many were signalled."""
    sent = 0
    for pid in pids:
        info = procs.get(pid)
        if info is not None and not info.is_zombie and signal_verified(pid, info.start_time, sig):
            sent += 1
    return sent


def killpg_quietly(pgid: int, sig: int) -> None:
    """``killpg`` that treats "no such group" as success (the group already died)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def live(procs: dict[int, ProcInfo], pids: Iterable[int]) -> Iterator[int]:
    """The pids among ``pids`` that are running (not zombies)."""
    return (pid for pid in pids if pid in procs and not procs[pid].is_zombie)


def wait_gone(procs: dict[int, ProcInfo], pids: Iterable[int], timeout_seconds: float) -> bool:
    """Wait (polling /proc) until none of ``pids`` runs any more; False if the timeout passed first."""
    deadline = time.monotonic() + timeout_seconds
    pending = {(pid, procs[pid].start_time) for pid in pids if pid in procs}
    while True:
        pending = {
            (pid, start)
            for pid, start in pending
            if (info := read_stat(pid)) is not None and info.start_time == start and not info.is_zombie
        }
        if not pending:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def rss_bytes(pid: int) -> int | None:
    """A process's resident set now, in bytes (from /proc/<pid>/statm); None if it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as handle:
            fields = handle.read().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None


# Without a group: the leader's own accounting, read from its zombie -----------------------------------

_WAITID = {"x86_64": 247, "aarch64": 95}  # the raw syscall takes a struct rusage (glibc's wrapper not)
_P_PID = 1
_WEXITED, _WNOHANG, _WNOWAIT = 4, 1, 0x01000000
_libc: Any = None  # the C library, opened at the first call


def zombie_rusage(pid: int) -> dict[str, float]:
    """``max_rss_bytes`` / ``cpu_*_seconds`` of an exited, unreaped child and the descendants it reaped
    (``waitid(WNOWAIT)`` fills the rusage, as the kernel's getrusage(RUSAGE_BOTH)); {} where it cannot
    be read (another architecture, not our child, not Linux)."""
    linux = sys.platform.startswith("linux")
    number = _WAITID.get(os.uname().machine) if linux else None
    if number is None:
        return {}
    import ctypes

    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    libc = _libc
    info = ctypes.create_string_buffer(128)  # siginfo_t
    usage = (ctypes.c_long * 18)()  # struct rusage: two timevals, then 14 longs
    flags = _WEXITED | _WNOHANG | _WNOWAIT
    if libc.syscall(ctypes.c_long(number), _P_PID, pid, info, flags, usage) != 0:
        return {}
    return {
        "max_rss_bytes": usage[4] * 1024,  # ru_maxrss, KiB
        "cpu_user_seconds": usage[0] + usage[1] / 1e6,
        "cpu_system_seconds": usage[2] + usage[3] / 1e6,
    }
