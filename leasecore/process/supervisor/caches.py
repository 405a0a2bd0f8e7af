"""The per-spawn lookups the Supervisor keeps: a command found on PATH, a spec's inherited environment.

Owns three small bounded caches (``CACHE_ENTRIES`` each, emptied when full) and the PATH search itself
(``resolve_executable``). ``ExecutablePaths`` works like a shell's hash: a command found on PATH is
reused for ``cache_seconds`` as long as it is still executable (one ``access``); a command installed
meanwhile in an earlier directory of PATH is picked up once that time is over. ``WorkingDirectories``
keeps a spec's working directory, seen to exist, for the same time. ``InheritedEnvs``
keeps ``inherited_env(environ, spec)`` per ``CommandSpec`` object (a runner has one spec per task type).

Must not touch: the fork server, children, task files. It only stats paths and filters a mapping;
the time it reads is real (``time.monotonic`` unless another ``monotonic`` is injected), since it
bounds how stale a real directory listing may be.

Threads: used by ``Supervisor.start``/``spawn`` on their caller's thread (the runner's main thread);
not locked: a runner starts its tasks from one thread, and a lost race only costs a second lookup.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from leasecore.errors import SpawnError
from leasecore.process.spec import CommandSpec, inherited_env

CACHE_ENTRIES = 64  # entries kept by each cache here
PATH_CACHE_SECONDS = 5.0  # how long a command found on PATH is not looked up again


def resolve_executable(argv0: str, path_var: str, cwd: str) -> str:
    """``argv0`` as the fork server will exec it: relative to ``cwd`` with a ``/``, else searched on
    ``path_var``; SpawnError when no directory of it holds an executable of that name."""
    if "/" in argv0:
        return os.path.join(cwd, argv0)
    for directory in path_var.split(os.pathsep):
        candidate = os.path.join(cwd, directory or ".", argv0)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise SpawnError(f"command not found: {argv0!r} is not in the child's PATH")


class ExecutablePaths:
    """``resolve_executable`` with a command found kept for ``cache_seconds``."""

    def __init__(
        self, cache_seconds: float = PATH_CACHE_SECONDS, *, monotonic: Callable[[], float] = time.monotonic
    ) -> None:
        self._cache_seconds = cache_seconds
        self._monotonic = monotonic
        self._paths: dict[tuple[str, str, str], tuple[str, float]] = {}  # key -> (path, found at)

    def find(self, argv0: str, path_var: str, cwd: str) -> str:
        if "/" in argv0:
            return resolve_executable(argv0, path_var, cwd)
        key = (argv0, path_var, cwd)
        now = self._monotonic()
        known = self._paths.get(key)
        if known is not None and now - known[1] < self._cache_seconds and os.access(known[0], os.X_OK):
            return known[0]
        path = resolve_executable(argv0, path_var, cwd)
        if len(self._paths) >= CACHE_ENTRIES:
            self._paths.clear()
        self._paths[key] = (path, now)
        return path


class WorkingDirectories:
    """``working_directory(spec)`` kept per ``spec.cwd`` for ``cache_seconds``: like a command found
    on PATH, a directory seen to exist is not looked at again within that time (a ``stat`` per task
    otherwise). One removed meanwhile fails the spawn all the same, in the fork server's ``chdir``
    (the reason names that step) instead of here; with 0 s it is looked at for every spawn."""

    def __init__(
        self, check: Callable[[CommandSpec], str], cache_seconds: float = PATH_CACHE_SECONDS, *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self._check = check  # the directory as the fork server will chdir to it, or SpawnError
        self._cache_seconds = cache_seconds
        self._monotonic = monotonic
        self._known: dict[str | None, tuple[str, float]] = {}  # spec.cwd -> (directory, seen at)

    def of(self, spec: CommandSpec) -> str:
        now = self._monotonic()
        known = self._known.get(spec.cwd)
        if known is not None and now - known[1] < self._cache_seconds:
            return known[0]
        cwd = self._check(spec)  # (a relative one is joined to the runner's directory, which stays)
        if len(self._known) >= CACHE_ENTRIES:
            self._known.clear()
        self._known[spec.cwd] = (cwd, now)
        return cwd


class InheritedEnvs:
    """``inherited_env(environ, spec)``, kept per spec object."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        self._known: dict[int, tuple[CommandSpec, dict[str, str]]] = {}

    def of(self, spec: CommandSpec) -> dict[str, str]:
        known = self._known.get(id(spec))
        if known is not None and known[0] is spec:  # the same object, not one that took its id
            return known[1]
        env = inherited_env(self._environ, spec)
        if len(self._known) >= CACHE_ENTRIES:
            self._known.clear()
        self._known[id(spec)] = (spec, env)
        return env
