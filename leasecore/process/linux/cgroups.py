"""Which cgroup mechanism holds the task trees (detected once at start), and making a task's group.

Owns ``detect`` and ``CgroupSetup``, and on the runner's side a task group's making, limits and
removal (``create_group``, ``remove_group``, ``spawns_inside``; the fork server's side of a group is
``cgroupfs.py``). Threads: ``detect`` once, on the run's start-up thread
(``runner/treegroups.py``); ``create_group`` and ``spawns_inside`` on the thread that starts a spawn
(``prepare.py``, ``Supervisor._start``); ``remove_group`` on whichever thread gives up a start. What
it must not touch is at the end of this docstring.

``detect(mode)`` looks at the runner's own cgroups (``/proc/self/cgroup``) and the mounts
(``/proc/self/mountinfo``) and answers a ``CgroupSetup``:

- **v2**: the runner may create child groups of its own v2 group (root, or a delegated subtree:
  systemd ``Delegate=yes``, a container's own cgroup namespace). Membership and the kill
  (``cgroup.kill``) always; the limits only for the controllers its own group hands to its children
  (``cgroup.subtree_control``: memory, pids, cpu). ``auto`` takes it when memory and pids are there.
- **v1**: the runner may create child groups in the v1 hierarchies: memory, pids, cpu, cpuacct and
  freezer (the kill: freeze, SIGKILL every member, thaw). ``auto`` takes it when v2 cannot limit.
- **none**: /proc tracking only, rlimits for the limits (per process, not per tree).

Every task group is a direct child of the runner's own group in each hierarchy (never beside it:
the runner's own limits keep applying to its tasks), named ``conductor-run.<runner pid>.<token>``.
On v1 a group is made only in the hierarchies its tree needs (``v1_needed``): memory, cpuacct and
freezer always (OOM reasons, accounting, the kill), pids and cpu only for a ``pids_max`` / ``cpu_max``
(or pids where there is no freezer); a v1 group without limits is the fork server's to provide, and
is reused across trees (``group_for``, ``grouppool.py``). The runner never moves itself, never writes
to a group it did not create (detection probes by creating and removing a group of its own), and
moves its fork server only for the length of one ``posix_spawn`` into a task group that has no limit
written (``spawns_inside``; ``cgroupfs.spawn_inside``), back into the group it was started in.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from leasecore.errors import SpawnError
from leasecore.limits import Limits
from leasecore.process.linux import cgroupfs, procfs

MODES = ("auto", "v2", "v1", "off")
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")
LIMIT_CONTROLLERS = ("memory", "pids", "cpu")
GROUP_PREFIX = "conductor-run."
_CPU_PERIOD_US = 100_000
_HAS_KILL: set[str] = set()  # v2 hierarchies whose groups were seen to have cgroup.kill
_AT_HOME: dict[int, bool] = {}  # fork server pid -> at_home, checked once (see spawns_inside)


@dataclass(frozen=True, eq=False)
class CgroupSetup:
    """The mechanism in force: ``mechanism`` v2 | v1 | none; ``dirs`` the runner's own group per
    hierarchy (``unified`` for v2); ``limits`` the controllers that enforce limits per tree;
    ``why`` says why not a better mechanism (empty when the best one is in force)."""

    mechanism: str = "none"
    dirs: dict[str, str] = field(default_factory=dict)
    limits: frozenset[str] = frozenset()
    why: str = ""

    @property
    def active(self) -> bool:
        return self.mechanism != "none"

    def describe(self) -> str:
        """One line for ``config``, ``status`` and the log."""
        if self.mechanism == "v2":
            what = "cgroup v2: one group per task tree under " + self.dirs["unified"]
        elif self.mechanism == "v1":
            what = "cgroup v1: one group per task tree in " + ", ".join(sorted(self.dirs))
        else:
            what = ("no cgroups: task trees tracked through /proc; memory and process limits are "
                    "per-process rlimits")
        enforced = ", ".join(c for c in LIMIT_CONTROLLERS if c in self.limits) or "none"
        if self.active:
            what += f" (limits enforced per tree: {enforced})"
        return what + (f"; {self.why}" if self.why else "")


def own_dirs(proc_cgroup: str, mountinfo: str) -> dict[str, str]:
    """The runner's own group's directory per hierarchy: ``unified`` (v2) and each v1 controller of
    ``V1_CONTROLLERS`` whose hierarchy is mounted where the runner's group can be seen."""
    mounts = procfs.mounts(mountinfo)
    dirs: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hier or not path.startswith("/"):
            continue
        if hier == "0" and not controllers:
            wanted = [m for m in mounts if m.fstype == "cgroup2"]
            names = ["unified"]
        else:
            names = [c for c in controllers.split(",") if c in V1_CONTROLLERS]
            wanted = [m for m in mounts if m.fstype == "cgroup" and set(names) <= m.options]
        for mount in wanted:
            rel = os.path.relpath(path, mount.root) if mount.root != "/" else path.lstrip("/")
            if rel.startswith(".."):
                continue  # this mount does not show our group
            directory = os.path.normpath(os.path.join(mount.point, rel))
            for name in names:
                dirs.setdefault(name, directory)
            break
    return dirs


def _probe(directory: str) -> str:
    """'' when a child group can be created (and removed) in ``directory``, else why not."""
    probe = os.path.join(directory, f"{GROUP_PREFIX}probe.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"cannot create a group in {directory}: {exc.strerror or exc}"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return ""


def _read(path: str) -> str:
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return ""


def detect(
    mode: str = "auto", *, proc_cgroup: str | None = None, mountinfo: str | None = None
) -> CgroupSetup:
    """The mechanism to use; ``mode`` auto | v2 | v1 | off. A forced mode that cannot work: ValueError
    saying why (the caller names the key and its source)."""
    if mode == "off":
        return CgroupSetup(why="cgroups are off (cgroup = off)")
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup")
    if mountinfo is None:
        mountinfo = _read("/proc/self/mountinfo")
    dirs = own_dirs(proc_cgroup, mountinfo)
    v2_why, v2_limits = _v2(dirs)
    v1_why, v1_dirs = _v1(dirs)
    v1_limits = frozenset(c for c in LIMIT_CONTROLLERS if c in v1_dirs)
    v2 = CgroupSetup("v2", {"unified": dirs["unified"]}, v2_limits) if not v2_why else None
    v1 = CgroupSetup("v1", v1_dirs, v1_limits) if not v1_why else None
    if mode == "v2":
        if v2 is None:
            raise ValueError(f"cgroup v2 cannot be used here: {v2_why}")
        return _with_why(v2, _missing(v2_limits, "cgroup v2"))
    if mode == "v1":
        if v1 is None:
            raise ValueError(f"cgroup v1 cannot be used here: {v1_why}")
        return _with_why(v1, _missing(v1_limits, "cgroup v1"))
    if v2 is not None and {"memory", "pids"} <= v2_limits:
        return _with_why(v2, _missing(v2_limits, "cgroup v2"))
    not_v2 = v2_why or (
        f"not cgroup v2: {dirs['unified']}/cgroup.subtree_control gives its child groups "
        f"{', '.join(sorted(v2_limits)) or 'no controller'}, not memory and pids"
    )
    if v1 is not None:
        return _with_why(v1, "; ".join(filter(None, [not_v2, _missing(v1_limits, "cgroup v1")])))
    if v2 is not None:
        return _with_why(v2, f"{not_v2}; no usable cgroup v1 either ({v1_why}): membership and the kill "
                             "only, memory and process limits are per-process rlimits")  # fmt: skip
    return CgroupSetup(why=f"{not_v2}; not cgroup v1: {v1_why}")


def _with_why(setup: CgroupSetup, why: str) -> CgroupSetup:
    return CgroupSetup(setup.mechanism, setup.dirs, setup.limits, why)


def _missing(limits: frozenset[str], what: str) -> str:
    missing = [c for c in LIMIT_CONTROLLERS if c not in limits]
    return f"{what} has no {'/'.join(missing)} controller for task groups" if missing else ""


def _v2(dirs: dict[str, str]) -> tuple[str, frozenset[str]]:
    unified = dirs.get("unified")
    if unified is None:
        return "no cgroup v2 hierarchy is mounted where this process can see its own group", frozenset()
    why = _probe(unified)
    if why:
        return why, frozenset()
    if not os.path.exists(os.path.join(unified, "cgroup.procs")):
        return f"{unified} is not a cgroup v2 directory", frozenset()
    # A child group gets the controllers its parent enables for its children; cgroup.kill (5.14+) is
    # in every non-root group, so it is checked where the task groups will be, at their creation.
    enabled = frozenset(_read(os.path.join(unified, "cgroup.subtree_control")).split())
    return "", frozenset(c for c in LIMIT_CONTROLLERS if c in enabled)


def _v1(dirs: dict[str, str]) -> tuple[str, dict[str, str]]:
    usable: dict[str, str] = {}
    problems = []
    for name in V1_CONTROLLERS:
        directory = dirs.get(name)
        if directory is None:
            problems.append(f"no {name} hierarchy")
            continue
        why = _probe(directory)
        if why:
            problems.append(why)
        else:
            usable[name] = directory
    if "freezer" not in usable and "pids" not in usable:
        return "; ".join(problems) or "no v1 hierarchy", {}
    return "", usable


def create_group(setup: CgroupSetup, token: str, limits: Limits) -> cgroupfs.Group:
    """Make a task's group under the runner's own, with ``limits`` written in; SpawnError if it cannot
    be made (what was made is removed again)."""
    name = f"{GROUP_PREFIX}{os.getpid()}.{token}"
    if setup.mechanism == "v2":
        group: cgroupfs.Group = {"v": 2, "dirs": {"unified": os.path.join(setup.dirs["unified"], name)}}
    else:
        wanted = v1_needed(setup, limits)
        group = {"v": 1, "dirs": {c: os.path.join(d, name) for c, d in setup.dirs.items() if c in wanted}}
    try:
        cgroupfs.make(group)  # (an OSError leaves none of it)
    except OSError as exc:
        raise SpawnError(f"cannot create the task's cgroup: {exc.strerror or exc}") from exc
    try:
        if setup.mechanism == "v2" and setup.dirs["unified"] not in _HAS_KILL:
            if not os.path.exists(os.path.join(group["dirs"]["unified"], "cgroup.kill")):
                raise SpawnError("this kernel's cgroup v2 has no cgroup.kill (Linux 5.14+)")
            _HAS_KILL.add(setup.dirs["unified"])  # the kernel's: the same for every group after
        if _has_limits(limits):
            _write_limits(group, setup, limits)
    except OSError as exc:
        cgroupfs.remove(group)
        raise SpawnError(f"cannot create the task's cgroup: {exc.strerror or exc}") from exc
    except SpawnError:
        cgroupfs.remove(group)
        raise
    return group


def group_for(setup: CgroupSetup, token: str, limits: Limits) -> cgroupfs.Group:
    """The group a tree of ``limits`` is started in: a new one (``create_group``), or, for a tree
    without limits on v1, a request for one of the fork server's reused groups (``pool_request``)."""
    if setup.mechanism == "v1" and not _has_limits(limits):
        return pool_request(setup, token, limits)
    return create_group(setup, token, limits)


def pool_request(setup: CgroupSetup, token: str, limits: Limits) -> cgroupfs.Group:
    """A v1 group the fork server provides (``forkserver.server.GroupPool``): an empty group of a gone tree,
    reused, or, when it has none, a new one at these paths, which it makes. Nothing is made here.

    Why: on v1 a new group costs three ``mkdir``, the kernel's new files for each, and three ``rmdir``
    per tree: 0.3-0.4 ms of CPU a task (docs/benchmarks.md). A reused group holds one tree at a time
    as a new one does (it is reused only once empty), is killed the same way, and its accounting is
    taken from a base read while it was empty (``cgroupfs.recycle``). Only groups without limits:
    a limit stays written in a group, and the fork server is never in a limited one."""
    name = f"{GROUP_PREFIX}{os.getpid()}.{token}"
    wanted = v1_needed(setup, limits)
    return {"v": 1, "dirs": {c: os.path.join(d, name) for c, d in setup.dirs.items() if c in wanted},
            "pool": True}  # fmt: skip


def _has_limits(limits: Limits) -> bool:
    return limits.memory_max is not None or limits.pids_max is not None or limits.cpu_max is not None


def v1_needed(setup: CgroupSetup, limits: Limits) -> set[str]:
    """The v1 hierarchies a tree of ``limits`` gets a group in: memory (peak, OOM kills, memory_max),
    cpuacct (CPU time) and freezer (the kill) always; pids for a ``pids_max``, or as the member list
    and kill where no freezer is usable; cpu for a ``cpu_max``. A hierarchy left out keeps the tree in
    the runner's own group there, which sets no limit of the tree's and is never killed as a whole.
    (Each hierarchy costs a mkdir, a join and an rmdir per task: on v1 memory, pids, cpu, cpuacct
    and freezer all five were 40 % of the cgroup work of a ``true``.)"""
    need = {"memory", "cpuacct", "freezer"}
    if limits.cpu_max is not None:
        need.add("cpu")
    if limits.pids_max is not None or "freezer" not in setup.dirs:
        need.add("pids")
    return need


def spawns_inside(setup: CgroupSetup, limits: Limits, forkserver_pid: int) -> bool:
    """Whether a tree of ``limits`` may be started by the fork server's ``posix_spawn`` from inside
    its new group (``cgroupfs.spawn_inside``) rather than by a Python fork whose child joins it: only
    when the group has no limit written, so that the fork server, a member for the length of that
    one call, can neither be OOM-killed, nor refused its fork by pids.max, nor CPU-throttled there;
    and only when the fork server is in the runner's own groups (``at_home``, checked once per fork
    server), where it goes back to. ``nofile`` needs an rlimit, which posix_spawn cannot set: the
    fork server forks for any request with rlimits."""
    if not setup.active or limits.memory_max is not None or limits.pids_max is not None:
        return False
    if limits.cpu_max is not None:
        return False
    home = _AT_HOME.get(forkserver_pid)
    if home is None:
        if len(_AT_HOME) >= 16:  # one entry per fork server started: bounded all the same
            _AT_HOME.clear()
        home = _AT_HOME[forkserver_pid] = at_home(setup, forkserver_pid)
    return home


def at_home(setup: CgroupSetup, pid: int) -> bool:
    """Whether process ``pid`` (the fork server) is in the runner's own group in every hierarchy of
    ``setup``: then the parent directory of a task group is where it goes back to after a
    ``spawn_inside``. False if it cannot be read (then it never moves)."""
    try:
        with open(f"/proc/{pid}/cgroup") as theirs:
            dirs = own_dirs(theirs.read(), _read("/proc/self/mountinfo"))
    except OSError:
        return False
    return bool(setup.dirs) and all(dirs.get(name) == path for name, path in setup.dirs.items())


def _write_limits(group: cgroupfs.Group, setup: CgroupSetup, limits: Limits) -> None:
    dirs = group["dirs"]
    writes: list[tuple[str, str]] = []
    if group["v"] == 2:
        unified = dirs["unified"]
        if limits.memory_max is not None and "memory" in setup.limits:
            writes.append((os.path.join(unified, "memory.max"), str(limits.memory_max)))
            swap = os.path.join(unified, "memory.swap.max")
            if os.path.exists(swap):  # the limit is on memory, not on memory + whatever swap holds
                writes.append((swap, "0"))
        if limits.pids_max is not None and "pids" in setup.limits:
            writes.append((os.path.join(unified, "pids.max"), str(limits.pids_max)))
        if limits.cpu_max is not None and "cpu" in setup.limits:
            quota = int(limits.cpu_max * _CPU_PERIOD_US)
            writes.append((os.path.join(unified, "cpu.max"), f"{quota} {_CPU_PERIOD_US}"))
    else:
        if limits.memory_max is not None and "memory" in dirs:
            writes.append((os.path.join(dirs["memory"], "memory.limit_in_bytes"), str(limits.memory_max)))
            memsw = os.path.join(dirs["memory"], "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                writes.append((memsw, str(limits.memory_max)))
        if limits.pids_max is not None and "pids" in dirs:
            writes.append((os.path.join(dirs["pids"], "pids.max"), str(limits.pids_max)))
        if limits.cpu_max is not None and "cpu" in dirs:
            writes.append((os.path.join(dirs["cpu"], "cpu.cfs_period_us"), str(_CPU_PERIOD_US)))
            quota = int(limits.cpu_max * _CPU_PERIOD_US)
            writes.append((os.path.join(dirs["cpu"], "cpu.cfs_quota_us"), str(quota)))
    for path, text in writes:
        with open(path, "w") as handle:
            handle.write(text)


def remove_group(group: cgroupfs.Group, spare: int = 0) -> bool:
    """Kill what is left in a group and remove it; True once it is gone. ``spare``: a pid never to
    kill or freeze (the fork server, which may be inside the group for a ``spawn_inside`` right now:
    the runner gives up on a start that it is still making)."""
    if cgroupfs.populated(group):
        cgroupfs.kill_all([group], spare={spare} if spare else None)
    return cgroupfs.remove(group)


def remove_empty_groups(setup: CgroupSetup, *, own: bool) -> None:
    """Remove the empty task groups under the runner's own groups that this runner made (``own``: its
    fork server died, leaving its free reused groups, ``GroupPool``) or that dead runners made (the
    start-up sweep: a fork server SIGKILLed with its runner removed none). Only directories named
    ``conductor-run.<pid>.<token>``, and only empty ones: a group holding a process belongs to a tree,
    which the state directory's record hands to the sweep. Without groups, nothing."""
    for directory in dict.fromkeys(setup.dirs.values()):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            pid = _owner_pid(name)
            if pid is None or (pid == os.getpid()) != own or (not own and _runs(pid)):
                continue
            path = os.path.join(directory, name)
            if not cgroupfs.populated({"v": 2 if setup.mechanism == "v2" else 1, "dirs": {"x": path}}):
                with contextlib.suppress(OSError):
                    os.rmdir(path)


def _owner_pid(name: str) -> int | None:
    """The runner pid in a task group's name (``conductor-run.<pid>.<token>``); None for any other."""
    if not name.startswith(GROUP_PREFIX):
        return None
    pid, _, token = name[len(GROUP_PREFIX):].partition(".")
    return int(pid) if pid.isdigit() and token else None


def _runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: someone's process
        return True
    return True


def unenforced(limits: Limits, setup: CgroupSetup) -> list[tuple[str, str]]:
    """``(key, what)`` for each of ``limits`` that ``setup`` enforces per process rather than per
    tree, or not at all."""
    notes = []
    if limits.memory_max is not None and "memory" not in setup.limits:
        notes.append(("memory_max", "is a per-process rlimit (RLIMIT_DATA) here, not a limit of the "
                                    "whole tree"))  # fmt: skip
    if limits.pids_max is not None and "pids" not in setup.limits:
        notes.append(("pids_max", "is RLIMIT_NPROC here: it counts the user's processes, not the "
                                  "tree's, and does not bind root"))  # fmt: skip
    if limits.cpu_max is not None and "cpu" not in setup.limits:
        notes.append(("cpu_max", "cannot be enforced here (no cgroup cpu controller): ignored"))
    return notes
