"""The file operations on a task's cgroup that the fork server and the leftover sweep do. Stdlib only:
the fork server imports it (see forkserver/server.py's note on imports).

Owns the reads and writes of a group's files: joining it (``join_self``, in ``forkexec.py``'s child;
``spawn_inside``, the fork server for one ``posix_spawn``), its members, whether it is populated, the
kill (v2 ``cgroup.kill``; v1: freeze, KILL each member, thaw), its OOM kills and accounting, its memory
now, its removal, and a reused group's reset and base (``recycle``; the fork server keeps a pooled
group's accounting files open, ``_read_kept``). Must not touch: a group it is not handed (the runner
makes them, ``cgroups.create_group``, and writes their limits; the fork server's ``grouppool`` makes v1
groups without limits; the sweep hands over only recorded groups of ours). Threads: the fork server's
(under its lock); on the runner's side the sweep (``leftovers.py``) and ``Child.memory_bytes``.

A group is described by a JSON-able dict, made by ``cgroups.create_group`` on the runner's side:
``{"v": 2, "dirs": {"unified": PATH}}`` or ``{"v": 1, "dirs": {"memory": PATH, "pids": PATH,
"freezer": PATH, "cpu": PATH, "cpuacct": PATH}}`` (a v1 hierarchy that is not usable, or that the
tree needs no group in, ``cgroups.v1_needed``, is absent; two controllers mounted together share one
PATH). Every function here is quiet about a group that is already gone (ENOENT): removal races
nothing but itself. ``spawn_inside`` is the fork server's way to start a tree in a group without a
fork (it moves itself in for one ``posix_spawn``); every kill here spares the calling process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from leasecore.process.linux import procfs

if TYPE_CHECKING:
    from collections.abc import Callable

Group = dict[str, Any]
_FREEZE_WAIT_SECONDS = 1.0
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_HOME_FDS: dict[str, int] = {}  # spawn_inside: each home group's cgroup.procs or tasks, open for writing
# spawn_inside: the groups' own cgroup.procs or tasks files, open for writing: a pooled v1 group is
# joined again by each tree it holds (an open and a close per directory and spawn saved, on kernfs).
# Closed when this process removes the group; bounded (all closed past the bound: a group removed
# by another process leaves a dead fd here, whose write fails and is retried on a fresh open).
_JOIN_FDS: dict[str, int] = {}
_OPEN_MAX = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 1024  # the fork server's limit
_JOIN_FDS_MOST = max(24, min(512, _OPEN_MAX // 8))  # as the kept files below: at a low limit, trees first
_STUCK: set[str] = set()  # spawn_inside: groups this process could not move out of again
# A pooled group's accounting files (``_read_kept``), open in the fork server while it keeps the
# group: read again from offset 0 (kernfs shows the file anew), an open and a close less per read.
# Bounded by an eighth of the fd limit too (three per group: at 1024 fds, 42 groups' worth), so that
# with the join fds and a pidfd per tree the fork server stays clear of EMFILE at a high concurrency.
_KEPT_FDS: dict[str, int] = {}
_KEPT_FDS_MOST = max(24, min(512, _OPEN_MAX // 8))
_KEPT_NAMES = ("memory.max_usage_in_bytes", "cpuacct.stat", "memory.oom_control")
_PEAK = _KEPT_NAMES[0]  # kept open for writing too: a reused group's peak is reset through it


def paths(group: Group) -> list[str]:
    """Each directory of the group once (v1 controllers mounted together share one)."""
    return list(dict.fromkeys(group.get("dirs", {}).values()))


def _read(path: str) -> str | None:
    # os.open/os.read rather than open(): a text file object costs ~7 µs more per read, and the fork
    # server reads a group's files several times per task (members, accounting, OOM kills).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return procfs.read_all(fd).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_kept(path: str) -> str | None:
    """``_read`` through an fd kept open (``_KEPT_FDS``), for a pooled group's accounting files, which
    the fork server reads at each of its trees' exits and at each reset: one ``pread`` at offset 0
    (they are a few dozen bytes: one read takes all)."""
    data = _on_kept(path, lambda fd: os.pread(fd, 4096, 0))
    if data is None:
        return None
    return data.decode(errors="replace") if len(data) < 4096 else _read(path)


def _on_kept(path: str, use: Callable[[int], Any]) -> Any:
    """``use(fd)`` of ``path`` kept open; one that fails (its group was removed meanwhile) is tried
    once more on a fresh open, whose failure is None, as ``_read``'s."""
    for fresh in (False, True):
        fd = _KEPT_FDS.get(path)
        try:
            if fd is None:
                if len(_KEPT_FDS) >= _KEPT_FDS_MOST:
                    _forget_fds(_KEPT_FDS, list(_KEPT_FDS))
                flags = os.O_RDWR if path.endswith(_PEAK) else os.O_RDONLY
                fd = _KEPT_FDS[path] = os.open(path, flags | os.O_CLOEXEC)
            return use(fd)
        except OSError:
            if fd is None or fresh:
                return None
            _forget_fds(_KEPT_FDS, [path])
    return None


def _write(path: str, text: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.write(fd, text.encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def join_self(group: Group) -> None:
    """Move the calling process into every directory of ``group`` (the fork server's child, between
    fork and exec). OSError when one refuses: the command must not run outside its group."""
    for path in paths(group):
        fd = os.open(os.path.join(path, "cgroup.procs"), os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


class JoinFailed(OSError):
    """``spawn_inside`` could not move the fork server into the group: the start fails at its
    ``cgroup`` step, as a child that cannot join does (nothing was started)."""

    step = "cgroup"


def spawn_inside(group: Group, spawn: Callable[[], int], *, thread: bool = False) -> int:
    """Call ``spawn()`` (a ``posix_spawn``) with the calling process moved into every directory of
    ``group``, and move it back into each directory's parent (where it came from: see
    ``cgroups.at_home``) right after, whatever happened: the child is born a member, as if it had
    joined between fork and exec, without a fork of this Python. ``thread``: the calling thread
    alone moves (v1's ``tasks`` files; a fork server's spawner thread, ``forkserver/launch.py``), the child
    being born in its maker thread's groups.

    While inside, this process is a member: so this is only for a group with no limit written
    (``cgroups.spawns_inside``), and every kill here spares it (``kill_all``). A move back that fails
    (it never should: the same file was written at start) leaves it ``stuck``; it then never freezes
    nor kills that group as a whole, and ``can_spawn_inside`` says no from then on."""
    joined: list[str] = []
    name = "tasks" if thread else "cgroup.procs"
    try:
        for path in paths(group):
            try:
                _write_procs(path + "/" + name)
            except OSError as exc:
                raise JoinFailed(exc.errno or errno.EINVAL, exc.strerror or str(exc)) from exc
            joined.append(path)
        return spawn()
    finally:
        for path in joined:
            if not _go_home(path.rpartition("/")[0] + "/" + name):
                _STUCK.add(path)


def can_spawn_inside() -> bool:
    return not _STUCK


def _write_procs(path: str) -> None:
    """Move the caller into the group of ``path`` (its ``cgroup.procs`` or ``tasks``), through an fd
    kept open (``_JOIN_FDS``); one that fails (its group was removed meanwhile) is dropped and the
    write tried once more on a fresh open, whose failure is the caller's OSError."""
    fd = _JOIN_FDS.pop(path, None)
    if fd is not None:
        try:
            os.write(fd, b"0")
            _JOIN_FDS[path] = fd
            return
        except OSError:
            with contextlib.suppress(OSError):
                os.close(fd)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, b"0")
    except BaseException:
        os.close(fd)
        raise
    if len(_JOIN_FDS) >= _JOIN_FDS_MOST:
        _forget_fds(_JOIN_FDS, list(_JOIN_FDS))
    _JOIN_FDS[path] = fd


def _forget_fds(table: dict[str, int], files: list[str]) -> None:
    for path in files:
        fd = table.pop(path, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _go_home(home: str) -> bool:
    """Move the caller back through ``home`` (a ``cgroup.procs`` or ``tasks`` file) and an fd kept open
    for it (one open per file for the life of the process instead of one per task); a failed write
    retries once, reopened. The fd is taken out of ``_HOME_FDS`` while it is used, as ``_write_procs``
    does: the fork server's spawner threads come back home at the same time as its loop, and a failed
    write's close must not leave another thread writing to that fd number, reused by another file."""
    for _ in range(2):
        fd = _HOME_FDS.pop(home, None)
        try:
            if fd is None:
                fd = os.open(home, os.O_WRONLY | os.O_CLOEXEC)
            os.write(fd, b"0")
        except OSError:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
            continue
        if _HOME_FDS.setdefault(home, fd) != fd:  # another thread put one back meanwhile: one is kept
            os.close(fd)
        return True
    return False


def _keyed(text: str | None) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (text or "").splitlines():
        name, _, number = line.partition(" ")
        if number.strip().isdigit():  # (no contextlib.suppress: a context manager per line, every exit)
            values[name] = int(number)
    return values


def members(group: Group) -> set[int]:
    """The pids in the group now (from the v1 freezer or pids hierarchy, else any of its dirs)."""
    dirs = group.get("dirs", {})
    found: set[int] = set()
    order = [dirs.get("freezer"), dirs.get("pids"), *paths(group)]
    for path in (p for p in order if p):
        text = _read(path + "/cgroup.procs")
        if text is not None:
            found.update(int(pid) for pid in text.split())
            if group.get("v") == 2 or path in (dirs.get("freezer"), dirs.get("pids")):
                break  # one complete list is enough: every hierarchy holds the whole tree
    return found


def populated(group: Group) -> bool:
    """Whether any process is still in the group."""
    if group.get("v") == 2:
        events = _keyed(_read(os.path.join(group["dirs"]["unified"], "cgroup.events")))
        if "populated" in events:
            return events["populated"] != 0
    return bool(members(group))


def kill(group: Group) -> int:
    """SIGKILL every process of the group; how many were signalled (v2: -1, the kernel does it)."""
    return kill_all([group])


def kill_all(groups: list[Group], spare: set[int] | None = None) -> int:
    """SIGKILL every process of every group; how many were signalled (v2 groups count none: the
    kernel does it).

    v2: ``cgroup.kill`` (the kernel kills every member, including ones forking at that moment).
    v1: freeze (no member can fork or exit while frozen), SIGKILL each member, thaw (they die as they
    thaw), all the groups at once: freezing is asynchronous, and one group after another made a KILL
    of 200 trees wait for 200 freezes in turn. Without a usable freezer, SIGKILL the members until
    none is left (bounded rounds).

    ``spare`` (and always this process): pids never signalled. With ``spare`` given (the runner,
    about a start the fork server may be making inside the group right now), no group is frozen or
    ``cgroup.kill``ed, whoever is in it when the check is made: its members but the spared are
    SIGKILLed one by one (bounded rounds), as is any group this process is stuck in.
    """
    explicit = bool(spare)
    spare = {os.getpid(), *(spare or ())}
    v1 = []
    holding = []  # groups that may hold a spared pid
    for group in groups:
        if explicit or (_STUCK and spare & members(group)):
            holding.append(group)
        elif group.get("v") == 2 and _write(os.path.join(group["dirs"]["unified"], "cgroup.kill"), "1"):
            continue
        else:
            v1.append(group)
    if not v1 and not holding:
        return 0
    freezers = [f for f in (group.get("dirs", {}).get("freezer") for group in v1) if f]
    frozen = set(_freeze(freezers))
    signalled = 0
    for group in v1 + holding:
        rounds = 1 if group.get("dirs", {}).get("freezer") in frozen else 5
        for _ in range(rounds):
            pids = members(group) - spare
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
                    signalled += 1
    for freezer in freezers:
        _write(os.path.join(freezer, "freezer.state"), "THAWED")
    return signalled


def _freeze(freezers: list[str]) -> list[str]:
    """Freeze every v1 freezer group given; those that reached FROZEN (bounded wait: a member stuck
    in D state keeps its group FREEZING, and its members are then signalled unfrozen)."""
    waiting = [f for f in freezers if _write(os.path.join(f, "freezer.state"), "FROZEN")]
    done: list[str] = []
    deadline = time.monotonic() + _FREEZE_WAIT_SECONDS
    while waiting:
        still = []
        for freezer in waiting:
            if (_read(os.path.join(freezer, "freezer.state")) or "").strip() == "FROZEN":
                done.append(freezer)
            else:
                still.append(freezer)
        waiting = still
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.001)
    return done


def oom_kills(group: Group) -> int:
    """How many processes the kernel's OOM killer killed in the group (its own events, not a guess):
    v2 ``memory.events`` oom_kill; v1 ``memory.oom_control`` oom_kill (kernel 4.13+)."""
    dirs = group.get("dirs", {})
    if group.get("v") == 2:
        return _keyed(_read(os.path.join(dirs["unified"], "memory.events"))).get("oom_kill", 0)
    memory = dirs.get("memory")
    if not memory:
        return 0
    read = _read_kept if group.get("pool") else _read
    kills = _keyed(read(memory + "/memory.oom_control")).get("oom_kill", 0)
    return max(0, kills - int(group.get("base", {}).get("oom_kill", 0)))


def resources(group: Group) -> dict[str, float]:
    """What the group tells of the tree: ``max_rss_bytes`` (peak memory), ``cpu_user_seconds``,
    ``cpu_system_seconds``; only the keys it knows. A reused group's (``recycle``) figures are taken
    from its ``base``: the CPU counters as differences, the peak above the charge the group started with."""
    if "base" in group:
        return _since_base(group)
    dirs = group.get("dirs", {})
    found: dict[str, float] = {}
    if group.get("v") == 2:
        unified = dirs["unified"]
        peak = _read(os.path.join(unified, "memory.peak"))
        if peak is not None and peak.strip().isdigit():
            found["max_rss_bytes"] = int(peak)
        stat = _keyed(_read(os.path.join(unified, "cpu.stat")))
        if "user_usec" in stat:
            found["cpu_user_seconds"] = stat["user_usec"] / 1e6
            found["cpu_system_seconds"] = stat.get("system_usec", 0) / 1e6
        return found
    read = _read_kept if group.get("pool") else _read  # (a pooled group's first tree: no base yet)
    if dirs.get("memory"):
        peak = read(dirs["memory"] + "/" + _PEAK)
        if peak is not None and peak.strip().isdigit():
            found["max_rss_bytes"] = int(peak)
    if dirs.get("cpuacct"):
        stat = _keyed(read(dirs["cpuacct"] + "/cpuacct.stat"))
        if "user" in stat:
            found["cpu_user_seconds"] = stat["user"] / _CLK_TCK
            found["cpu_system_seconds"] = stat.get("system", 0) / _CLK_TCK
    return found


_USAGE_KEYS = ("max_rss_bytes", "cpu_user_seconds", "cpu_system_seconds")


# A group reused across trees (v1, no limits): see the fork server's pool --------------------------

# A v1 group keeps a memory charge after its tree is gone: kernel objects its processes left and the
# per-CPU charge caches (here 60-250 KiB after a `true`, growing by ~60 KiB a tree). A group is reused
# only while that charge is below this, so a reused group's peak is off by less than it.
RECYCLE_MAX_CHARGE_BYTES = 1 << 20


def poolable(group: Group) -> bool:
    """Whether ``group`` may serve another tree once its own is gone: a v1 group with memory and
    cpuacct (its accounting can be taken from a base) and no limit written (``cgroups.pool_request``
    marks such groups ``pool``)."""
    dirs = group.get("dirs", {})
    return bool(group.get("pool") and group.get("v") == 1 and dirs.get("memory") and dirs.get("cpuacct"))


def recycle(group: Group) -> Group | None:
    """Ready the empty group of a gone tree for the next tree: its peak reset (v1's
    ``memory.max_usage_in_bytes`` resets to the charge now), and the base the next tree's figures are
    taken from (CPU ticks, OOM kills, the peak it starts from). None: not reusable (its leftover charge
    is over ``RECYCLE_MAX_CHARGE_BYTES``, or a file could not be read or written): remove it instead.
    Nothing can change the counters meanwhile: an empty group has no process to charge."""
    if not poolable(group):
        return None
    dirs = group["dirs"]
    memory = dirs["memory"]
    if _on_kept(memory + "/" + _PEAK, lambda fd: os.write(fd, b"0")) is None:
        return None
    peak = _number(_read_kept(memory + "/" + _PEAK))  # the charge now
    if peak is None or peak > RECYCLE_MAX_CHARGE_BYTES:
        return None
    stat = _keyed(_read_kept(dirs["cpuacct"] + "/cpuacct.stat"))
    oom = _read_kept(memory + "/memory.oom_control")
    if "user" not in stat or oom is None:
        return None
    base = {"peak": peak, "user": stat["user"], "system": stat.get("system", 0),
            "oom_kill": _keyed(oom).get("oom_kill", 0)}  # fmt: skip
    return {"v": 1, "dirs": dict(dirs), "pool": True, "base": base}


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.strip().isdigit() else None


def _since_base(group: Group) -> dict[str, float]:
    dirs, base = group.get("dirs", {}), group["base"]
    found: dict[str, float] = {}
    peak = _number(_read_kept(dirs["memory"] + "/" + _PEAK))
    if peak is not None:
        found["max_rss_bytes"] = max(0, peak - int(base["peak"]))
    stat = _keyed(_read_kept(dirs["cpuacct"] + "/cpuacct.stat"))
    if "user" in stat:
        found["cpu_user_seconds"] = max(0, stat["user"] - int(base["user"])) / _CLK_TCK
        found["cpu_system_seconds"] = max(0, stat.get("system", 0) - int(base["system"])) / _CLK_TCK
    return found


def tree_usage(pid: int, group: Group | None) -> tuple[dict[str, float], int]:
    """What an exited leader's tree used, and the OOM kills in its group (0 without one): the
    group's figures where it has them (``resources``), the rest from the leader's zombie
    (``zombie_rusage``, only when the group does not tell all three)."""
    if group is None:
        return procfs.zombie_rusage(pid), 0
    found = resources(group)
    if any(key not in found for key in _USAGE_KEYS):
        found = {**procfs.zombie_rusage(pid), **found}
    return found, oom_kills(group)


def memory_current(group: Group) -> int | None:
    """The group's memory use now, in bytes (None: no memory accounting)."""
    dirs = group.get("dirs", {})
    if group.get("v") == 2:
        path = os.path.join(dirs["unified"], "memory.current")
    elif dirs.get("memory"):
        path = os.path.join(dirs["memory"], "memory.usage_in_bytes")
    else:
        return None
    used = _number(_read(path))
    if used is None or "base" not in group:
        return used
    return max(0, used - int(group["base"]["peak"]))  # a reused group's: above what it started with


def make(group: Group) -> None:
    """mkdir every directory of ``group``; OSError, with none of them left, if one cannot be made."""
    made: list[str] = []
    try:
        for path in paths(group):
            os.mkdir(path)
            made.append(path)
    except OSError:
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise


def remove(group: Group) -> bool:
    """rmdir every directory of the group; True once none is left (False: a member is still in it)."""
    done = True
    for path in paths(group):
        if _JOIN_FDS:  # (the fork server's own, kept by spawn_inside)
            _forget_fds(_JOIN_FDS, [os.path.join(path, "tasks"), os.path.join(path, "cgroup.procs")])
        if _KEPT_FDS:  # (the fork server's own, kept by _read_kept)
            _forget_fds(_KEPT_FDS, [os.path.join(path, name) for name in _KEPT_NAMES])
        try:
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:
            done = False
    return done
