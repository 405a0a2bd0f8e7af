"""The runner's link to its fork server: the process, the socket, the boot, and the message protocol.

Owns the fork server's ``Popen`` and the runner's end of the control socket (a Unix stream
socketpair), the lock that serialises sends, the calls waiting for an answer, the boot script and
the ``ready`` handshake, the restart after a death and the stop. Frames are ``frames.py``'s; the
messages, both ways:

- requests: ``spawn`` (id, key, path, argv, env, cwd, token, grace, dir, cgroup, rlimits, run_as,
  kill_by; with 3 fds: stdin, stdout, stderr; with ``env_base``, its ``env`` holds only what differs
  from that base, and ``env_drop`` the base's names left out), ``env`` (base, env: a base the
  spawns after it name; ``send_spawn`` sends each once per fork server), ``signal`` (key, sig,
  grace, since, at), ``kill_by`` (trees: [[key, TERM at, KILL at], ...]: the dead-man's switches),
  ``shutdown`` (grace), ``stats`` (id);
- events: ``ready`` (pid), ``spawned`` (id, key, pid, start: its start time) / ``spawn_failed`` (id,
  errno, what: the step that failed), ``stats`` (id, walks, walked, waitids, trees, switch_*), ``exited``
  (key, pid, code, signal, resources, oom_kills, switch, switch_late), ``gone`` (key).

Must not touch: the reading of events (the Supervisor's reader thread reads the socket), children,
the state record. Threads: constructed with the Supervisor, restarted on the thread that starts a
spawn (the Supervisor serialises restarts); ``send`` and ``call`` from any thread; ``answered`` and
``lost`` on the reader thread; ``wait_exit``, ``shutdown`` and ``close`` on the closing thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import leasecore
from leasecore.errors import ProcessError
from leasecore.process.forkserver.frames import recv_frame, send_frame

# one logger for the runner's side of process/
log = logging.getLogger("leasecore.process.supervisor.supervisor")

# Boots the fork server from the source tree at argv[1] *without* running leasecore/__init__.py and
# leasecore/process/__init__.py (bare package stubs stand in): those import the runner's side
# (models, subprocess, threading, logging), doubling the fork server's memory for nothing.
# The __init__.py of forkserver/ and linux/ do run: each is a docstring only, and must stay so.
FORKSERVER_BOOT = (
    "import sys, types\n"
    "for name in ('leasecore', 'leasecore.process'):\n"
    "    stub = types.ModuleType(name)\n"
    "    stub.__path__ = [sys.argv[1] + '/' + name.replace('.', '/')]\n"
    "    sys.modules[name] = stub\n"
    "from leasecore.process.forkserver.server import main\n"
    "main(sys.argv[2:])\n"
)
REPLY_TIMEOUT_SECONDS = 30.0  # for the handshake, a spawn's answer, a stats call
# Environment bases a fork server keeps (server.py keeps the last ENV_BASES_MOST it was sent; the
# link forgets every base it sent once it sent that many, and sends them again under new numbers).
ENV_BASES_MOST = 64


class ForkServerLink:
    """A running fork server and the socket to it; ProcessError if it does not start."""

    def __init__(
        self, boot_script: str = FORKSERVER_BOOT, handshake_timeout_seconds: float = REPLY_TIMEOUT_SECONDS
    ) -> None:
        self._boot_script = boot_script
        self._handshake_timeout_seconds = handshake_timeout_seconds
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()  # guards the calls below and _lost
        self._calls: set[int] = set()  # request ids a call waits for
        self._replies: dict[int, dict[str, Any]] = {}  # their answers, by request id
        self._lost = False  # the fork server died; set until restart
        # Environment bases this fork server was sent (send_spawn), by id of the runner's dict: the
        # dict (kept, so that its id is not another's) and its number. Under the send lock.
        self._bases: dict[int, tuple[dict[str, str], int]] = {}
        self._base_numbers = 0
        self.sock, self.process = self._start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: dict[str, Any], fds: list[int] | None = None) -> None:
        """One request (and its fds); ProcessError if the fork server is gone."""
        try:
            with self._send_lock:
                send_frame(self.sock, message, fds)
        except OSError as exc:
            raise ProcessError("the fork server is gone") from exc

    def send_spawn(self, message: dict[str, Any], fds: list[int], base: dict[str, str]) -> None:
        """A ``spawn`` request whose ``env`` is sent as what differs from ``base`` (a dict the caller
        keeps unchanged: the inherited environment of its spec), ``base`` itself going once per fork
        server, before the first spawn that names it. The spawn's environment is the same; the request
        is a tenth of the size (the inherited environment is most of it), which is CPU saved in the
        runner's encoding and the fork server's decoding of every spawn. ProcessError if it is gone."""
        env: dict[str, str] = message["env"]
        try:
            with self._send_lock:
                known = self._bases.get(id(base))
                if known is None or known[0] is not base:
                    if len(self._bases) >= ENV_BASES_MOST:
                        self._bases.clear()
                    self._base_numbers += 1
                    known = self._bases[id(base)] = (base, self._base_numbers)
                    send_frame(self.sock, {"op": "env", "base": known[1], "env": base})
                message["env_base"] = known[1]
                get = base.get
                message["env"] = differs = {name: value for name, value in env.items() if get(name) != value}
                # The names env shares with base, value and all, number len(env) - len(differs): when
                # that is all of base, none is dropped (the usual spawn: no second pass over base).
                if len(env) - len(differs) != len(base):
                    dropped = [name for name in base if name not in env]
                    if dropped:
                        message["env_drop"] = dropped
                send_frame(self.sock, message, fds)
        except OSError as exc:
            raise ProcessError("the fork server is gone") from exc
        finally:
            message["env"] = env  # the caller's message as it was (a retry, a log)
            message.pop("env_base", None)
            message.pop("env_drop", None)

    def call(
        self, request_id: int, message: dict[str, Any], fds: list[int], timeout_seconds: float
    ) -> dict[str, Any]:
        """Send ``message`` as request ``request_id`` and wait for its answer (``{"op": "lost"}`` if
        the fork server died first); ProcessError if none came within ``timeout_seconds``."""
        message["id"] = request_id
        with self._cond:
            self._calls.add(request_id)
        try:
            self.send(message, fds)
            with self._cond:
                if not self._cond.wait_for(lambda: request_id in self._replies or self._lost,
                                           timeout=timeout_seconds):  # fmt: skip
                    raise ProcessError(f"the fork server did not answer a {message['op']} request")
                return self._replies.pop(request_id, {"op": "lost"})
        finally:
            with self._cond:
                self._calls.discard(request_id)

    def answered(self, request_id: int, event: dict[str, Any]) -> bool:
        """Whether ``event`` answers a ``call`` (then handed to its caller). On the reader thread."""
        with self._cond:
            if request_id not in self._calls:
                return False
            self._replies[request_id] = event
            self._cond.notify_all()
            return True

    def lost(self) -> None:
        """The fork server died (its socket's end was read): every call waiting gets ``lost``."""
        with self._cond:
            self._lost = True
            self._cond.notify_all()

    def restart(self, on_swap: Callable[[], None]) -> None:
        """After the fork server died: reap it and start a new one. ``on_swap()`` is called with the
        send lock held, right after the new socket replaced the old (no send goes to either between)."""
        with contextlib.suppress(OSError):
            self.process.kill()
        self.process.wait()
        sock, process = self._start()
        with self._send_lock:
            old, self.sock, self.process = self.sock, sock, process
            with self._cond:
                self._lost = False
                self._replies.clear()
            self._bases.clear()  # the new fork server was sent none
            on_swap()
        old.close()

    def wait_exit(self, timeout_seconds: float) -> bool:
        """Wait for the fork server to exit (after a ``shutdown``); KILL it past ``timeout_seconds``.
        Returns False if it had to be killed (the trees it held may live on)."""
        try:
            self.process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return False
        return True

    def shutdown(self) -> None:
        """Shut the socket down both ways: the reader thread sees its end."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.sock.close()

    def _start(self) -> tuple[socket.socket, subprocess.Popen[bytes]]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = str(Path(leasecore.__file__).resolve().parent.parent)
        try:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", self._boot_script, root, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                # Its own process group: a SIGKILL of the runner's group (kill -9 -PGID) leaves it to see
                # the runner die and kill every tree, instead of taking it along and leaving them all.
                process_group=0,
                env={},  # the fork server needs nothing from the runner's environment (credentials!)
            )  # fmt: skip
        except OSError as exc:
            ours.close()
            raise ProcessError(f"could not start the fork server: {exc.strerror}") from exc
        finally:
            theirs.close()
        ours.settimeout(self._handshake_timeout_seconds)
        try:
            frame = recv_frame(ours)
        except (OSError, EOFError, ValueError) as exc:
            frame = None
            log.debug("fork server handshake failed: %s", exc)
        if frame is None or frame[0].get("op") != "ready":
            process.kill()
            process.wait()
            ours.close()
            raise ProcessError("the fork server did not start (see its error output above)")
        ours.settimeout(None)
        return ours, process


def spawn_failure(argv0: str, reply: dict[str, Any]) -> str:
    """The reason a ``spawn_failed`` event (or a lost fork server) gives for a command that never ran."""
    errno_value = int(reply.get("errno") or 0)
    why = os.strerror(errno_value) if errno_value else "unknown error"
    if errno_value == errno.ENOEXEC:
        why += "; a script needs a #! line"
    what = {"cgroup": "joining its cgroup", "rlimit": "setting its rlimits"}.get(
        str(reply.get("what")), reply.get("what", "?"))
    return f"cannot start {argv0!r}: {why} (while doing {what})"
