"""The lean transport: keep-alive HTTP/1.1 on a plain socket, the client's path for plain ``http://``.

Owns: :class:`LeanTransport` (a :class:`~leasecore.conductor.transport.Transport`): the request's
bytes (header injection and bad targets refused), the bounded LIFO pool of idle connections shared by
every thread (one the server closed while idle is dropped before use), connecting within the deadline
(the name through :mod:`leasecore.conductor.resolve`), sending with the deadline re-armed before
every ``send``, one resend on a fresh connection of an ``idempotent`` call whose kept-alive connection
died under it (never a poll's), and ``abort`` (cut every call in flight, by generation). Reading the
answer is :mod:`leasecore.conductor.answer`; its error tree is re-exported here.

Must not: translate errors (``conductor.calls.translate_errors`` does, once), retry anything else,
speak TLS or to a proxy (``open_transport`` picks ``requests`` for those), import ``http.client``.
Why a hand-written transport, and its figures: docs/benchmarks.md.

Threads: any number of callers at once; the pool and the busy set under one lock.
"""

from __future__ import annotations

import contextlib
import logging
import re
import select
import socket
import struct
import threading
from collections.abc import Callable, Mapping

from leasecore.conductor.answer import (
    AnswerReader,
    AnswerTooLarge,
    BadStatusLine,
    HTTPException,
    IncompleteRead,
    InvalidURL,
    LineTooLong,
    RemoteDisconnected,
    arm,
    seconds_left,
)
from leasecore.conductor.resolve import BoundedResolver
from leasecore.http_framing import FramingError

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

_INLINE_BODY_BYTES = 64 * 1024  # a body up to this size goes out in the same send as the head
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # a header name (RFC 9110 token)
_BAD_VALUE = re.compile(r"[\r\n\0]")  # what would end a header line early (header injection)
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # a request target never holds controls or spaces
_DONTWAIT = int(socket.MSG_DONTWAIT)
_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD"})  # tokens already: no pattern to match
_FIELD_SETS = 32  # header field sets kept made (_header_fields)


class _Connection(socket.socket):
    """A connection of the pool: a socket with its own ``poll`` to see whether the server closed it."""

    __slots__ = ("rcv_armed", "readable")

    def watch(self) -> None:
        self.rcv_armed = 0.0  # the receive timeout armed now, in seconds (0: none; answer.AnswerReader)
        self.readable = select.poll()
        self.readable.register(self.fileno(), select.POLLIN)  # (POLLERR and POLLHUP come unasked)


class StaleConnection(ConnectionError):
    """A reused keep-alive connection died before the server answered (and the call was not retried)."""


class LeanTransport:
    """Keep-alive HTTP/1.1 to one ``host:port``; thread-safe; ``max_idle`` connections kept warm.

    A :class:`~leasecore.conductor_transport.Transport`; ``max_body_bytes`` bounds every answer's body.
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
        self._idle: list[_Connection] = []
        self._fields: dict[tuple[tuple[str, str], ...], str] = {}  # header fields -> their lines (checked)
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
        """Cut every call in flight now (a forced stop): their sockets are shut down, so a
        blocked send or recv returns at once instead of at its deadline; idle ones are closed. Later
        calls go on as usual (the caller bounds them). Thread-safe."""
        with self._lock:
            self.generation += 1
            busy = list(self._busy)
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
        for cut in busy:
            _cut(cut)

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
        except TimeoutError:
            _reset(sock)
            raise
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
        except TimeoutError:
            _reset(sock)
            raise
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
        if not (method in _METHODS or _TOKEN.fullmatch(method)) or not target or _BAD_TARGET.search(target):
            # InvalidURL, as http.client did: an HTTPException, so the caller's translation sees it
            raise InvalidURL(f"cannot send {method!r} {target!r}: not a valid request line")
        key = tuple(headers.items())
        fields = self._fields.get(key)
        if fields is None:
            fields = self._header_fields(key)
        if body is not None or method in ("POST", "PUT", "PATCH"):
            fields += f"Content-Length: {len(body or b'')}\r\n"
        return f"{method} {target} HTTP/1.1\r\n{fields}\r\n".encode("latin-1")

    def _header_fields(self, headers: tuple[tuple[str, str], ...]) -> str:
        """Host, Accept-Encoding and ``headers`` as header lines, each checked; kept for the next calls
        with the same fields (the sender's are the same few each time; a bound all the same)."""
        lines = [self._host_field, "Accept-Encoding: identity"]
        for name, value in headers:
            if not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
                raise ValueError(f"invalid HTTP header {name!r}: a name must be a token, a value one line")
            lines.append(f"{name}: {value}")
        fields = "".join(f"{line}\r\n" for line in lines)
        fields.encode("latin-1")  # (what cannot go out fails here, as it did on each call)
        if len(self._fields) >= _FIELD_SETS:
            self._fields.clear()
        self._fields[headers] = fields
        return fields

    def _take(self, deadline: float) -> tuple[_Connection, bool]:
        while True:
            with self._lock:
                sock = self._idle.pop() if self._idle else None
            if sock is None:
                return self._connect(deadline), False
            if _still_open(sock):
                return sock, True
            sock.close()

    def _connect(self, deadline: float) -> _Connection:
        sock = self._open(deadline)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Blocking from here: the kernel times each send and recv (_arm), one system call each,
            # where a Python timeout adds a poll before every one.
            sock.settimeout(None)
            sock.watch()
        except BaseException:
            sock.close()
            raise
        with self._lock:
            self.opened += 1
        return sock

    def _open(self, deadline: float) -> _Connection:
        """A connected socket: the name resolved and each address tried within the deadline (as
        ``socket.create_connection`` does, whose own lookup has no timeout)."""
        addresses = self._resolver.resolve(self._host, self._port, seconds_left(deadline, self._monotonic))
        error: OSError | None = None
        for family, kind, proto, _, address in addresses:
            sock = _Connection(family, kind, proto)
            try:
                sock.settimeout(seconds_left(deadline, self._monotonic))
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
        sock: _Connection,
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
        reader = AnswerReader(sock, deadline, self._monotonic)
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
        and a slow reader that takes a little at a time would let ``sendall`` run on past it. The first
        ``send`` does not wait (``MSG_DONTWAIT``): what the kernel takes at once needs no timer, which
        for a request of the usual size is all of it (one ``setsockopt`` a call fewer)."""
        seconds_left(deadline, self._monotonic)  # (no time left: nothing goes out)
        try:
            sent = sock.send(data, _DONTWAIT)
        except BlockingIOError:  # the send buffer is full: wait for room, timed, below
            sent = 0
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        while view:
            arm(sock, socket.SO_SNDTIMEO, seconds_left(deadline, self._monotonic))
            try:
                sent = sock.send(view)
            except BlockingIOError:  # SO_SNDTIMEO ran out with nothing sent
                raise TimeoutError("timed out") from None
            view = view[sent:]

    def _give_back(self, sock: _Connection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()


def _reset(sock: socket.socket) -> None:
    """Close a connection whose request was given up on with a TCP reset, not a FIN: a server that has
    not read the request yet drops it rather than handle it late (a late heartbeat can undo a final
    update: docs/final-results.md). Bytes a middlebox already took may still go on."""
    with contextlib.suppress(OSError):  # already closed or cut: a plain close is all that is left
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _cut(sock: socket.socket) -> None:
    """Shut a socket down under whichever thread uses it (it then closes it itself)."""
    with contextlib.suppress(OSError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's, for an SSLSocket too


def _still_open(sock: _Connection) -> bool:
    """An idle keep-alive socket with anything to read (the server's FIN, bytes nobody asked for) or an
    error pending (a reset) has been closed, or spoken to, by the server. Its own ``poll``: a look
    that raises nothing when nothing is there (a peeking ``recv`` raised ``BlockingIOError`` then)."""
    return not sock.readable.poll(0)
