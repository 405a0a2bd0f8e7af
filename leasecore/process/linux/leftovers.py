"""The state directory's record of live task trees, and the sweep of trees a dead runner left.

Owns ``<state_dir>/processes-<runner pid>.json`` (0600, replaced atomically, with an append-only
journal between rewrites): the boot id, the runner and fork server (pid + start time) and every tree
held (``TreeRecord``: leader pid + start time, marker token, temporary directory, cgroup, ``meta``,
an opaque object the Supervisor's owner attached). Normally the fork server kills every tree when
the runner dies; the record covers both dying (SIGKILL to both, OOM): the next ``sweep`` kills what
remains, hands each dead runner's records to ``on_orphans`` and removes their directories. A record
from an earlier boot is dead by definition: nothing is signalled for it.

Must not touch: a process without evidence that cannot be a stranger (its tree's marker token, or
the session/group of a recorded leader that still runs with the same start time; a gone leader's
session only right after the fork server died: ``leaders_just_died``). Signals go through
``procfs.signal_verified``. Threads: ``StateRecord`` on the reader thread (add, remove) and the
Supervisor's constructing and closing threads; ``sweep`` on the runner's start-up thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leasecore.models import plain_json_encoder
from leasecore.process.linux import cgroupfs, procfs

GROUP_PREFIX = "conductor-run."  # cgroups.GROUP_PREFIX (that module imports more than a sweep needs)
TMP_PREFIX = "conductor-run-task-"
TASK_FILE_NAMES = ("input.json", "output.json", "checkpoint.json")  # a task's directory (taskfiles.py)
_SWEEP_ROUNDS = 20


@dataclass(frozen=True)
class TreeRecord:
    """One task tree as recorded in the state directory."""

    key: str
    pid: int
    start_time: int
    token: str
    tmpdir: str
    meta: dict[str, Any] | None = None  # opaque to this module; None in records of older runners
    cgroup: dict[str, Any] | None = None  # the tree's cgroup (cgroupfs), None without one
    survivors: int = 0  # set by the sweep: members still alive after it (0: every one confirmed gone)

    @classmethod
    def from_json(cls, tree: dict[str, Any]) -> TreeRecord:
        """A record read back from disk; a ``meta`` or ``cgroup`` that is not a JSON object, or a
        group that is not one of ours, is dropped."""
        meta, group = tree.get("meta"), tree.get("cgroup")
        return cls(str(tree["key"]), int(tree["pid"]), int(tree["start_time"]), str(tree["token"]),
                   str(tree["tmpdir"]), meta if isinstance(meta, dict) else None,
                   group if _is_our_group(group) else None)  # fmt: skip


def _is_our_group(group: object) -> bool:
    """A recorded group names only directories conductor-run made (``conductor-run.<pid>.<token>``
    in a cgroup filesystem): a garbled or edited record must never make the sweep kill a group or
    remove a directory it did not create."""
    if not isinstance(group, dict) or not isinstance(group.get("dirs"), dict) or not group["dirs"]:
        return False
    return all(
        isinstance(path, str) and os.path.isabs(path) and path.startswith("/sys/fs/cgroup/")
        and os.path.basename(path).startswith(GROUP_PREFIX) and ".." not in path.split("/")
        for path in group["dirs"].values()
    )


OrphanSink = Callable[[int, list[TreeRecord]], object]  # (dead runner's pid, its trees, now dead)


def _proc_id(pid: int) -> dict[str, int] | None:
    info = procfs.read_stat(pid)
    return None if info is None else {"pid": pid, "start_time": info.start_time}


def _is_alive(entry: dict[str, int] | None) -> bool:
    if not entry:
        return False
    info = procfs.read_stat(int(entry["pid"]))
    return info is not None and not info.is_zombie and info.start_time == int(entry["start_time"])


# Lines the journal may hold beyond twice the live trees before the record is rewritten: a rewrite
# (a new file, a rename, the journal emptied) costs ~140 us of CPU on ext4, a line ~5 us; at 1024
# it comes once per ~500 short tasks instead of ~36, and the journal stays under ~0.5 MB.
_COMPACT_SLACK = 1024


# (its C encoder made once: JSONEncoder makes one per dumps, about a third of a tree line's encoding,
# which the reader thread does for every started tree)
_dumps_line = plain_json_encoder()


def _journal_path(record_path: Path) -> Path:
    return record_path.with_suffix(".journal")


class StateRecord:
    """Writes this runner's record file; a no-op without a state directory. Not thread-safe: the
    Supervisor calls it under its lock.

    The JSON record (runner, fork server, trees) is written first; from then on a change is one
    appended line of ``processes-<pid>.journal`` (``+{tree json}`` / ``-key``), and the record is
    rewritten (and the journal emptied) only once the journal outgrows twice the live trees plus 1024
    lines: one ``write`` per spawn and exit instead of a rewrite (open, dump, rename; O(trees): see
    docs/benchmarks.md). An appended line is in the page cache as
    soon as ``write`` returns, so a SIGKILLed runner's trees are still found. Between ``hold`` and
    ``flush`` (the reader thread's handling of one read of the fork server's messages, tens of µs)
    removals wait for the next add or the flush and go out with it in one ``write``. Readers use
    :func:`read_record` (the record with its journal replayed).
    """

    def __init__(self, state_dir: Path | None, forkserver_pid: int) -> None:
        self._path = None if state_dir is None else state_dir / f"processes-{os.getpid()}.json"
        self._runner = _proc_id(os.getpid())
        self._forkserver = _proc_id(forkserver_pid)
        self._trees: dict[str, TreeRecord] = {}
        self._journal: int | None = None  # fd, O_APPEND
        self._journal_lines = 0
        self._written = False
        self._held: list[str] | None = None  # lines held back until ``flush`` (see ``hold``)
        if state_dir is not None:
            state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)

    def add(self, record: TreeRecord) -> None:
        """Record a tree: written before this returns (with whatever ``hold`` kept back), so that a
        tree whose spawn the caller reports as started is in the record."""
        self._trees[record.key] = record
        self._change("+" + _dumps_line(vars(record)), now=True)  # flat fields: vars, not asdict's deep copy

    def remove(self, key: str) -> None:
        """Forget a tree: written at once, or while held with the next add or at ``flush``."""
        if self._trees.pop(key, None) is not None:
            self._change("-" + json.dumps(key), now=False)

    def hold(self) -> None:
        """Hold removals back until the next ``add`` or ``flush``, which append them with their own
        line in one ``write``: the reader thread holds them over one read of the fork server's
        messages (a tree's end and another's start often come together), one system call less a
        task. A removal held back is safe: a tree gone stays gone to a later sweep."""
        if self._held is None:
            self._held = []

    def flush(self) -> None:
        """Append the lines held since ``hold`` (one ``write``) and stop holding; OSError if that
        fails (the lines are dropped, as a failed remove's)."""
        try:
            self._write_held()
        finally:
            self._held = None

    def _change(self, line: str, *, now: bool) -> None:
        if self._path is None:
            return
        lines = self._journal_lines + (len(self._held) if self._held is not None else 0)
        if not self._written or lines >= 2 * len(self._trees) + _COMPACT_SLACK:
            self._write()  # (the whole record: what is held is in it)
            return
        if self._held is None:
            self._append(line + "\n", 1)
            return
        self._held.append(line + "\n")
        if now:
            self._write_held()

    def _write_held(self) -> None:
        held = self._held
        if held:
            text, count = "".join(held), len(held)
            held.clear()
            self._append(text, count)

    def _append(self, text: str, lines: int) -> None:
        if self._journal is None:
            assert self._path is not None
            flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
            self._journal = os.open(_journal_path(self._path), flags, 0o600)
        os.write(self._journal, text.encode())
        self._journal_lines += lines

    def set_forkserver(self, pid: int) -> None:
        """A new fork server took over (the last one died)."""
        self._forkserver = _proc_id(pid)
        self._write()

    def trees(self) -> list[TreeRecord]:
        return list(self._trees.values())

    def delete(self) -> None:
        if self._path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._path.unlink()
            with contextlib.suppress(FileNotFoundError):
                _journal_path(self._path).unlink()
        if self._journal is not None:
            os.close(self._journal)
            self._journal = None

    def _write(self) -> None:
        if self._path is None:
            return
        data = {
            "boot": procfs.boot_id(),
            "runner": self._runner,
            "forkserver": self._forkserver,
            "trees": [vars(tree) for tree in self._trees.values()],
        }
        # A fixed temporary name (the directory is private, and the Supervisor serialises writes):
        # mkstemp's random names cost as much as the rest of the write, once per spawn and exit.
        tmp = self._path.with_name(f".{self._path.name}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        body = json.dumps(data).encode()  # dumps: json.dump encodes in Python, dumps in C
        fd = os.open(tmp, flags, 0o600)
        try:  # not os.fdopen: a text file's set-up (fstat, ioctl, lseek, its codec) for one write
            view = memoryview(body)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self._path)
        self._written = True
        if self._held:  # the record holds every change held back too
            self._held.clear()
        if self._journal is not None and self._journal_lines:  # the record now holds all of it
            os.ftruncate(self._journal, 0)
        self._journal_lines = 0


def read_record(record_path: Path) -> dict[str, Any]:
    """A record file's content with its journal applied: ``{"runner", "forkserver", "trees"}``.

    Raises ``OSError`` / ``ValueError`` for a record that cannot be read or parsed.
    """
    data = json.loads(record_path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("trees", []), list):
        raise ValueError(f"{record_path.name}: not a record of task trees")
    by_key = {str(tree.get("key")): tree for tree in data.get("trees", []) if isinstance(tree, dict)}
    _replay_journal(record_path, by_key)
    data["trees"] = list(by_key.values())
    return data


def _replay_journal(record_path: Path, trees: dict[str, dict[str, Any]]) -> None:
    """Apply ``processes-<pid>.journal`` (if any) to the record's trees, by key, in order. A stale
    journal (the runner died between a rewrite and emptying it) replays to the same state."""
    try:
        text = _journal_path(record_path).read_text()
    except OSError:
        return
    for line in text.splitlines():
        try:
            if line.startswith("+"):
                tree = json.loads(line[1:])
                trees[str(tree["key"])] = tree
            elif line.startswith("-"):
                trees.pop(str(json.loads(line[1:])), None)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line (killed mid-write): the rest still counts


def kill_trees(trees: list[TreeRecord], *, leaders_just_died: bool = False) -> set[int]:
    """SIGKILL every process attributable to ``trees`` (see module docstring), their groups' members
    first (a group holds a member whatever it did: setsid, a wiped environment, its parents' death);
    remove the groups once empty; return the pids killed."""
    killed: set[int] = set()
    for tree in trees:
        if tree.cgroup is not None:
            killed |= cgroupfs.members(tree.cgroup) - {os.getpid()}
            cgroupfs.kill(tree.cgroup)
    for _ in range(_SWEEP_ROUNDS):
        procs = procfs.scan()
        targets: set[int] = set()
        for tree in trees:
            # pid 0: a spawn under way, known by its token only (never "sid/pgid 0": the kernel threads)
            leader = procs.get(tree.pid) if tree.pid > 0 else None
            leader_is_ours = tree.pid > 0 and (
                leaders_just_died if leader is None else leader.start_time == tree.start_time
            )
            roots = {p.pid for p in procs.values() if leader_is_ours and tree.pid in (p.sid, p.pgid)}
            roots |= {pid for pid in procs if procfs.read_marker(pid) == tree.token}
            targets |= procfs.descendants(procs, roots)
        targets = set(procfs.live(procs, targets)) - {os.getpid()}
        if not targets:
            break
        procfs.signal_all(procs, targets, signal.SIGKILL)
        killed |= targets
        procfs.wait_gone(procs, targets, timeout_seconds=0.5)
    for tree in trees:
        if tree.cgroup is not None:
            _remove_when_empty(tree.cgroup)
    return killed


def _remove_when_empty(group: cgroupfs.Group, timeout_seconds: float = 2.0) -> bool:
    """Kill what is in ``group`` until it is empty, then remove it (bounded); True once removed."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        if not cgroupfs.populated(group) and cgroupfs.remove(group):
            return True
        if time.monotonic() >= deadline:
            return False
        cgroupfs.kill(group)
        time.sleep(0.01)


def survivors(tree: TreeRecord) -> int:
    """How many processes of a swept tree are still alive: its group's members, and whatever still
    carries its marker token (0: every member is confirmed gone)."""
    alive = cgroupfs.members(tree.cgroup) if tree.cgroup is not None else set()
    procs = procfs.scan()
    alive |= {pid for pid in procs if procfs.read_marker(pid) == tree.token}
    return len(set(procfs.live(procs, alive & set(procs))) - {os.getpid()})


def _pid_in_name(record_path: Path) -> int:
    """``processes-<pid>.json`` -> pid (0 if the name says otherwise)."""
    digits = record_path.stem.removeprefix("processes-")
    return int(digits) if digits.isdigit() else 0


def remove_tmpdir(path: str, rmtree: Callable[[str], None] | None = None) -> None:
    """Remove a task's temporary directory, but only one we created (name prefix checked).

    ``rmtree(path)``: what removes a directory the child put more in (default: at once, here); the
    Supervisor's reader thread hands that unbounded work to a thread of its own."""
    if path and os.path.basename(path.rstrip("/")).startswith(TMP_PREFIX):  # (no pathlib: a task's cost)
        try:  # what it holds unless the child added files there: three syscalls, not rmtree's dozen
            for name in TASK_FILE_NAMES:
                try:  # noqa: SIM105 (not contextlib.suppress: a context manager made per file, a task's cost)
                    os.unlink(path + "/" + name)  # (a "//" in it is one "/" to the kernel)
                except FileNotFoundError:
                    pass
            os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError:  # not empty (or not ours to unlink): the whole of it
            (rmtree or _rmtree)(path)


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _from_earlier_boot(recorded: object) -> bool:
    """Whether a record's boot id names another boot than this one (records of older runners have
    none: they are taken as of this boot, as before)."""
    current = procfs.boot_id()
    return isinstance(recorded, str) and bool(recorded) and bool(current) and recorded != current


def sweep(state_dir: Path, on_orphans: OrphanSink | None = None) -> set[int]:
    """Kill the trees recorded by runners that are no longer alive; return the pids killed.

    ``on_orphans(runner_pid, trees)`` is called once per dead runner that held trees, after they are
    killed and before its record is deleted: if it raises, the record stays (the next sweep hands
    the trees over again) and the exception propagates.
    """
    killed: set[int] = set()
    for path in sorted(state_dir.glob("processes-*.json")):
        try:
            data = read_record(path)
            # Written before the last reboot: all of it died then, and a pid with the same start
            # time now (a service started at boot gets much the same ones each time) is a stranger.
            earlier_boot = _from_earlier_boot(data.get("boot"))
            runner_alive = not earlier_boot and _is_alive(data.get("runner"))
            forkserver = data.get("forkserver")
            forkserver_alive = not earlier_boot and _is_alive(forkserver)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            # Unreadable, or the runner's identity is garbled: whether it still lives cannot be
            # told, so nothing of it is killed (and the start goes on).
            continue
        if runner_alive:
            continue  # a live runner (maybe this one): its fork server owns those trees
        if forkserver_alive and forkserver is not None:
            procfs.signal_verified(int(forkserver["pid"]), int(forkserver["start_time"]), signal.SIGKILL)
        trees = []
        for tree in data["trees"]:
            try:
                trees.append(TreeRecord.from_json(tree))
            except (KeyError, TypeError, ValueError):
                continue  # not one of ours to kill: a garbled entry names no process safely
        if not earlier_boot:
            killed |= kill_trees(trees)
            trees = [dataclasses.replace(tree, survivors=survivors(tree)) for tree in trees]
        for tree in trees:
            remove_tmpdir(tree.tmpdir)
        runner = data.get("runner") or {}
        if on_orphans is not None and trees:
            on_orphans(int(runner.get("pid") or _pid_in_name(path)), trees)
        with contextlib.suppress(FileNotFoundError):
            _journal_path(path).unlink()
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return killed
