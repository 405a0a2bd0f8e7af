"""The fork server's start of a command as another user (#24): fork, drop privileges, exec.

``posix_spawn`` (the fork server's usual path) cannot change the user, so a spawn request that
carries ``run_as`` (uid, gid, groups) is started here instead: the (single-threaded) fork server
forks, and the child, running nothing but system calls, makes itself a session leader, takes the
three fds as 0-2, resets the signals the fork server ignores, then ``setgroups``, ``setgid`` and
``setuid`` (in that order: each later one needs the privilege the earlier ones still have), then
``chdir`` (as the user: a directory it may not enter fails the start), empties its signal mask and
execs. A step that fails is written as ``errno:step`` to a close-on-exec pipe; the parent reads the
pipe to its end, which comes at the exec (or the failure), so the spawn is answered as posix_spawn's
is: once the command runs, or with the error and no child left.

The shutdown signals are blocked across the fork: a TERM sent before the child has reset them waits
instead of being ignored, and ends the child once it unblocks. Stdlib only (this runs in the fork
server, which imports as little as it can), and imported only when a request needs it.
"""

from __future__ import annotations

import errno
import os
import signal
from typing import Any

_BLOCKED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StepFailed(OSError):
    """The command could not be started as the user; ``step`` says which step failed."""

    def __init__(self, code: int, step: str) -> None:
        super().__init__(code, os.strerror(code) if code else "unknown error")
        self.step = step


def spawn_as(req: dict[str, Any], fds: list[int], sigdef: list[int]) -> int:
    """Start ``req``'s command (path, argv, env, cwd) as ``req["run_as"]``; returns its pid once it
    has exec'd, or raises ``StepFailed``."""
    run_as = req["run_as"]
    uid, gid, groups = int(run_as["uid"]), int(run_as["gid"]), [int(g) for g in run_as["groups"]]
    path, argv, env, cwd = req["path"], req["argv"], req["env"], req.get("cwd") or "/"
    err_r, err_w = os.pipe()  # close-on-exec, both ends
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _BLOCKED)
    try:
        pid = os.fork()
        if pid == 0:  # the child: nothing but system calls until exec
            os.close(err_r)
            _child(path, argv, env, cwd, fds, sigdef, uid, gid, groups, err_w)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    os.close(err_w)
    try:
        failure = b""
        while chunk := os.read(err_r, 256):  # EOF at the exec (close-on-exec) or after a failure
            failure += chunk
    finally:
        os.close(err_r)
    if not failure:
        return pid
    os.waitpid(pid, 0)  # it _exits right after writing
    code_text, _, step = failure.decode(errors="replace").partition(":")
    raise StepFailed(int(code_text) if code_text.isdigit() else 0, step or "exec")


def _child(path: str, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], sigdef: list[int],
           uid: int, gid: int, groups: list[int], err_w: int) -> None:
    step = "setsid"
    try:
        os.setsid()
        step = "stdio"
        for target, fd in enumerate(fds):
            os.dup2(fd, target)  # inheritable copies; every other fd is close-on-exec
        step = "signals"
        signal.set_wakeup_fd(-1)
        for sig in sigdef:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        step = "setgroups"
        os.setgroups(groups)
        step = "setgid"
        os.setgid(gid)
        step = "setuid"
        os.setuid(uid)
        step = "chdir"
        os.chdir(cwd)
        step = "exec"
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # a TERM already sent ends us here
        os.execve(path, argv, env)
    except BaseException as exc:  # the child must never return into the fork server
        code = getattr(exc, "errno", None) or errno.EINVAL
        try:
            os.write(err_w, f"{code}:{step}".encode())
        finally:
            os._exit(127)
    os._exit(127)  # pragma: no cover - execve does not return
