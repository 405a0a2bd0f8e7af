"""The fork server's second way to start a command: fork, set the child up, exec. Stdlib only.

``posix_spawn`` (the fork server's usual way: a vfork and exec in the C library) returns only once
the command has exec'd, and it can neither move the child into a cgroup nor set rlimits. A command
that joined its group only after its exec could fork before the move, and those children would stay
outside. So when a spawn request carries a ``cgroup`` or ``rlimits``, the fork server forks, and the
child, still running this (single-threaded, small) Python, does ``prepare`` before its exec:

1. joins its group (writes 0 to ``cgroup.procs`` in each hierarchy): from here on it and all it
   starts are members, whatever they do (setsid, double fork, a wiped environment);
2. sets the rlimits (soft = hard);
3. a new session, stdin/stdout/stderr from the request, signal dispositions and mask back at
   default, the working directory; then the exec.

A failing step is written to a close-on-exec pipe (``step:errno``) and the child exits 127 without
running the command; the parent reads the pipe to EOF (the exec closed it) and so answers the spawn
only after the exec, as with posix_spawn. Cost: the copy-on-write faults of a forked Python (~1 ms of
CPU more per task than posix_spawn).
"""

from __future__ import annotations

import os
import signal
from typing import Any


def fork_exec(req: dict[str, Any], fds: list[int], sigdef: list[int]) -> int:
    """Start ``req``'s command (path, argv, env, cwd, cgroup, rlimits) with ``fds`` as 0, 1, 2; return
    its pid once it has exec'd. OSError (errno, step) when a step before the exec failed."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    if pid == 0:  # the child: never returns
        _child(req, fds, sigdef, write_end)
    os.close(write_end)
    chunks = []
    try:
        while chunk := os.read(read_end, 256):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    if not chunks:
        return pid
    os.waitpid(pid, 0)
    step, _, code = b"".join(chunks).decode(errors="replace").partition(":")
    raise OSError(int(code) if code.isdigit() else 0, step)


def _child(req: dict[str, Any], fds: list[int], sigdef: list[int], report: int) -> None:
    step = "cgroup"
    try:
        group = req.get("cgroup")
        if group:
            from leasecore.process import _cgroupfs

            _cgroupfs.join_self(group)
        step = "rlimit"
        if req.get("rlimits"):
            import resource

            for name, value in req["rlimits"]:
                resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (int(value), int(value)))
        step = "setsid"
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=True)
        for sig in sigdef:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        step = "chdir"
        if req.get("cwd"):
            os.chdir(req["cwd"])
        step = "exec"
        os.execve(req["path"], req["argv"], req["env"])
    except BaseException as exc:
        # setrlimit says ValueError for a hard limit above the one we have (not ours to raise): EPERM
        code = getattr(exc, "errno", None) or (1 if isinstance(exc, ValueError) else 0)
        try:
            os.write(report, f"{step}:{code}".encode())
        finally:
            os._exit(127)
    os._exit(127)  # not reached: execve returns only by raising
