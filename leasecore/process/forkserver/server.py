"""The fork server: a small process, started by the Supervisor, parent of every task tree.

Owns the task trees (``trees.Tree``, from spawn until every process of one is dead and reaped) and
every process below it. Driven over the control socket (``frames.py``; the messages:
``supervisor/forkserver_link.py``), it starts each command in a new session (``launch.py``: ``posix_spawn``,
on a spawner thread where it can, from inside its cgroup when the group has no limits; else ``forkexec.py``
for a cgroup, rlimits or ``run_as``) with the three fds it was sent as 0-2 and the signals it ignores back
at default; is a child subreaper, so escapees (setsid, double fork) are re-parented here; reports
each exit from ``waitid(WNOWAIT)`` (a pidfd per leader, else at each SIGCHLD) but keeps the leader a
zombie until its whole tree is dead, so the group it signals is never a recycled pid's; kills a
tree's leftovers when its leader exits (TERM, KILL after the grace); batches the signals asked for
behind one /proc walk; ends a tree whose kill-by time the runner stopped renewing, on its own
(``switches.py``: the dead-man's switch of a stalled runner), never blocking on a runner that does not
read; and on EOF (the runner died or closed it) kills every tree and anything still below it, then exits.
It ignores SIGINT/SIGTERM/SIGHUP: how to stop is the runner's decision.

Owns ``ForkServer``, the message loop, composed of parts with one job each, all handed the one
``trees.TreeTable``: ``launch.Launcher`` starts trees, ``exits.Exits`` watches the leaders' exits and
reaps, ``kills.Killer`` signals, ticks and lets trees go, ``switches.Switches`` carries out the
dead-man's switches; ``grouppool.GroupPool`` keeps the v1 groups; ``frames.FrameBatch`` the answers.

Must not touch: processes that are not below it, the runner's state record (only the directories of
a dead runner's tasks are removed here). Imports stay stdlib only and few: it lives as long as the
runner and its memory counts in the runner's footprint (the Supervisor boots it without the package
``__init__`` files). Threads: the main one (this loop) and, on a host where posix_spawn waits long
for the exec, up to four spawner threads (``launch.py``), all touching the state only with
the lock (``Launcher.turn``) held: a turn of the loop holds it but for its select; a spawner's start
makes its system calls without it, then holds its tree under it if the loop sleeps, else leaves it
to the loop (``Launcher.collect``, woken through its own pipe). Signal handlers only wake the selector.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import os
import select
import selectors
import signal
import socket
import sys
import time
from typing import Any

from leasecore.process.forkserver.exits import Exits
from leasecore.process.forkserver.frames import FrameBatch, recv_frame, send_frame
from leasecore.process.forkserver.grouppool import GroupPool
from leasecore.process.forkserver.kills import TICK_SECONDS, Killer
from leasecore.process.forkserver.launch import Launcher
from leasecore.process.forkserver.switches import Switches, raise_priority
from leasecore.process.forkserver.trees import TreeTable
from leasecore.process.linux import cgroupfs, procfs

_GIVE_UP_SECONDS = 10.0
_BATCH_MAX = 256  # requests served between two looks at exits, fences and kills
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # by the fork server: the runner decides
_ENV_BASES_MOST = 64  # environment bases kept (the runner's link never counts on more: ENV_BASES_MOST)


class ForkServer:
    """The event loop over its parts; see the module docstring."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._pid = os.getpid()
        self._table = TreeTable()
        self._orphaned_dirs: list[str] = []  # set when the runner dies (EOF): see _remove_orphaned_dirs
        self._answers = FrameBatch(sock)  # this turn's answers, sent together at its end
        self._room_wanted = False  # the selector waits for room to send (answers wait: FrameBatch)
        self._waiting = select.poll()  # is another request waiting on the socket? (_serve_waiting)
        self._waiting.register(self._sock, select.POLLIN)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._collect_r, self._collect_w = os.pipe()  # a spawner thread's start is done (Launcher.collect)
        os.set_blocking(self._collect_w, False)
        self._selector = selectors.DefaultSelector()
        self._sigdef: list[int] = []  # filled in by ``run``; the launcher reads it at each start
        self._env_bases: dict[int, dict[str, str]] = {}  # ``env`` requests: what spawns' env is based on
        children_files = procfs.IS_LINUX and procfs.has_children_files(self._pid)
        self._groups = GroupPool()  # v1 groups without limits, reused once their tree is gone
        self._exits = Exits(self._table, self._selector, self._reply)
        self._switches = Switches(self._table, self._wake, _thread.get_ident())
        self._killer = Killer(self._table, self._groups, self._exits, self._switches, self._reply,
                              children_files=children_files)  # fmt: skip
        self._launcher = Launcher(self._table, self._groups, self._exits, self._switches, self._answers,
                                  self._reply, self._killer.signal, self._wake_collect, sigdef=self._sigdef,
                                  children_files=children_files)  # fmt: skip

    def run(self) -> None:
        """Serve until EOF or shutdown, then kill and reap everything and return."""
        procfs.become_subreaper()
        raise_priority()  # switches.py: the switches fire on time on a busy host (not the trees)
        for sig in _IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        self._sigdef[:] = [
            s
            for s in signal.valid_signals()
            if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) == signal.SIG_IGN
        ]
        signal.pthread_sigmask(signal.SIG_SETMASK, ())  # SIGCHLD must wake us, whatever we inherited
        signal.signal(signal.SIGCHLD, lambda *_: None)  # only to wake the selector
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._selector.register(self._collect_r, selectors.EVENT_READ)
        self._selector.register(self._sock, selectors.EVENT_READ)
        send_frame(self._sock, {"op": "ready", "pid": self._pid})
        turn = self._launcher.turn
        try:  # a turn that fails still sends what it answered (exits, starts) before we die
            while True:
                with turn:
                    if self._done():
                        break
                    timeout = self._switches.timeout(time.monotonic(),
                                                     TICK_SECONDS if self._killer.busy() else None)
                    self._want_room(self._answers.waiting)
                ready = self._selector.select(timeout)
                with turn:
                    self._take_turn(ready)
                self._launcher.hand_over()  # the starts it took to their threads, the lock free now
        finally:
            with turn:
                self._answers.flush(block=True)
        for group in self._killer.empty_groups + self._groups.drain():  # a last try; a next start's
            cgroupfs.remove(group)  # sweep removes the rest
        self._remove_orphaned_dirs()

    def _take_turn(self, ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        sigchld = False
        for key, _ in ready:
            if key.fileobj == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                sigchld = True
            elif key.fileobj == self._collect_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._collect_r, 4096)
            elif key.data is not None:  # a leader's pidfd: it exited
                self._exits.check(key.data)
        self._launcher.collect()  # the starts the spawner threads made: held and answered now
        # The socket: whatever waits on it now, whether the select said so or not (a process stopped in
        # it wakes on its timeout with the runner's renewals waiting). Room to send: the flush below.
        if not self._table.closing and self._waiting.poll(0) and not self._serve_waiting():
            # EOF without a shutdown: the runner died
            self._orphaned_dirs = [tree.directory for tree in self._table.trees.values()]
            self._orphaned_dirs += [directory for directory in self._table.inflight.values() if directory]
            self._begin_close(0.0)
        # Trees past their kill-by time, with the renewals that were waiting applied (one read late is
        # still true: the server extended the lease), die first; a spawn fires them before it starts.
        self._switches.fire(time.monotonic())
        self._killer.flush()
        if sigchld:  # only a SIGCHLD means an exit: a spawn request need not waitid every tree
            self._exits.reap()
        self._killer.tick()
        self._answers.flush()  # before the loop sleeps

    def _want_room(self, waiting: bool) -> None:
        """Wake the loop when the socket can take more, while answers wait (the runner not reading)."""
        if not self._table.closing and waiting != self._room_wanted:
            self._room_wanted = waiting
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if waiting else 0)
            self._selector.modify(self._sock, events)

    def _wake(self) -> None:
        """Wake the loop from its select (from another thread)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"\0")

    def _wake_collect(self) -> None:
        """Wake the loop to collect a start a spawner thread is done with (not as a SIGCHLD would:
        that wake-up reaps, which this one need not)."""
        with contextlib.suppress(BlockingIOError):
            os.write(self._collect_w, b"\0")

    def _remove_orphaned_dirs(self) -> None:
        """The runner died: remove the directories of the tasks it held (their input, maybe
        confidential, would otherwise wait in /tmp for a next start that may never come). The runner's
        record of them stays: the next start with its state directory still reports the tasks FAILED."""
        if not self._orphaned_dirs:
            return
        from leasecore.process.linux.leftovers import remove_tmpdir  # only now: it imports much we never need

        for directory in self._orphaned_dirs:
            remove_tmpdir(directory)

    # requests -------------------------------------------------------------------------------

    def _serve_waiting(self) -> bool:
        """Serve the request that woke us and every one already waiting behind it (bounded: a
        flood of requests must not starve reaping and killing); False on EOF."""
        for _ in range(_BATCH_MAX):
            if not self._serve_one():
                return False
            if self._table.closing:
                return True  # shutdown: the socket is no longer served
            if not self._waiting.poll(0):  # poll, not select: the socket's fd may be above 1023
                break
        return True

    def _serve_one(self) -> bool:
        try:
            frame = recv_frame(self._sock, maxfds=3)
        except (OSError, EOFError, ValueError):
            frame = None
        if frame is None:
            return False
        message, fds = frame
        op = message.get("op")
        if op == "spawn" and not self._whole_env(message):
            self._reply({"op": "spawn_failed", "id": message.get("id"), "errno": errno.EINVAL, "what": "env"})
        elif op == "spawn":
            if self._switches.fire(time.monotonic()):  # a tree past its kill-by time dies before any start
                self._killer.flush()
            if self._launcher.to_spawner(message, fds):
                return True  # answered from its spawner thread
            try:
                self._launcher.spawn(message, fds)
            except OSError as exc:  # EAGAIN from fork, EMFILE from pipe: that task fails, we go on
                self._reply({"op": "spawn_failed", "id": message.get("id"), "errno": exc.errno or 0,
                             "what": "fork"})  # fmt: skip
        elif op == "signal":
            if not self._killer.signal(message):
                self._launcher.keep_early(message)
        elif op == "kill_by":
            self._switches.renew(message)
        elif op == "shutdown":
            self._begin_close(float(message.get("grace", 0.0)))
        elif op == "stats":
            self._reply(self._stats(message))
        elif op == "env":
            if len(self._env_bases) >= _ENV_BASES_MOST:
                del self._env_bases[next(iter(self._env_bases))]  # the oldest
            self._env_bases[int(message["base"])] = dict(message["env"])
        for fd in fds:
            os.close(fd)
        return True

    def _whole_env(self, req: dict[str, Any]) -> bool:
        """Make a spawn's ``env`` whole from the base it names (``env_base``: its own ``env`` is what
        differs, ``env_drop`` the base's names left out); False when that base is not known."""
        if "env_base" not in req:
            return True
        base = self._env_bases.get(req.pop("env_base"))
        if base is None:
            return False
        env = {**base, **req["env"]}
        for name in req.pop("env_drop", ()):
            env.pop(name, None)
        req["env"] = env
        return True

    def _stats(self, req: dict[str, Any]) -> dict[str, Any]:
        groups, spawners, start_times = self._groups, self._launcher.spawners, self._launcher.start_times
        return {"op": "stats", "id": req.get("id"), "walks": self._killer.walks,
                "walked": self._killer.walked, "waitids": self._exits.waitids,
                "trees": len(self._table.trees), "groups_made": groups.made,
                "groups_reused": groups.reused, "groups_free": len(groups),
                "spawner_threads": spawners.threads if spawners else 0,
                "start_times_read": start_times.read, "start_times_off": start_times.off,
                **self._switches.stats()}  # fmt: skip

    def _begin_close(self, grace_seconds: float) -> None:
        self._table.closing_kill_at = time.monotonic() + grace_seconds
        with contextlib.suppress(OSError, ValueError):
            self._selector.unregister(self._sock)
        self._killer.close(signal.SIGTERM if grace_seconds > 0 else signal.SIGKILL)

    def _done(self) -> bool:
        table = self._table
        if table.closing_kill_at is None or table.inflight:  # (a start on a spawner thread: its tree next)
            return False
        if time.monotonic() > table.closing_kill_at + _GIVE_UP_SECONDS:
            return True  # something unkillable (D state): do not spin for ever
        if table.trees:
            return False
        return not any(procfs.live(procs := procfs.subtree(self._pid, threads=1), procs))

    def _reply(self, message: dict[str, Any]) -> None:
        if self._table.closing and self._sock.fileno() < 0:
            return
        self._answers.add(message)


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``argv[0]`` is the inherited fd of the control socket."""
    args = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(args[0]))
    sock.set_inheritable(False)
    ForkServer(sock).run()


if __name__ == "__main__":
    main()
