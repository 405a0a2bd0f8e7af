"""The lean transport's own HTTP/1.1: how it frames answers (Content-Length, chunked, to the end),
when it keeps a connection, what it refuses to send or read, and the deadline on a stalled answer;
against a scripted socket server on 127.0.0.1 that writes exactly the bytes a test gives it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from leasecore.conductor import answer, lean
from leasecore.conductor.lean import AnswerTooLarge, LeanTransport
from leasecore.http_framing import FramingError

from .rawsocket import ThreadedSocketServer

# What the server does for one request: write these bytes, or call this with the connection.
Answer = bytes | Callable[[socket.socket], None]
CLOSE = b""  # an empty answer: close the connection without a word


class ScriptedServer(ThreadedSocketServer):
    """Answers the n-th request it reads (over all connections) with ``answers[n]``."""

    def __init__(self, answers: list[Answer]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[int, bytes]] = []  # (connection number, request head + body)
        super().__init__()

    def serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(10)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffer) < length:
                    buffer += conn.recv(65536)
                body, buffer = buffer[:length], buffer[length:]
                with self.lock:
                    self.requests.append((number, head + b"\r\n\r\n" + body))
                    answer = self.answers.pop(0) if self.answers else CLOSE
                if answer == CLOSE:
                    return
                if callable(answer):
                    answer(conn)
                else:
                    conn.sendall(answer)
        except OSError:
            return
        finally:
            conn.close()


@pytest.fixture
def scripted() -> Iterator[Callable[..., tuple[ScriptedServer, LeanTransport]]]:
    opened: list[tuple[ScriptedServer, LeanTransport]] = []

    def start(answers: list[Answer], limit: int = 1 << 20) -> tuple[ScriptedServer, LeanTransport]:
        server = ScriptedServer(answers)
        transport = LeanTransport(
            "127.0.0.1", server.port, max_idle=4, monotonic=time.monotonic, max_body_bytes=limit
        )
        opened.append((server, transport))
        return server, transport

    yield start
    for server, transport in opened:
        transport.close()
        server.close()


def get(transport: LeanTransport, *, seconds: float = 5.0) -> tuple[int, bytes]:
    return transport.send(
        "GET", "/api/tasks/t1", None, {"Accept": "application/json"}, time.monotonic() + seconds,
        idempotent=True,
    )


def ok(body: bytes, *fields: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\n" + b"".join(field + b"\r\n" for field in fields)
    return head + b"Content-Length: %d\r\n\r\n" % len(body) + body


def test_a_request_is_one_well_formed_head_with_its_body(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    server, transport = scripted([ok(b"t1"), ok(b"")])
    deadline = time.monotonic() + 5
    status, body = transport.send(
        "POST", "/api/tasks", b'{"a": 1}', {"Content-Type": "application/json"}, deadline,
        idempotent=False,
    )
    assert (status, body) == (200, b"t1")
    # A POST without a body still says its length (0), as servers want for a POST.
    transport.send("POST", "/api/x", None, {}, deadline, idempotent=False)
    first, second = (request for _, request in server.requests)
    assert first == (
        b"POST /api/tasks HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nAccept-Encoding: identity\r\n"
        b"Content-Type: application/json\r\nContent-Length: 8\r\n\r\n{\"a\": 1}" % server.port
    )
    assert b"\r\nContent-Length: 0\r\n" in second
    assert [number for number, _ in server.requests] == [1, 1]  # kept alive


@pytest.mark.parametrize(
    ("name", "value"),
    [("X-Token", "abc\r\nX-Evil: 1"), ("X-Token", "abc\ndef"), ("X Bad", "v"), ("X-Token", "a\0b")],
)
def test_a_header_that_would_break_the_head_is_refused_before_anything_is_sent(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], name: str, value: str
) -> None:
    server, transport = scripted([ok(b"")])
    with pytest.raises(ValueError, match="invalid HTTP header"):
        transport.send("GET", "/api/x", None, {name: value}, time.monotonic() + 5, idempotent=True)
    with pytest.raises(lean.InvalidURL, match="not a valid request line"):  # translated as HTTP
        transport.send("GET", "/api/x y", None, {}, time.monotonic() + 5, idempotent=True)
    assert transport.opened == 0 and server.requests == []


def test_a_chunked_answer_is_joined_and_its_connection_kept(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;name=value\r\n[{\"a\"\r\n"
        b"A\r\n: \"012345\"\r\n"
        b"2\r\n}]\r\n"
        b"0\r\nX-Trailer: yes\r\n\r\n"
    )
    server, transport = scripted([chunked, ok(b"next")])
    assert get(transport) == (200, b'[{"a": "012345"}]')
    assert get(transport) == (200, b"next")
    assert server.connections == 1 and transport.opened == 1


def test_an_answer_dripped_one_byte_at_a_time_is_read_whole(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"

    def drip(conn: socket.socket) -> None:
        for byte in answer:
            conn.sendall(bytes([byte]))
            time.sleep(0.001)

    _, transport = scripted([drip])
    assert get(transport) == (200, b"abcde")


def test_interim_answers_are_skipped(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: x\r\n\r\n"
    _, transport = scripted([interim + ok(b"done")])
    assert get(transport) == (200, b"done")


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        pytest.param(ok(b"x", b"Connection: close"), False, id="Connection: close"),
        pytest.param(ok(b"x", b"Connection: Keep-Alive, Close"), False, id="close among tokens"),
        pytest.param(b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", False, id="HTTP/1.0"),
        pytest.param(b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx", True,
                     id="HTTP/1.0 keep-alive"),
        pytest.param(ok(b"x"), True, id="HTTP/1.1"),
        pytest.param(b"HTTP/1.1 204 No Content\r\n\r\n", True, id="204 has no body"),
    ],
)
def test_a_connection_is_kept_only_when_the_server_keeps_it(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], answer: bytes, kept: bool
) -> None:
    server, transport = scripted([answer, ok(b"y")])
    status, _ = get(transport)
    assert status in (200, 204)
    assert get(transport) == (200, b"y")
    assert server.connections == (1 if kept else 2)


def test_an_unframed_answer_is_read_to_the_end_and_the_connection_dropped(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    def unframed(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of ")
        conn.sendall(b"it")
        conn.shutdown(socket.SHUT_WR)

    server, transport = scripted([unframed, ok(b"y")])
    assert get(transport) == (200, b"all of it")
    assert get(transport) == (200, b"y")
    assert server.connections == 2


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 2048\r\n\r\n", id="Content-Length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n400\r\n" + b"x" * 1024
                     + b"\r\n400\r\n" + b"x" * 1024 + b"\r\n0\r\n\r\n", id="chunked"),
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 2048, id="to the end"),
    ],
)
def test_a_body_over_the_limit_is_refused(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], answer: bytes
) -> None:
    _, transport = scripted([lambda conn: (conn.sendall(answer), conn.shutdown(socket.SHUT_WR))], 1500)
    with pytest.raises(AnswerTooLarge):
        get(transport)


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", lean.LineTooLong,
                     id="header section over 64 KiB"),
        pytest.param(b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n", lean.HTTPException,
                     id="over 100 fields"),
        pytest.param(b"SSH-2.0-OpenSSH_9.6\r\n\r\n", lean.BadStatusLine, id="not HTTP"),
        pytest.param(b"HTTP/1.1 2000 OK\r\n\r\n", lean.BadStatusLine, id="status of 4 digits"),
        # Framing: the rules of leasecore.http_framing, shared with the embedded server
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
                     FramingError, id="conflicting Content-Length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", FramingError,
                     id="negative Content-Length"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", FramingError,
                     id="unsupported coding"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
                     FramingError, id="gzip, chunked"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\n\r\n", FramingError, id="gzip then chunked, two fields"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"3\r\nabc\r\n0\r\n\r\n", FramingError, id="Content-Length with chunked"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-5\r\n",
                     FramingError, id="negative chunk size"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                     FramingError, id="chunk size not hex"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"0" * 17 + b"1\r\n",
                     FramingError, id="chunk size over 16 digits"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"x" * 5000 + b"\r\n",
                     FramingError, id="chunk line over 4 KiB"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY",
                     FramingError, id="chunk longer than its size"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n" + b"T: x\r\n" * 65
                     + b"\r\n", FramingError, id="over 64 trailer lines"),
        pytest.param(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
                     lean.IncompleteRead, id="cut chunk"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", lean.IncompleteRead,
                     id="cut body"),
        pytest.param(b"HTTP/1.1 200 OK\r\nContent-", lean.IncompleteRead, id="cut head"),
        pytest.param(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", lean.HTTPException, id="101"),
    ],
)
def test_a_malformed_or_cut_answer_is_an_http_error(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
    answer: bytes,
    error: type[Exception],
) -> None:
    server, transport = scripted([lambda conn: (conn.sendall(answer), conn.shutdown(socket.SHUT_WR)),
                                  ok(b"y")])
    with pytest.raises(error):
        get(transport)
    # The connection that carried it is not reused.
    assert get(transport) == (200, b"y")
    assert server.connections == 2


def test_a_stalled_answer_ends_at_the_deadline(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    release = threading.Event()

    def stall(conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        release.wait(10)

    _, transport = scripted([stall])
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            get(transport, seconds=0.3)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert 0.25 <= elapsed < 2.0


@pytest.mark.parametrize(
    "pace",
    [
        # Stuck before reading: a body far larger than the socket buffers cannot be sent.
        pytest.param(None, id="never reads"),
        # Found in review: SO_SNDTIMEO bounds one send(2), and a reader taking a little at a time
        # made sendall run on for as long as it kept taking. The deadline is re-armed per send.
        pytest.param(0.01, id="reads ~100 KB/s"),
    ],
)
def test_a_server_reading_slowly_or_not_at_all_cannot_stretch_the_send_past_the_deadline(
    pace: float | None,
) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stop = threading.Event()

    def read() -> None:
        conn, _ = listener.accept()
        with conn:
            if pace is None:
                stop.wait(10)
                return
            while not stop.is_set() and conn.recv(1024):
                stop.wait(pace)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    transport = LeanTransport("127.0.0.1", listener.getsockname()[1], max_idle=1, monotonic=time.monotonic)
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            transport.send("POST", "/api/tasks", b"x" * (16 << 20), {}, time.monotonic() + 0.5,
                           idempotent=False)
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        transport.close()
        reader.join(5)
        listener.close()
    assert elapsed < 2.0


def _counting_arms(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The receive timeouts armed from now on (the answer reader's ``arm`` calls for SO_RCVTIMEO)."""
    armed: list[float] = []
    real = answer.arm

    def counting(sock: socket.socket, option: int, seconds: float) -> None:
        if option == socket.SO_RCVTIMEO:
            armed.append(seconds)
        real(sock, option, seconds)

    monkeypatch.setattr(answer, "arm", counting)
    return armed


def test_a_kept_alive_connection_keeps_its_receive_timeout_while_it_is_short_enough(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, transport = scripted([ok(b"1"), ok(b"2"), ok(b"3"), ok(b"4")])
    armed = _counting_arms(monkeypatch)
    assert [get(transport, seconds=5.0)[1] for _ in range(3)] == [b"1", b"2", b"3"]
    assert armed == [4.0]  # whole seconds, not above what was left: armed once for the three
    assert get(transport, seconds=2.5) == (200, b"4")  # less left than the kept 4 s: armed again
    assert armed == [4.0, 2.0]
    assert len({number for number, _ in server.requests}) == 1  # one kept-alive connection throughout


def test_a_wait_cut_short_by_the_kept_timeout_goes_on_until_the_answer(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    def late(conn: socket.socket) -> None:
        threading.Event().wait(1.4)  # past the 1 s the connection keeps armed, well within the 5 s
        conn.sendall(ok(b"late"))

    _, transport = scripted([ok(b"first"), late])
    armed = _counting_arms(monkeypatch)
    assert get(transport, seconds=1.5) == (200, b"first")
    started = time.monotonic()
    assert get(transport, seconds=5.0) == (200, b"late")
    assert time.monotonic() - started >= 1.3
    assert armed == [1.0]  # the second call's waits ran on the 1 s kept: cut short once, then answered


def test_a_stalled_answer_ends_at_its_own_deadline_not_at_the_kept_timeout(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    release = threading.Event()
    _, transport = scripted([ok(b"first"), lambda conn: release.wait(10)])
    assert get(transport, seconds=1.2) == (200, b"first")  # the connection keeps 1 s armed
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            get(transport, seconds=1.6)
        elapsed = time.monotonic() - started
    finally:
        release.set()
    assert 1.55 <= elapsed < 3.0  # not at the kept 1 s: the rest, 0.6 s, armed exactly after it
