"""Reading one HTTP/1.1 answer off a blocking socket for the lean transport, and its error tree.

Owns: :class:`AnswerReader` (the status line and header section, bounded to 64 KiB and 100 fields;
the body framed by Content-Length, chunked or the connection's end under the shared strict rules of
:mod:`leasecore.http_framing`, bounded by ``max_body_bytes``; every ``recv`` bounded by what is left
of the attempt's deadline through ``SO_RCVTIMEO``), :func:`seconds_left` and :func:`arm` (the deadline
as the kernel's per-call timeout), and the ``HTTPException`` tree, named and shaped as
``http.client``'s, which is not imported (it loads ``ssl`` and ``email``: start-up time and memory).

Must not: send, pool or resend (``conductor.lean``), translate errors (``conductor.calls``), retry.
Threads: the calling thread only; one reader per answer, never shared.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from collections.abc import Callable

from leasecore.http_framing import CHUNKED, BodyTooLarge, body_length, read_chunked

__all__ = [
    "AnswerReader",
    "AnswerTooLarge",
    "BadStatusLine",
    "HTTPException",
    "IncompleteRead",
    "InvalidURL",
    "LineTooLong",
    "RemoteDisconnected",
    "arm",
    "seconds_left",
]

RECV_BYTES = 64 * 1024  # the most one recv asks for
MAX_HEAD_BYTES = 64 * 1024  # the status line and every header field together
MAX_FIELDS = 100  # http.client's limit too


class HTTPException(Exception):
    """The answer (or the request) breaks HTTP/1.1: the connection cannot be trusted any more."""


class InvalidURL(HTTPException):
    """A target that cannot be sent as a request line."""


class BadStatusLine(HTTPException):
    """The first line of the answer is not an HTTP status line."""


class LineTooLong(HTTPException):
    """The status line and headers, a chunk-size or a trailer line are over their bound."""


class IncompleteRead(HTTPException):
    """The connection ended inside the body."""

    def __init__(self, partial: bytes, expected: int | None = None) -> None:
        super().__init__(partial, expected)
        self.partial = partial
        self.expected = expected

    def __str__(self) -> str:
        more = f", {self.expected} more expected" if self.expected is not None else ""
        return f"IncompleteRead({len(self.partial)} bytes read{more})"


class RemoteDisconnected(ConnectionResetError, BadStatusLine):
    """The server closed the connection before the status line."""


AnswerTooLarge = BodyTooLarge  # the answer's body passed the size limit; the connection was dropped

class AnswerReader:
    """Reads one answer from a blocking socket, every ``recv`` bounded by the deadline."""

    def __init__(self, sock: socket.socket, deadline: float, monotonic: Callable[[], float]) -> None:
        self._sock = sock
        self._deadline = deadline
        self._monotonic = monotonic
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received past the answer (a server that says more than it was asked: not reused)."""
        return len(self._buf)

    def head(self) -> tuple[int, bool, dict[bytes, bytes]]:
        """(status, whether the server keeps the connection open, lower-cased header fields)."""
        end = self._find(b"\r\n\r\n", MAX_HEAD_BYTES, "answer's header section", first=True)
        if end > MAX_HEAD_BYTES:
            raise LineTooLong("answer's header section")
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status_line = lines[0]
        parts = status_line.split(None, 2)
        version, code = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise BadStatusLine(repr(status_line[:100]))
        status = int(code)
        if len(lines) - 1 > MAX_FIELDS:
            raise HTTPException(f"got more than {MAX_FIELDS} header fields")
        fields: dict[bytes, bytes] = {}
        name = b""
        for line in lines[1:]:
            if line[:1] in (b" ", b"\t") and name:  # obsolete line folding: part of the field above
                fields[name] += b" " + line.strip()
                continue
            name, colon, value = line.partition(b":")
            name = name.strip().lower()
            if not colon or not name:
                raise HTTPException(f"malformed header line {line[:100]!r}")
            value = value.strip()
            if name in fields:  # repeated: a list (RFC 9110 5.3); body_length checks Content-Length agrees
                fields[name] += b", " + value
            else:
                fields[name] = value
        tokens = [t.strip() for t in fields.get(b"connection", b"").lower().split(b",")]
        keep_alive = b"close" not in tokens if version == b"HTTP/1.1" else b"keep-alive" in tokens
        return status, keep_alive, fields

    def body(
        self, method: str, status: int, fields: dict[bytes, bytes], max_bytes: int
    ) -> tuple[bytes, bool]:
        """(the body, whether it was framed: a body read to the connection's end is not)."""
        if method == "HEAD" or status in (204, 304):
            return b"", True
        coding, length = fields.get(b"transfer-encoding"), fields.get(b"content-length")
        if coding is None and length is not None and length.isdigit() and len(length) <= 19:
            plain = int(length)  # the usual answer: one plain Content-Length (body_length's rules, short)
            if plain > max_bytes:
                raise AnswerTooLarge(max_bytes, "answer")
            return self._exactly(plain), True
        size = body_length(
            () if coding is None else (coding.decode("latin-1"),),
            () if length is None else (length.decode("latin-1"),),
            max_bytes,
            what="answer",
        )
        if size == CHUNKED:
            return read_chunked(self._line, self._exactly, max_bytes, what="answer"), True
        if size is not None:
            return self._exactly(size), True
        return self._to_end(max_bytes), False

    def _recv(self) -> bytes:
        """One ``recv`` that never waits past the deadline. The receive timeout a connection keeps
        between calls is armed again only when it is longer than what is left (a ``setsockopt`` a
        call fewer on a kept-alive connection): armed in whole seconds (below one second, exactly),
        so the next calls with the usual timeouts find it short enough. A wait cut short by such a
        timeout, with time left, goes on with the rest armed."""
        sock = self._sock
        while True:
            left = seconds_left(self._deadline, self._monotonic)
            armed: float = getattr(sock, "rcv_armed", 0.0)
            exact = False
            if not 0.0 < armed <= left:
                armed = float(int(left)) if left >= 1.0 else left
                exact = armed == left
                arm(sock, socket.SO_RCVTIMEO, armed)
                with contextlib.suppress(AttributeError):  # (a plain socket keeps no figure)
                    sock.rcv_armed = armed  # type: ignore[attr-defined]
            try:
                return sock.recv(RECV_BYTES)
            except BlockingIOError:  # SO_RCVTIMEO ran out: the deadline's, or a shorter armed one
                if exact:
                    raise TimeoutError("timed out") from None

    def _exactly(self, size: int) -> bytes:
        if len(self._buf) >= size:
            data = bytes(self._buf[:size])
            del self._buf[:size]
            return data
        parts = [bytes(self._buf)]
        have = len(self._buf)
        self._buf.clear()
        while have < size:
            data = self._recv()
            if not data:
                raise IncompleteRead(b"".join(parts), size - have)
            if have + len(data) > size:
                self._buf += data[size - have :]
                data = data[: size - have]
            parts.append(data)
            have += len(data)
        return b"".join(parts)

    def _find(self, delimiter: bytes, limit: int, what: str, *, first: bool = False) -> int:
        """Where ``delimiter`` starts in the buffer, receiving until it comes (at most ``limit`` bytes
        before it). ``first``: nothing of the answer read yet, so an EOF now is the server closing an
        idle connection (RemoteDisconnected), not a cut answer."""
        start = 0
        while (end := self._buf.find(delimiter, start)) < 0:
            if len(self._buf) > limit:
                raise LineTooLong(what)
            start = max(0, len(self._buf) - len(delimiter) + 1)
            data = self._recv()
            if not data:
                if first and not self._buf:
                    raise RemoteDisconnected("Remote end closed connection without response")
                raise IncompleteRead(bytes(self._buf))
            self._buf += data
        return end

    def _line(self, limit: int) -> bytes:
        """The next line with its ``\\n``, or ``limit + 1`` bytes without one (read_chunked refuses
        it); the connection ending first is a cut answer (IncompleteRead)."""
        try:
            end = self._find(b"\n", limit, "chunk size or trailer line")
        except LineTooLong:
            end = len(self._buf)
        if end >= limit + 1:  # longer than the limit: cut there, without its "\n"
            line = bytes(self._buf[: limit + 1])
            del self._buf[: limit + 1]
            return line
        line = bytes(self._buf[: end + 1])
        del self._buf[: end + 1]
        return line

    def _to_end(self, max_bytes: int) -> bytes:
        parts = [bytes(self._buf)]
        self._buf.clear()
        total = len(parts[0])
        while total <= max_bytes and (data := self._recv()):
            total += len(data)
            parts.append(data)
        if total > max_bytes:
            raise AnswerTooLarge(max_bytes, "answer")
        return b"".join(parts)


def seconds_left(deadline: float, monotonic: Callable[[], float]) -> float:
    """Seconds left before ``deadline``; TimeoutError once none are."""
    left = deadline - monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def arm(sock: socket.socket, option: int, seconds: float) -> None:
    """Bound the socket's next sends or receives to ``seconds`` (never 0: that means for ever)."""
    whole = min(int(seconds), 2**31 - 1)
    micros = min(999_999, int((seconds - whole) * 1_000_000))
    if whole == 0:
        micros = max(1, micros)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micros))

