"""The fork server's second way to start a command: fork, set the child up, exec. Stdlib only.

Owns ``fork_exec(req, fds, sigdef)``, used when ``posix_spawn`` cannot do the job: it can neither
move the child into a cgroup before its exec (a command that joined its group only after its exec
could fork first, and those children would stay outside), nor set rlimits, nor change the user
(``run_as``: uid, gid, groups). A group with no limits is joined without a fork (the fork
server calls posix_spawn from inside it, ``cgroupfs.spawn_inside``), so this runs for a request
with a ``cgroup`` that is not ``inside``, ``rlimits`` or ``run_as``. The child, running nothing but
system calls, does in order: join its group (0 to ``cgroup.procs`` in each hierarchy), set the
rlimits (soft = hard, while it still has the privilege), a new session with the request's fds as
0-2 and the ignored signals back to default, ``setgroups``/``setgid``/``setuid`` (each later one
needs the privilege the earlier ones still have), the working directory (as the user), an empty
mask, the exec. A failing step is written to a close-on-exec pipe (``errno:step``) and the child
exits 127 without running the command; the parent reads the pipe to EOF, so it answers only after
the exec, as with posix_spawn, raising :class:`StepFailed` (which names the step). The shutdown
signals are blocked across the fork: a TERM sent before the child reset them waits instead.

Must not touch, in the child: anything of the fork server's but those calls; it never returns into
the fork server's loop (any error ends it with ``os._exit(127)``). Threads: the fork server's main
thread. Its spawner threads (``spawners.py``), if any, wait on their queue or in libc's posix_spawn
meanwhile; the child, which has only the forking thread, touches nothing of theirs. Imported only when
a request needs it (its cost: docs/benchmarks.md).
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
            from leasecore.process.linux import cgroupfs

            cgroupfs.join_self(group)
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
