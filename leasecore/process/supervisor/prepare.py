"""What one spawn needs before it is asked of the fork server, made as a whole or not at all.

Owns the steps between a ``CommandSpec`` and a ``spawn`` request: the working directory check, the
task's private files (``TaskFiles``, named by the tree's random marker token), the child's
environment (``build_child_env``), the executable on PATH (``caches.ExecutablePaths``), the two
output pipes, and the tree's cgroup (``cgroups.group_for``: made here, or on v1 without limits asked of
the fork server's pool) with the rlimits its command gets. ``SpawnPreparer`` holds what every spawn
of one Supervisor is prepared with (its environment, where task directories go, the PATH and
inherited-environment caches, the working directories seen, the cgroup setup, the tree records' meta).
A step that fails (a ``SpawnError`` naming what) undoes the steps before it: no file, fd or group
is left. ``Prepared.message`` is the request the fork server gets.

Must not touch: the fork server, the Supervisor's tables, the reader. What it makes belongs to the
caller from then on (the pipes' write ends go to the fork server with the request, the read ends to
the reader thread once the command runs).

Threads: the caller of ``Supervisor.start``/``spawn`` (the runner's main thread).
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from leasecore.errors import SpawnError
from leasecore.limits import rlimits_for
from leasecore.models import Task
from leasecore.process.checkpoint import seed_of
from leasecore.process.linux import cgroupfs, cgroups
from leasecore.process.results.stdio_protocol import task_json
from leasecore.process.spec import STDIO, CommandSpec, build_child_env
from leasecore.process.supervisor.caches import ExecutablePaths, InheritedEnvs, WorkingDirectories
from leasecore.process.taskfiles import TaskDirs, TaskFiles

TreeMeta = Callable[[Task, str], dict[str, Any] | None]  # (task, worker_id) -> a tree record's meta


_TOKENS_AHEAD = 64  # marker tokens drawn in one getrandom call
_tokens: deque[str] = deque()  # drawn, not handed out yet (a deque: popleft is atomic across threads)
os.register_at_fork(after_in_child=_tokens.clear)  # a forked copy draws its own


def new_token() -> str:
    """A tree's marker token: 32 hex digits of the kernel's random, as ``secrets.token_hex(16)``
    returns (without importing hashlib), drawn ``_TOKENS_AHEAD`` at a time: one system call (a GIL
    given up and won back on the main thread) per 64 spawns instead of each."""
    try:
        return _tokens.popleft()
    except IndexError:
        drawn = os.urandom(16 * _TOKENS_AHEAD).hex()
        _tokens.extend(drawn[at : at + 32] for at in range(32, len(drawn), 32))
        return drawn[:32]


def working_directory(spec: CommandSpec) -> str:
    """The directory the fork server will chdir to; SpawnError if it does not exist."""
    cwd = spec.cwd or os.getcwd()
    if not os.path.isabs(cwd):  # the fork server chdirs to it, from wherever it is (not normalised:
        cwd = os.path.join(os.getcwd(), cwd)  # "link/.." must mean what a chdir makes of it)
    if not os.path.isdir(cwd):
        raise SpawnError(f"working directory {cwd!r} does not exist")
    return cwd


@dataclasses.dataclass(frozen=True, eq=False)
class Prepared:
    """A spawn made ready: everything it holds until it is sent (or ``discard``-ed)."""

    token: str  # the tree's marker token
    cwd: str
    files: TaskFiles
    env: dict[str, str]
    path: str  # the executable, resolved
    pipes: tuple[int, int, int, int]  # stdout read, stdout write, stderr read, stderr write
    group: cgroupfs.Group | None  # the tree's cgroup, or a request for a pooled one (None: no cgroups)
    rlimits: list[tuple[str, int]]
    base: dict[str, str] | None = None  # the environment inherited (kept per spec: the spawn's base)
    meta: dict[str, Any] | None = None  # kept with the tree's record (``TreeMeta``)

    def message(self, request_id: int, key: str, argv: list[str], spec: CommandSpec) -> dict[str, Any]:
        """The ``spawn`` request (its fds: the input file, then the pipes' write ends)."""
        request = {"op": "spawn", "id": request_id, "key": key, "path": self.path, "argv": argv,
                   "env": self.env, "cwd": self.cwd, "token": self.token, "grace": spec.kill_grace_seconds,
                   "dir": self.files.directory, "cgroup": self.group, "rlimits": self.rlimits}  # fmt: skip
        if spec.run_as is not None:  # the fork server starts it as that user (forkexec.py)
            request["run_as"] = spec.run_as.wire()
        return request


def prepare(
    task: Task,
    spec: CommandSpec,
    argv: list[str],
    cwd: str,
    *,
    worker_id: str,
    environ: Mapping[str, str],
    inherited: dict[str, str],
    task_dirs: TaskDirs,
    executables: ExecutablePaths,
    cgroup_setup: cgroups.CgroupSetup,
    deadline: float | None = None,
    base: dict[str, str] | None = None,
    meta: dict[str, Any] | None = None,
) -> Prepared:
    """Make what a spawn of ``argv`` for ``task`` needs (``inherited``: ``inherited_env`` of
    ``environ`` and ``spec``); SpawnError, with nothing left behind, if a step fails. The checkpoint
    file starts with ``task.checkpoint``; ``deadline``: CONDUCTOR_DEADLINE (epoch seconds);
    ``base`` and ``meta``: kept in the ``Prepared`` as given."""
    token = new_token()
    try:
        whole_task = task_json(task) if spec.protocol == STDIO else None  # conductor-cli's stdin
        owner = (spec.run_as.uid, spec.run_as.gid) if spec.run_as is not None else None
        # The task's runtime metadata, in a file of its own when the task has any (secretenv).
        metadata = task.runtime_metadata if task.runtime_metadata or task.declared_metadata else None
        files = TaskFiles.create_in(task_dirs, task, memory_limited=spec.limits.memory_max is not None,
                                    unique=token, stdin=whole_task, owner=owner,
                                    checkpoint=seed_of(task.checkpoint), secrets=metadata)
    except OSError as exc:  # a full or unwritable temp dir fails this task, not the runner
        raise SpawnError(f"cannot make the task's files: {exc.strerror or exc}") from exc
    env = build_child_env(
        environ, spec, task, worker_id=worker_id, input_file=files.input_path,
        output_file=files.output_path, tree_token=token, inherited=inherited,
        checkpoint_file=files.checkpoint_path, deadline=deadline, secrets_file=files.secrets_path,
    )  # fmt: skip
    try:
        path = executables.find(argv[0], env.get("PATH", os.defpath), cwd)
    except SpawnError:
        files.remove()
        raise
    pipes: list[int] = []
    try:
        pipes.extend(os.pipe())
        pipes.extend(os.pipe())
    except OSError as exc:  # out of file descriptors: this task fails, the runner goes on
        for fd in pipes:
            os.close(fd)
        files.remove()
        raise SpawnError(f"cannot make the command's output pipes: {exc.strerror or exc}") from exc
    try:
        group = None
        if cgroup_setup.active:
            group = cgroups.group_for(cgroup_setup, token, spec.limits)  # SpawnError
        rlimits = rlimits_for(spec.limits, cgroup_setup.limits if group is not None else frozenset())
    except SpawnError:
        for fd in pipes:
            os.close(fd)
        files.remove()
        raise
    out_r, out_w, err_r, err_w = pipes
    return Prepared(token, cwd, files, env, path, (out_r, out_w, err_r, err_w), group, rlimits, base, meta)


class SpawnPreparer:
    """Prepares every spawn of one Supervisor (see the module docstring)."""

    def __init__(self, environ: Mapping[str, str], *, task_dirs: TaskDirs, cgroup_setup: cgroups.CgroupSetup,
                 tree_meta: TreeMeta | None, path_cache_seconds: float) -> None:  # fmt: skip
        self.environ = dict(environ)
        self.task_dirs = task_dirs
        self.cgroup_setup = cgroup_setup
        self._tree_meta = tree_meta
        self._executables = ExecutablePaths(path_cache_seconds)
        self._cwds = WorkingDirectories(working_directory, path_cache_seconds)
        self._inherited = InheritedEnvs(self.environ)

    def prepare(self, task: Task, spec: CommandSpec, argv: list[str], *, worker_id: str,
                deadline: float | None) -> Prepared:  # fmt: skip
        """``prepare`` for this Supervisor, with the spawn's environment base and the tree's meta
        (made before any file)."""
        cwd = self._cwds.of(spec)
        meta = None if self._tree_meta is None else self._tree_meta(task, worker_id)
        inherited = self._inherited.of(spec)
        # (made whole at once: a dataclasses.replace after it cost as much as the rest of this method)
        return prepare(task, spec, argv, cwd, worker_id=worker_id, environ=self.environ, inherited=inherited,
                       task_dirs=self.task_dirs, executables=self._executables,
                       cgroup_setup=self.cgroup_setup, deadline=deadline, base=inherited,
                       meta=meta)  # fmt: skip
