"""The fork server's spawner threads: ``posix_spawn`` without the GIL, so that a command slow to reach
its exec holds up only its own start. Stdlib only (ctypes), imported by the fork server at its first
start that can use it.

Why: glibc's ``posix_spawn`` returns only once its vfork child has reached the exec, and
``os.posix_spawn`` keeps the GIL for that whole call. The fork server's one thread used to wait
there; beside a busy process that child waited 2.8 ms on average (9 ms at the 99th percentile) for a
core, and every other slot's start, exit and kill queued behind it (docs/benchmarks.md, "The fork
server"). libc's ``posix_spawn`` called through ctypes runs with the
GIL released, and a few threads each wait for their own child only.

Owns ``usable()`` (glibc on Linux, with ``posix_spawn_file_actions_addchdir_np``), ``spawn(...)``
(one libc ``posix_spawn``: the request's fds as 0-2, its working directory, a new session, the
signals given back to default, an empty mask; an ``OSError`` with the errno it returned) and
``Spawners`` (threads started on demand, at most ``most``, each running one submitted job at a time).

Must not touch: the fork server's state. A job is the fork server's own code: the start's system
calls without the fork server's lock, then its tree held under that lock if it is free
(``Launcher._spawn_on_thread``, launch.py).
Threads: its own, daemons, for the fork server's life (a vfork child's parent is the thread that made
it: a leader stays that thread's child until it is reaped, so the threads never end before the
process).
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

_SETSIGDEF, _SETSIGMASK, _SETSID = 0x04, 0x08, 0x80  # glibc's <spawn.h>
_OPAQUE_BYTES = 1024  # posix_spawnattr_t is 336 bytes on glibc x86-64, file actions 80: room to spare
_libc: ctypes.CDLL | None = None  # (a PyDLL: these quick calls keep the GIL, no hand-off of it each)
_posix_spawn: Any = None  # libc's posix_spawn through a CDLL: the GIL released while it waits for the exec
_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()  # os.fsencode's


def usable() -> bool:
    """Whether this process can spawn through libc here (Linux, glibc 2.29 or later)."""
    global _libc, _posix_spawn
    if _libc is not None:
        return True
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (AttributeError, ValueError, OSError):
        return False
    if not version.startswith("glibc "):
        return False
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        spawn_call = ctypes.CDLL(None, use_errno=True).posix_spawn
        for name in ("posix_spawn", "posix_spawn_file_actions_addchdir_np", "posix_spawnattr_setsigdefault"):
            getattr(libc, name)
    except (OSError, AttributeError):
        return False
    c_void_p, c_int, c_char_p = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
    spawn_call.argtypes = [ctypes.POINTER(c_int), c_char_p, c_void_p, c_void_p, c_void_p, c_void_p]
    spawn_call.restype = c_int
    for name, args in (("posix_spawn_file_actions_init", [c_void_p]),
                       ("posix_spawn_file_actions_destroy", [c_void_p]),
                       ("posix_spawn_file_actions_adddup2", [c_void_p, c_int, c_int]),
                       ("posix_spawn_file_actions_addchdir_np", [c_void_p, c_char_p]),
                       ("posix_spawnattr_init", [c_void_p]),
                       ("posix_spawnattr_setflags", [c_void_p, ctypes.c_short]),
                       ("posix_spawnattr_setsigdefault", [c_void_p, c_void_p]),
                       ("posix_spawnattr_setsigmask", [c_void_p, c_void_p]),
                       ("sigemptyset", [c_void_p]), ("sigaddset", [c_void_p, c_int])):  # fmt: skip
        function = getattr(libc, name)
        function.argtypes, function.restype = args, c_int
    _libc, _posix_spawn = libc, spawn_call
    return True


class Attributes:
    """The spawn attributes every start shares (read only by ``posix_spawn``: one for all threads)."""

    def __init__(self, sigdef: Sequence[int]) -> None:
        assert _libc is not None, "usable() first"
        self._buffers = [ctypes.create_string_buffer(_OPAQUE_BYTES) for _ in range(3)]
        self.attr, default, empty = self._buffers
        _libc.sigemptyset(default)
        for sig in sigdef:
            _libc.sigaddset(default, int(sig))
        _libc.sigemptyset(empty)
        _checked(_libc.posix_spawnattr_init(self.attr))
        _checked(_libc.posix_spawnattr_setflags(self.attr, _SETSIGDEF | _SETSIGMASK | _SETSID))
        _checked(_libc.posix_spawnattr_setsigdefault(self.attr, default))
        _checked(_libc.posix_spawnattr_setsigmask(self.attr, empty))


def spawn(attributes: Attributes, path: str, argv: Sequence[str], env: dict[str, str], fds: Sequence[int],
          cwd: str | None) -> int:
    """One libc ``posix_spawn`` of ``path`` with ``fds`` as 0, 1, 2 in ``cwd``; its pid once it exec'd.
    The GIL is released for the call (ctypes), so only the calling thread waits for the child."""
    assert _libc is not None, "usable() first"
    argv_c = _c_strings([_c(arg) for arg in argv])
    env_c = _c_strings(_environment(env))
    path_b = _c(path)
    actions = ctypes.create_string_buffer(_OPAQUE_BYTES)
    _checked(_libc.posix_spawn_file_actions_init(actions))
    try:
        for target, fd in enumerate(fds):
            _checked(_libc.posix_spawn_file_actions_adddup2(actions, fd, target))
        if cwd:
            _checked(_libc.posix_spawn_file_actions_addchdir_np(actions, _c(cwd)))
        pid = ctypes.c_int()
        code = _posix_spawn(ctypes.byref(pid), path_b, actions, attributes.attr, argv_c, env_c)
    finally:
        _libc.posix_spawn_file_actions_destroy(actions)
    if code:
        raise OSError(code, os.strerror(code), path)
    return pid.value


def _c(text: str) -> bytes:
    """``text`` for C, refused as ``os.posix_spawn`` refuses it: C would cut it at a NUL byte."""
    data = os.fsencode(text)
    if b"\0" in data:
        raise ValueError("embedded null byte")
    return data


def _environment(env: dict[str, str]) -> list[bytes]:
    """``env`` as C's ``NAME=value`` strings, refused as ``os.posix_spawn`` refuses it (a name empty or
    with ``=``, a NUL byte). One check over all of them rather than two calls per variable: with a
    few dozen variables that was 50-80 us a start, against 15-20 (timeit)."""
    if "" in env or "=" in "".join(env):
        raise ValueError("illegal environment variable name")
    data = [f"{key}={value}".encode(_FS_ENCODING, _FS_ERRORS) for key, value in env.items()]
    if b"\0" in b"".join(data):
        raise ValueError("embedded null byte")
    return data


def _c_strings(data: list[Any]) -> Any:
    """A NULL-ended ``char *`` array of ``data`` (filled by a slice: half the time of the constructor's
    arguments)."""
    array = (ctypes.c_char_p * (len(data) + 1))()
    array[: len(data)] = data
    return array


def _checked(code: int) -> None:
    if code:
        raise OSError(code, os.strerror(code))


class Spawners:
    """Up to ``most`` daemon threads running submitted jobs, started as jobs find none free."""

    def __init__(self, most: int) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._most = most
        self._lock = threading.Lock()
        self.threads = 0  # started so far (``stats``)
        self._free = 0  # threads waiting for a job

    def submit(self, job: Callable[[], None]) -> bool:
        """Queue ``job`` for a thread; False (nothing queued) when no thread runs or can be started."""
        if not self.reserve():
            return False
        self.put(job)
        return True

    def put(self, job: Callable[[], None]) -> None:
        """Queue ``job``, for which ``reserve`` said yes."""
        self._jobs.put(job)

    def reserve(self) -> bool:
        """Make sure a thread will take one job ``put`` next (a free one, or one started now); False
        when no thread runs or can be started (then nothing must be put)."""
        with self._lock:
            start = self._free == 0 and self.threads < self._most
            if start:
                self.threads += 1
            elif self._free:
                self._free -= 1  # that thread is this job's
            if not start and self.threads == 0:
                return False
        if start:
            try:
                threading.Thread(target=self._serve, name="spawner", daemon=True).start()
            except RuntimeError:  # no thread can be started (a limit): the ones running take it, if any
                with self._lock:
                    self.threads -= 1
                    if self.threads == 0:
                        return False
        return True

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job()
            except Exception as exc:  # a job answers its own failures: this is a bug, and the thread goes on
                print(f"conductor-run fork server: a spawner job failed: {exc!r}", file=sys.stderr)
            with self._lock:
                self._free += 1
