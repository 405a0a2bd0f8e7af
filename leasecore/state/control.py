"""The runner's control socket: a local unix socket in the state directory, and its client.

Owns: ``<state_dir>/runner-<pid>.sock``, one per live runner, beside its status snapshot. A runner
listens with :class:`ControlServer`; ``conductor-run pause|resume|reload|drain`` finds the sockets
with :func:`control_sockets` and talks to each with :func:`send_request`.

The protocol: the client sends one JSON object on one line (``{"command": "pause", "task_types":
[...]}``, ``resume``, ``reload``, ``{"command": "drain", "timeout_seconds": 30}``); the runner answers
one JSON object on one line (``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``) and closes.

Security: only the runner's own user and root may use it. The socket is 0600 in the runner's 0700
state directory, and every connection's peer is checked again with ``SO_PEERCRED``: any other uid
is refused (and logged), whatever the file modes have become. A unix socket is not reachable over
the network. A request is at most :data:`MAX_REQUEST_BYTES` and must arrive within
:data:`REQUEST_TIMEOUT_SECONDS`; anything malformed is answered with an error, never raised.
A socket left by a dead runner is ignored by the client and removed (``remove_stale``).

Must not: change the runner's state: a request is handed to ``on_request``, which the runner makes
a put on its main loop's queue (the main thread acts, as for signals) and which returns the reply.
Threads: one ``control`` thread per runner, serving one connection at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import stat
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "COMMANDS",
    "MAX_REQUEST_BYTES",
    "ControlError",
    "ControlServer",
    "RunnerSocket",
    "control_sockets",
    "parse_request",
    "remove_stale",
    "send_request",
    "socket_path",
]

log = logging.getLogger("conductor_run.control")

COMMANDS = ("pause", "resume", "reload", "drain")
MAX_REQUEST_BYTES = 64 * 1024  # a request names a few task types: far less than this
MAX_REPLY_BYTES = 1024 * 1024
MAX_TASK_TYPES = 1000
REQUEST_TIMEOUT_SECONDS = 2.0  # to send a whole request; then the connection is dropped
_SOCKET_RE = re.compile(r"^runner-(\d{1,10})\.sock$")
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_MAX_PATH = 100  # sun_path holds 108 bytes; a longer path is reached through /proc/self/fd


class ControlError(Exception):
    """A control request could not be sent or its answer read (the message says why). ``stale``:
    nothing listens on the socket (its runner is gone, or going)."""

    def __init__(self, message: str, *, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


def socket_path(state_dir: Path, pid: int) -> Path:
    return state_dir / f"runner-{pid}.sock"


@dataclass(frozen=True)
class RunnerSocket:
    """A runner's control socket in a state directory."""

    pid: int
    path: Path


def control_sockets(state_dir: Path) -> list[RunnerSocket]:
    """The control sockets in ``state_dir``, by pid (a directory that cannot be read: OSError)."""
    found = []
    for entry in os.scandir(state_dir):
        match = _SOCKET_RE.match(entry.name)
        if match is not None:
            found.append(RunnerSocket(int(match.group(1)), Path(entry.path)))
    return sorted(found, key=lambda s: s.pid)


def parse_request(raw: bytes) -> dict[str, Any]:
    """A request line, checked: ``{"command", "task_types", "timeout_seconds"}``; ValueError saying why."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError("a request is one line of JSON") from None
    if not isinstance(data, dict):
        raise ValueError("a request is a JSON object")
    command = data.get("command")
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}: expected one of {', '.join(COMMANDS)}")
    types = data.get("task_types", [])
    if (not isinstance(types, list) or len(types) > MAX_TASK_TYPES
            or not all(isinstance(t, str) and 0 < len(t) <= 1000 for t in types)):
        raise ValueError("task_types must be a list of task type names")
    timeout = data.get("timeout_seconds")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not 0 <= timeout <= 10**9):
        raise ValueError("timeout_seconds must be a number of seconds, 0 or more")
    return {"command": command, "task_types": list(types),
            "timeout_seconds": None if timeout is None else float(timeout)}


@contextlib.contextmanager
def _reachable(path: Path) -> Iterator[str]:
    """``path`` as a unix socket address: itself, or through an open directory when it is too long."""
    if len(os.fsencode(path)) <= _MAX_PATH:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


class ControlServer:
    """Listens on this runner's control socket; each request goes to ``on_request`` (see the module)."""

    def __init__(self, state_dir: Path, on_request: Callable[[dict[str, Any]], dict[str, Any]], *,
                 pid: int | None = None) -> None:
        self.path = socket_path(state_dir, pid if pid is not None else os.getpid())
        self._on_request = on_request
        self._allowed = {os.geteuid(), 0}
        self._sock: socket.socket | None = None
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="control", daemon=True)

    def start(self) -> None:
        """Bind and listen (OSError if it cannot), then serve on the ``control`` thread."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            for stale in (tmp, self.path):  # ours by pid: a dead runner's that had this pid
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISSOCK(os.lstat(stale).st_mode):
                        os.unlink(stale)
            with _reachable(tmp) as address:
                sock.bind(address)
            sock.listen(8)  # listening before it has its name: a client that finds it is answered
            os.chmod(tmp, 0o600)  # ... and never finds it wider than this
            os.rename(tmp, self.path)
        except OSError:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._sock = sock
        for other in control_sockets(self.path.parent):  # dead runners' sockets: nothing will answer
            if other.pid != os.getpid() and remove_stale(other):
                log.info("removed the control socket of runner %d, which is gone", other.pid)
        self._thread.start()

    def close(self) -> None:
        """Stop listening and remove the socket (a request being answered is cut)."""
        self._closing.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
            self._thread.join(timeout=2.0)
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._closing.is_set():
                    return
                continue
            with conn:
                try:
                    self._answer(conn)
                except Exception:  # a thread's top level: one bad connection must not end the socket
                    log.exception("control socket: a request failed")

    def _answer(self, conn: socket.socket) -> None:
        pid, uid, _gid = _PEERCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          _PEERCRED.size))
        conn.settimeout(REQUEST_TIMEOUT_SECONDS)
        if uid not in self._allowed:
            log.warning("control socket: refused a request from uid %d (pid %d): only this runner's "
                        "user (uid %d) and root may control it", uid, pid, os.geteuid())
            with contextlib.suppress(OSError, ValueError):
                _read_line(conn, MAX_REQUEST_BYTES)  # (read, never used: the answer then reaches it)
            with contextlib.suppress(OSError):
                _send(conn, {"ok": False, "error": f"uid {uid} may not control this runner"})
            return
        try:
            raw = _read_line(conn, MAX_REQUEST_BYTES)
            request = parse_request(raw)
        except (ValueError, OSError) as exc:
            log.warning("control socket: a bad request from pid %d: %s", pid, exc)
            with contextlib.suppress(OSError):
                _send(conn, {"ok": False, "error": f"bad request: {exc}"})
            return
        reply = self._on_request(request)
        with contextlib.suppress(OSError):  # the client may have gone: the change is made all the same
            _send(conn, reply)


def send_request(path: Path, request: dict[str, Any], *, timeout_seconds: float = 10.0) -> dict[str, Any]:
    """Send one request to the socket at ``path`` and return the runner's answer; ControlError if not."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_seconds)
        try:
            with _reachable(path) as address:
                sock.connect(address)
        except OSError as exc:
            stale = isinstance(exc, ConnectionRefusedError | FileNotFoundError)
            raise ControlError(f"cannot connect to {path}: {exc.strerror or exc}", stale=stale) from None
        try:
            # The runner may answer (a refusal) and close before reading it all: read the answer anyway.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(json.dumps(request).encode() + b"\n")
            raw = _read_line(sock, MAX_REPLY_BYTES)
        except (OSError, ValueError) as exc:
            raise ControlError(f"no answer on {path}: {exc}") from None
    try:
        reply = json.loads(raw)
    except ValueError:
        raise ControlError(f"an answer on {path} is not JSON") from None
    if not isinstance(reply, dict):
        raise ControlError(f"an answer on {path} is not a JSON object")
    return reply


def remove_stale(sock: RunnerSocket) -> bool:
    """Remove the socket of a runner whose process is gone; True when removed."""
    from leasecore.state.statefile import ProcessState, probe_process

    if sock.pid == os.getpid() or probe_process(sock.pid, None) is not ProcessState.GONE:
        return False
    try:
        if not stat.S_ISSOCK(os.lstat(sock.path).st_mode):
            return False
        os.unlink(sock.path)
    except OSError:
        return False
    return True


def _read_line(conn: socket.socket, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = conn.recv(min(65536, limit + 1 - size))
        if not chunk:
            if size == 0:
                raise ValueError("the connection closed without a line")
            break
        chunks.append(chunk)
        size += len(chunk)
        if b"\n" in chunk:
            break
        if size > limit:
            raise ValueError(f"longer than {limit} bytes")
    line = b"".join(chunks).split(b"\n", 1)[0]
    if len(line) > limit:
        raise ValueError(f"longer than {limit} bytes")
    return line


def _send(conn: socket.socket, reply: dict[str, Any]) -> None:
    conn.sendall(json.dumps(reply).encode() + b"\n")
