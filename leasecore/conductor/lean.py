"""A lean keep-alive HTTP/1.1 transport on a plain socket for the Conductor client's plain-HTTP calls.

Why: a ``requests`` call costs about 1 ms of CPU (session merging, hooks, urllib3's pool, header
objects), and even ``http.client`` ~0.17 ms (its header parsing goes through ``email.parser``, and a
socket with a timeout polls before every send and read). The runner makes several calls per task
(poll, update, heartbeats, ownership checks) on the same 2 cores as its children, from several
threads: each system call that releases the GIL in a busy process can cost a thread switch, so the
exchange here is one ``send`` and, for a small answer, one ``recv``.

What it keeps:

* one deadline bounds the whole attempt: connecting, sending, the status line and headers, and every
  read of the body (the kernel times each send and receive: ``SO_SNDTIMEO``/``SO_RCVTIMEO`` are set
  to what is left before each step);
* a bounded pool of idle keep-alive connections shared by every thread (LIFO: the warmest first);
  a connection the server closed while it sat idle is noticed before use (a peek finds EOF) and
  dropped;
* a reused connection that turns out dead (reset, closed before the status line) is replaced once by
  a fresh one, but only for a call the caller marks ``idempotent``: never for a poll, whose lost
  answer would lose claimed tasks;
* answers framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of the connection,
  by the same strict rules and chunked parser as the embedded server's requests
  (:mod:`leasecore.http_framing`: ``gzip, chunked``, Content-Length beside Transfer-Encoding, a bad
  chunk size are refused, never guessed); interim ``1xx`` answers skipped; ``Connection: close`` (and
  HTTP/1.0) honoured; the status line and headers bounded (64 KiB, 100 fields), the body by
  ``max_body_bytes``;
* the host name resolved within the deadline too (:mod:`leasecore.conductor.resolve`; a literal IP skips it);
* errors are raised as ``OSError``, this module's ``HTTPException`` tree (named and shaped as
  ``http.client``'s, which is not imported: it imports ``ssl`` and ``email``, about 5 MB of a runner's
  RSS, #23) or :class:`~leasecore.http_framing.FramingError`: the caller translates them
  (``conductor_http.translate_errors``), so the mapping lives in one place.

Plain ``http://`` only, and only when no proxy applies to the host (``requests`` honours
``HTTP_PROXY``; this transport does not speak to proxies). Everything else stays on ``requests``.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import struct
import threading
from collections.abc import Callable, Mapping

from leasecore.conductor.resolve import BoundedResolver
from leasecore.http_framing import CHUNKED, BodyTooLarge, FramingError, body_length, read_chunked

__all__ = [
    "AnswerTooLarge",
    "BadStatusLine",
    "HTTPException",
    "IncompleteRead",
    "InvalidURL",
    "LeanTransport",
    "LineTooLong",
    "RemoteDisconnected",
    "StaleConnection",
]

log = logging.getLogger(__name__)

_CHUNK = 64 * 1024
_MAX_HEAD_BYTES = 64 * 1024  # the status line and every header field together
_MAX_FIELDS = 100  # http.client's limit too
_INLINE_BODY_BYTES = 64 * 1024  # a body up to this size goes out in the same send as the head
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 token)
_BAD_VALUE = re.compile(r"[\r\n\0]")  # what would end a header line early (header injection)
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # a request target never holds controls or spaces
_PEEK = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)


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


class StaleConnection(ConnectionError):
    """A reused keep-alive connection died before the server answered (and the call was not retried)."""


AnswerTooLarge = BodyTooLarge  # the answer's body passed the size limit; the connection was dropped


class LeanTransport:
    """Keep-alive HTTP/1.1 to one ``host:port``; thread-safe; ``max_idle`` connections kept warm.

    A :class:`~leasecore.conductor.transport.Transport`; ``max_body_bytes`` bounds every answer's body.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        max_idle: int,
        monotonic: Callable[[], float],
        max_body_bytes: int = 256 * 1024 * 1024,
        resolver: BoundedResolver | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._max_body_bytes = max_body_bytes
        self._resolver = resolver or BoundedResolver()
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal is bracketed in Host
        self._host_field = f"Host: {name}" if port == 80 else f"Host: {name}:{port}"
        self._max_idle = max_idle
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._busy: set[socket.socket] = set()  # connections under a call now (abort cuts them)
        self._closed = False
        self.generation = 0  # aborts so far: a call started before the latest one is cut
        self.opened = 0  # connections made so far (diagnostics, tests)

    @property
    def connections_opened(self) -> int:
        return self.opened

    def close(self) -> None:
        """Close every idle connection; one in use is closed when its call ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def abort(self) -> None:
        """Cut every call in flight now (a forced stop, #24): their sockets are shut down, so a
        blocked send or recv returns at once instead of at its deadline; idle ones are closed. Later
        calls go on as usual (the caller bounds them). Thread-safe."""
        with self._lock:
            self.generation += 1
            busy = list(self._busy)
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
        for sock in busy:
            _cut(sock)

    def send(
        self,
        method: str,
        target: str,
        body: bytes | None,
        headers: Mapping[str, str],
        deadline: float,
        *,
        idempotent: bool,
        generation: int | None = None,
    ) -> tuple[int, bytes]:
        """One exchange: (status, the whole body). Raises ``OSError``/``HTTPException`` (``TimeoutError``
        when the deadline passes), ``FramingError`` for an answer that cannot be delimited
        (``AnswerTooLarge`` for a body over ``max_body_bytes``), ``ValueError`` for a target or header
        that cannot be sent as is. ``generation``: ``self.generation`` when the caller's call began;
        an ``abort`` since then cuts this exchange too."""
        max_body_bytes = self._max_body_bytes
        request = self._request_bytes(method, target, body, headers)
        sock, reused = self._take(deadline)
        self._track(sock, generation)
        try:
            return self._exchange(sock, method, request, body, deadline, max_body_bytes)
        except (ConnectionError, RemoteDisconnected, BadStatusLine) as exc:
            sock.close()
            if not reused:
                raise
            if not idempotent:
                raise StaleConnection(f"a kept-alive connection died under the request ({exc!r})") from exc
        except BaseException:
            sock.close()
            raise
        finally:
            self._untrack(sock)
        # A dead keep-alive connection: once more on a fresh one (idempotent calls only).
        log.debug(
            "a kept-alive connection died under %s %s; sending it once more on a new one", method, target
        )
        sock = self._connect(deadline)
        self._track(sock, generation)
        try:
            return self._exchange(sock, method, request, body, deadline, max_body_bytes)
        except BaseException:
            sock.close()
            raise
        finally:
            self._untrack(sock)

    def _track(self, sock: socket.socket, generation: int | None) -> None:
        with self._lock:
            self._busy.add(sock)
            stale = generation is not None and generation != self.generation
        if stale:  # aborted between the start of the call and now: cut it like one in flight
            _cut(sock)

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)

    # -- internals ----------------------------------------------------------------------------------

    def _request_bytes(
        self, method: str, target: str, body: bytes | None, headers: Mapping[str, str]
    ) -> bytes:
        """The request line and header section (the body itself is not copied in here)."""
        if not _TOKEN.fullmatch(method) or not target or _BAD_TARGET.search(target):
            # InvalidURL, as http.client did: an HTTPException, so the caller's translation sees it
            raise InvalidURL(f"cannot send {method!r} {target!r}: not a valid request line")
        lines = [f"{method} {target} HTTP/1.1", self._host_field, "Accept-Encoding: identity"]
        for name, value in headers.items():
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise ValueError(f"invalid HTTP header {name!r}: a name must be a token, a value one line")
            lines.append(f"{name}: {value}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        lines.append("\r\n")
        return "\r\n".join(lines).encode("latin-1")

    def _take(self, deadline: float) -> tuple[socket.socket, bool]:
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._connect(deadline), False
            if _still_open(sock):
                return sock, True
            sock.close()

    def _connect(self, deadline: float) -> socket.socket:
        sock = self._open(deadline)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Blocking from here: the kernel times each send and recv (_arm), one system call each,
            # where a Python timeout adds a poll before every one.
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.opened += 1
        return sock

    def _open(self, deadline: float) -> socket.socket:
        """A connected socket: the name resolved and each address tried within the deadline (as
        ``socket.create_connection`` does, whose own lookup has no timeout)."""
        addresses = self._resolver.resolve(self._host, self._port, _left(deadline, self._monotonic))
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(_left(deadline, self._monotonic))
                sock.connect(address)
            except BaseException as exc:
                sock.close()
                if not isinstance(exc, OSError) or isinstance(exc, TimeoutError):
                    raise  # out of time: no next address gets any
                error = exc
                continue
            return sock
        raise error or OSError(f"no address to connect to for {self._host!r}")

    def _exchange(
        self,
        sock: socket.socket,
        method: str,
        request: bytes,
        body: bytes | None,
        deadline: float,
        max_body_bytes: int,
    ) -> tuple[int, bytes]:
        if body and len(body) > _INLINE_BODY_BYTES:
            self._send_all(sock, request, deadline)
            self._send_all(sock, body, deadline)
        else:
            self._send_all(sock, request + body if body else request, deadline)
        reader = _AnswerReader(sock, deadline, self._monotonic)
        status, keep_alive, fields = reader.head()
        while 100 <= status < 200:  # interim answers (100 Continue, 103 Early Hints): the real one follows
            if status == 101:
                raise HTTPException("the server switched protocols (101) unasked")
            status, keep_alive, fields = reader.head()
        try:
            answer, framed = reader.body(method, status, fields, max_body_bytes)
        except FramingError as exc:
            exc.answer_status = status
            raise
        if keep_alive and framed and not reader.buffered:
            self._give_back(sock)
        else:
            sock.close()
        return status, answer

    def _send_all(self, sock: socket.socket, data: bytes, deadline: float) -> None:
        """``sendall``, with the deadline re-armed before each ``send``: SO_SNDTIMEO bounds one call,
        and a slow reader that takes a little at a time would let ``sendall`` run on past it."""
        view = memoryview(data)
        while view:
            _arm(sock, socket.SO_SNDTIMEO, _left(deadline, self._monotonic))
            try:
                sent = sock.send(view)
            except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
                raise TimeoutError("timed out") from None
            view = view[sent:]

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()


class _AnswerReader:
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
        end = self._find(b"\r\n\r\n", _MAX_HEAD_BYTES, "answer's header section", first=True)
        if end > _MAX_HEAD_BYTES:
            raise LineTooLong("answer's header section")
        lines = bytes(self._buf[:end]).split(b"\r\n")
        del self._buf[: end + 4]
        status_line = lines[0]
        parts = status_line.split(None, 2)
        version, code = (parts[0], parts[1]) if len(parts) >= 2 else (b"", b"")
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise BadStatusLine(repr(status_line[:100]))
        status = int(code)
        if len(lines) - 1 > _MAX_FIELDS:
            raise HTTPException(f"got more than {_MAX_FIELDS} header fields")
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
        _arm(self._sock, socket.SO_RCVTIMEO, _left(self._deadline, self._monotonic))
        try:
            return self._sock.recv(_CHUNK)
        except BlockingIOError:  # SO_RCVTIMEO ran out
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


def _cut(sock: socket.socket) -> None:
    """Shut a socket down under whichever thread uses it (it then closes it itself)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, for an SSLSocket too


def _left(deadline: float, monotonic: Callable[[], float]) -> float:
    left = deadline - monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _arm(sock: socket.socket, option: int, seconds: float) -> None:
    """Bound the socket's next sends or receives to ``seconds`` (never 0: that means for ever)."""
    whole = min(int(seconds), 2**31 - 1)
    micros = min(999_999, int((seconds - whole) * 1_000_000))
    if whole == 0:
        micros = max(1, micros)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", whole, micros))


def _still_open(sock: socket.socket) -> bool:
    """An idle keep-alive socket with anything to read has been closed (or spoken to) by the server."""
    try:
        sock.recv(1, _PEEK)  # EOF or bytes nobody asked for
    except BlockingIOError:
        return True  # nothing to read: still open
    except OSError:
        return False
    return False
