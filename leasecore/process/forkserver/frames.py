"""The frame codec of the control socket between the Supervisor and its fork server (both sides).

Owns the wire format, and nothing else: a 4-byte big-endian length, then that many bytes of one
JSON object; file descriptors travel as SCM_RIGHTS with a frame's first bytes and always arrive
close-on-exec. Which messages exist and what they carry is ``supervisor/forkserver_link.py``'s (the runner's
side) and ``server.py``'s (the other side); this module never looks inside a message.

Must not touch: anything but the socket or buffer it is handed. Stdlib only and few imports: the
fork server imports it (its memory counts in the runner's footprint, see ``server.py``).

Threads: ``send_frame`` runs on whichever runner thread sends (callers serialise sends with the
link's lock) and on the fork server's one thread; ``recv_frame`` on the fork server's thread and
at the handshake; ``take_frames`` on the Supervisor's reader thread, which never blocks on the
socket: it keeps what came of a frame until the rest arrives.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import socket
import struct
from typing import Any

HEADER = struct.Struct(">I")
# json.dumps's C encoder, made once instead of at every call (``JSONEncoder.iterencode`` makes one per
# message): the same text (ASCII, ", " and ": ", NaN allowed, TypeError for what JSON cannot hold),
# without the check for circular containers (a message is a tree of plain values made here). Both
# sides encode every request and answer with it (three answers and a request or two per task).
def _c_encoder() -> Any:
    make = getattr(json.encoder, "c_make_encoder", None)
    try:  # (markers, default, encoder, indent, key_separator, item_separator, sort_keys, skipkeys, allow_nan)
        return make and make(None, json.JSONEncoder().default, json.encoder.encode_basestring_ascii, None,
                             ": ", ", ", False, False, True)  # fmt: skip
    except TypeError:  # another Python's signature: json.dumps then
        return None


_ENCODE = _c_encoder()


def encode_frame(message: dict[str, Any]) -> bytes:
    """One framed JSON message, as ``send_frame`` sends it (frames may be sent back to back)."""
    body = ("".join(_ENCODE(message, 0)) if _ENCODE else json.dumps(message)).encode()
    return HEADER.pack(len(body)) + body


def send_frame(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    """Send one framed JSON message (and, with the first bytes, ``fds``)."""
    data = encode_frame(message)
    if fds:
        sent = socket.send_fds(sock, [data], fds)
        data = data[sent:]
    if data:
        sock.sendall(data)


class FrameBatch:
    """Frames queued to go out together in one write, in order: the fork server's answers of one
    turn of its loop (a task's "exited" and "gone", several "spawned") wake the runner's reader once,
    not once each. Past ``max_bytes`` queued they go at once. A send that fails is dropped (the
    runner is gone or going: its reader sees the socket's end).

    Never blocks while the runner does not read (stopped, deadlocked: its dead-man's switches must
    still fire): what the socket does not take now waits in ``unsent`` (``waiting``), sent by the next
    ``flush`` (the fork server's loop waits for the socket to be writable meanwhile), up to
    ``max_unsent`` bytes (far above what its trees' events come to), past which a flush blocks."""

    def __init__(self, sock: socket.socket, max_bytes: int = 1 << 18, max_unsent: int = 1 << 26) -> None:
        self._sock = sock
        self._max_bytes = max_bytes
        self._max_unsent = max_unsent
        self._frames: list[bytes] = []
        self._bytes = 0
        self.unsent = bytearray()

    def add(self, message: dict[str, Any]) -> None:
        frame = encode_frame(message)
        self._frames.append(frame)
        self._bytes += len(frame)
        if self._bytes > self._max_bytes:
            self.flush()

    @property
    def waiting(self) -> bool:
        """Bytes wait for the socket to take them."""
        return bool(self.unsent)

    def flush(self, *, block: bool = False) -> None:
        """Send what is queued; ``block``: all of it, waiting for the socket (the fork server's last)."""
        if self._frames:
            self.unsent += b"".join(self._frames)
            self._frames.clear()
            self._bytes = 0
        if not self.unsent:
            return
        if self._sock.fileno() < 0:
            self.unsent.clear()
            return
        try:
            while self.unsent:
                sent = self._sock.send(self.unsent, socket.MSG_DONTWAIT)
                del self.unsent[:sent]
        except BlockingIOError:  # the runner does not read now: later (the loop waits for room)
            if block or len(self.unsent) > self._max_unsent:
                with contextlib.suppress(OSError):
                    self._sock.sendall(self.unsent)
                self.unsent.clear()
        except OSError:  # the runner is gone: its end of the socket is closed
            self.unsent.clear()


def recv_frame(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one framed message and the fds sent with it; None on EOF."""
    # Not socket.recv_fds: it drops its flags argument (3.11), and the fds must arrive close-on-exec
    # (a spawn passes on only the three it dup2s onto 0-2; everything else stays in the fork server).
    cmsg_flag = getattr(socket, "MSG_CMSG_CLOEXEC", 0)
    space = socket.CMSG_LEN(maxfds * 4) if maxfds else 0
    header, ancdata, _flags, _addr = sock.recvmsg(HEADER.size, space, cmsg_flag)
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    if not cmsg_flag:
        for fd in fds:
            os.set_inheritable(fd, False)
    if not header:
        return None
    header += _recv_exactly(sock, HEADER.size - len(header))
    (length,) = HEADER.unpack(header)
    return json.loads(_recv_exactly(sock, length)), list(fds)


def take_frames(buffer: bytearray) -> list[dict[str, Any]]:
    """Remove the complete messages at the start of ``buffer`` (bytes received so far from a socket
    that carries no fds) and return them; an incomplete one stays there for more bytes. ValueError
    for a message that is not JSON."""
    messages = []
    start = 0
    while len(buffer) - start >= HEADER.size:
        (length,) = HEADER.unpack_from(buffer, start)
        end = start + HEADER.size + length
        if len(buffer) < end:
            break
        messages.append(json.loads(bytes(buffer[start + HEADER.size : end])))
        start = end
    del buffer[:start]
    return messages


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    chunks = []
    while count > 0:
        chunk = sock.recv(min(count, 1 << 20))
        if not chunk:
            raise EOFError("control socket closed mid-message")
        chunks.append(chunk)
        count -= len(chunk)
    return b"".join(chunks)
