"""The fork server's second way to start a command: fork, set the child up, exec. Stdlib only.

``posix_spawn`` (the fork server's usual way: a vfork and exec in the C library) returns only once
the command has exec'd, and it can neither move the child into a cgroup, set rlimits, nor change
the user. A command that joined its group only after its exec could fork before the move, and those
children would stay outside. (A group with no limits is joined without a fork: the fork server calls
posix_spawn from inside it, ``_cgroupfs.spawn_inside``.) So when a spawn request carries a ``cgroup``
that is not ``inside``, ``rlimits`` or ``run_as`` (uid, gid, groups: #24), the (single-threaded,
small) fork server forks, and the child, running nothing but system calls, does before its exec:

1. joins its group (writes 0 to ``cgroup.procs`` in each hierarchy): from here on it and all it
   starts are members, whatever they do (setsid, double fork, a wiped environment);
2. sets the rlimits (soft = hard), while it still has the privilege to;
3. a new session, stdin/stdout/stderr from the request, the signals the fork server ignores back to
   default;
4. with ``run_as``: ``setgroups``, ``setgid``, ``setuid`` (in that order: each later one needs the
   privilege the earlier ones still have);
5. the working directory (as the user: a directory it may not enter fails the start), an empty
   signal mask, then the exec.

A failing step is written to a close-on-exec pipe (``errno:step``) and the child exits 127 without
running the command; the parent reads the pipe to EOF (the exec closed it) and so answers the spawn
only after the exec, as with posix_spawn, raising :class:`StepFailed` (which names the step) on a
failure. The shutdown signals are blocked across the fork: a TERM sent before the child has reset
them waits instead of being ignored, and ends the child once it unblocks. Cost: the copy-on-write
faults of a forked Python (~0.4 ms of CPU more per task than posix_spawn). Imported only when a
request needs it.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

_BLOCKED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StepFailed(OSError):
    """The command could not be started; ``step`` says which step before its exec failed."""

    def __init__(self, code: int, step: str) -> None:
        super().__init__(code, os.strerror(code) if code else "unknown error")
        self.step = step


def fork_exec(req: dict[str, Any], fds: list[int], sigdef: list[int]) -> int:
    """Start ``req``'s command (path, argv, env, cwd, cgroup, rlimits, run_as) with ``fds`` as 0, 1,
    2; return its pid once it has exec'd, or raise :class:`StepFailed`."""
    read_end, write_end = os.pipe2(os.O_CLOEXEC)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    try:
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(read_end)
            _child(req, fds, sigdef, write_end)
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(write_end)
    chunks = []
    try:
        while chunk := os.read(read_end, 256):
            chunks.append(chunk)
    finally:
        os.close(read_end)
    if not chunks:
        return pid
    os.waitpid(pid, 0)  # it _exits right after writing
    code, _, step = b"".join(chunks).decode(errors="replace").partition(":")
    raise StepFailed(int(code) if code.isdigit() else 0, step or "exec")


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
        step = "stdio"
        for target, fd in enumerate(fds):
            os.dup2(fd, target, inheritable=True)  # every other fd is close-on-exec
        step = "signals"
        signal.set_wakeup_fd(-1)
        for sig in sigdef:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        run_as = req.get("run_as")
        if run_as:
            step = "setgroups"
            os.setgroups([int(g) for g in run_as["groups"]])
            step = "setgid"
            os.setgid(int(run_as["gid"]))
            step = "setuid"
            os.setuid(int(run_as["uid"]))
        step = "chdir"
        cwd = req.get("cwd") or ("/" if run_as else None)
        if cwd:
            os.chdir(cwd)
        step = "exec"
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # a TERM already sent ends us here
        os.execve(req["path"], req["argv"], req["env"])
    except BaseException as exc:  # the child must never return into the fork server
        # setrlimit says ValueError for a hard limit above the one we have (not ours to raise): EPERM
        code = getattr(exc, "errno", None) or (errno.EPERM if isinstance(exc, ValueError) else errno.EINVAL)
        try:
            os.write(report, f"{code}:{step}".encode())
        finally:
            os._exit(127)
    os._exit(127)  # not reached: execve returns only by raising
