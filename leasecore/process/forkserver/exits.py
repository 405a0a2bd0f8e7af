"""How the fork server learns that a tree's leader exited, and reaps what is not a leader.

Owns ``Exits``: the leader's pidfd in the loop's selector (so a SIGCHLD need not ``waitid`` every
tree; without one, a kernel before 5.3 or no fd left, the exit is found at a SIGCHLD), the
``waitid(WNOWAIT)`` that reports the exit (``exited``, with what the tree used and its OOM kills) but
keeps the leader a zombie until its whole tree is dead (so the group ``kills.Killer`` signals is never
a recycled pid's), and the reaping of every other child that died here (adopted escapees): no zombies.

Must not touch: signals (``kills.py``), the socket (answers go through the ``reply`` it is handed).
Stdlib only, like every module the fork server imports. Threads: the fork server's main one and its
spawners (a leader's pidfd is registered at its start), under the fork server's lock.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
from collections.abc import Callable
from typing import Any

from leasecore.process.forkserver.trees import Tree, TreeTable
from leasecore.process.linux import cgroupfs, procfs


class Exits:
    """Watches the leaders' exits and reaps the rest; see the module docstring."""

    def __init__(
        self, table: TreeTable, selector: selectors.BaseSelector, reply: Callable[[dict[str, Any]], None]
    ) -> None:
        self._table = table
        self._selector = selector
        self._reply = reply
        self._pid = os.getpid()
        self._use_pidfds = procfs.IS_LINUX and hasattr(os, "pidfd_open")
        self.waitids = 0  # exit checks (``stats``)

    def watch(self, tree: Tree) -> None:
        """Watch the leader's exit through a pidfd: a SIGCHLD then need not ``waitid`` every tree.
        Without one (a kernel before 5.3, or no fd left) the tree's exit is found by ``reap``."""
        if not self._use_pidfds:
            return
        try:
            tree.pidfd = os.pidfd_open(tree.pid)
        except OSError as exc:
            if exc.errno in (errno.ENOSYS, errno.EINVAL):
                self._use_pidfds = False
            return
        try:
            self._selector.register(tree.pidfd, selectors.EVENT_READ, tree)
        except OSError:  # epoll full (ENOSPC, ENOMEM): found at a SIGCHLD instead
            os.close(tree.pidfd)
            tree.pidfd = -1

    def unwatch(self, tree: Tree) -> None:
        fd, tree.pidfd = tree.pidfd, -1
        if fd >= 0:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(fd)
            os.close(fd)

    def check(self, tree: Tree) -> None:
        """Report the leader's exit if it happened; it stays our zombie (WNOWAIT) until the tree is gone."""
        if tree.exited:
            return
        self.waitids += 1
        result = os.waitid(os.P_PID, tree.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        # Exited, or (if its pidfd woke us yet there is nothing to wait for) traced: only its tracer
        # (strace -p, gdb) sees the exit until it lets go, and the readable pidfd would wake us for
        # ever. Either way it is watched by SIGCHLD from now on (we get one when the tracer is done).
        self.unwatch(tree)
        if result is None:
            return
        tree.exited = True
        killed = result.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        # What the tree used: from its group where it has one, else the leader's own (and its reaped
        # children's) rusage. The OOM kills from the group's events, never guessed from a SIGKILL.
        usage, oom = cgroupfs.tree_usage(tree.pid, tree.cgroup)
        self._reply(
            {
                "op": "exited",
                "key": tree.key,
                "pid": tree.pid,
                "code": None if killed else result.si_status,
                "signal": result.si_status if killed else None,
                "resources": usage,
                "oom_kills": oom,
                "switch": tree.switched,  # ended by its dead-man's switch: the runner was stalled
                "switch_late": tree.switch.late if tree.switched and tree.switch else None,  # its lateness
            }
        )

    def reap(self) -> None:
        """At a SIGCHLD: the exits of the leaders no pidfd watches, and every other child reaped."""
        held = set()
        for tree in self._table.trees.values():
            held.add(tree.pid)
            if tree.pidfd < 0:  # watched by its pidfd otherwise
                self.check(tree)
        # Everything else that died here (adopted escapees) is reaped at once: no zombies.
        for pid in procfs.children_of(self._pid, threads=1) if procfs.IS_LINUX else []:
            if pid not in held:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
