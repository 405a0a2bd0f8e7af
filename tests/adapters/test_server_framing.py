"""Embedded server, request framing on kept-alive connections: raw sockets, pipelined requests.

A body the server reads one byte short (or not at all) stays on the connection and is parsed as the
start of the next request: the benchmark saw ``501 Unsupported method ('xPOST')``. Every test here
pipelines the next request right behind the odd one, so a single byte left behind shows up at once.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from leasecore.server import EmbeddedServer
from leasecore.server.http.httpd import MAX_BODY_BYTES

KEY, SECRET = "key-id", "key-secret"
HEALTH = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


class Conn:
    """One raw client connection that parses responses itself (so nothing is hidden or retried)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=15)
        self.rfile = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reply(self) -> Reply:
        status_line = self.rfile.readline(65537)
        assert status_line, "connection closed before a response"
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := self.rfile.readline(65537)) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        body = self.rfile.read(length) if status >= 200 and status != 204 else b""
        return Reply(status, headers, body)

    def at_eof(self) -> bool:
        return self.rfile.read(1) == b""

    def close(self) -> None:
        self.rfile.close()
        self.sock.close()


def post(path: str, body: bytes, *, extra: str = "", content_type: str = "application/json") -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: {content_type}\r\n{extra}"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


@pytest.fixture
def conn(server: EmbeddedServer) -> Iterator[Conn]:
    c = Conn(server.port)
    yield c
    c.close()


def _assert_healthy(reply: Reply) -> None:
    assert reply.status == 200, reply
    assert reply.json() == {"healthResults": [], "suppressedHealthResults": [], "healthy": True}


def test_pipelined_non_ascii_bodies_are_read_to_their_last_byte(conn: Conn) -> None:
    texts = ["héllo wörld ✓", "日本語のログ", "emoji 🚀 at the end 🚀"]
    conn.send(
        b"".join(post("/api/tasks/t1/log", t.encode(), content_type="text/plain") for t in texts) + HEALTH
    )
    for _ in texts:
        assert conn.reply().status == 200
    _assert_healthy(conn.reply())
    conn.send(b"GET /api/tasks/t1/log HTTP/1.1\r\nHost: t\r\n\r\n")
    logs = conn.reply().json()
    assert isinstance(logs, list)
    assert [entry["log"] for entry in logs] == texts


def test_error_answers_still_consume_the_body(conn: Conn) -> None:
    body = json.dumps({"taskId": "ü" * 100, "workflowInstanceId": "w", "status": "COMPLETED"}).encode()
    conn.send(
        post("/api/nowhere", body)  # 404 before any route reads it
        + post("/api/tasks/queue/all", body)  # 405
        + post("/api/tasks", body)  # 404 from the store
        + post("/api/tasks", b"{not json")  # 500 parse error
        + HEALTH
    )
    assert [conn.reply().status for _ in range(4)] == [404, 405, 404, 500]
    _assert_healthy(conn.reply())


def test_an_auth_refusal_consumes_the_body_and_both_healths_are_open() -> None:
    with EmbeddedServer(auth_key=KEY, auth_secret=SECRET) as srv:
        c = Conn(srv.port)
        try:
            body = json.dumps({"taskId": "x", "workflowInstanceId": "y", "extendLease": True}).encode()
            c.send(post("/api/tasks", body) + post("/api/tasks", body, extra="X-Authorization: forged\r\n"))
            c.send(HEALTH + b"GET /api/health HTTP/1.1\r\nHost: t\r\n\r\n")
            first, second = c.reply(), c.reply()
            assert (first.status, second.status) == (401, 401)
            assert first.json() == {"error": "INVALID_TOKEN", "message": "Invalid or missing token"}
            _assert_healthy(c.reply())
            _assert_healthy(c.reply())  # /api/health needs no token either (load balancer checks)
        finally:
            c.close()


def test_chunked_bodies_with_extensions_and_trailers(conn: Conn) -> None:
    chunked = (
        b"POST /api/tasks/t2/log HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
        b"6;name=value\r\nh\xc3\xa9llo\r\n"
        b"9\r\n w\xc3\xb6rld!!\r\n"
        b"0\r\nX-Trailer: 1\r\nX-Other: 2\r\n\r\n"
    )
    conn.send(chunked + chunked + HEALTH)
    assert conn.reply().status == 200
    assert conn.reply().status == 200
    _assert_healthy(conn.reply())
    conn.send(b"GET /api/tasks/t2/log HTTP/1.1\r\nHost: t\r\n\r\n")
    logs = conn.reply().json()
    assert isinstance(logs, list)
    assert [entry["log"] for entry in logs] == ["héllo wörld!!"] * 2


def test_expect_100_continue(conn: Conn) -> None:
    body = "éé".encode()
    conn.send(
        b"POST /api/tasks/t3/log HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    assert conn.reply().status == 100
    conn.send(body + HEALTH)
    assert conn.reply().status == 200
    _assert_healthy(conn.reply())


def test_expect_100_continue_with_a_refused_body_gets_the_error_instead(conn: Conn) -> None:
    conn.send(
        b"POST /api/tasks/t4/log HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\n"
        + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    )
    reply = conn.reply()
    assert reply.status == 413
    assert reply.headers["connection"] == "close"
    assert conn.at_eof()


@pytest.mark.parametrize(
    ("headers", "body", "status"),
    [
        # The reproduction of the benchmark's failure: the body was read by the first Content-Length,
        # the byte left over was parsed as the start of the next request ("501 ... ('xGET')").
        ("Content-Length: 1\r\nContent-Length: 2\r\n", b"xx", 400),
        ("Content-Length: 1, 2\r\n", b"xx", 400),
        ("Content-Length: +2\r\n", b"xx", 400),
        ("Content-Length: two\r\n", b"xx", 400),
        ("Transfer-Encoding: gzip, chunked\r\n", b"2\r\nxx\r\n0\r\n\r\n", 501),
        ("Transfer-Encoding: chunked\r\nContent-Length: 12\r\n", b"2\r\nxx\r\n0\r\n\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", b"zz\r\nxx\r\n0\r\n\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", b"1\r\nxx\r\n0\r\n\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", b"3\r\nxx\n0\r\n\r\n", 400),
        ("Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", b"2\r\nxx\r\n0\r\n\r\n", 501),
        ("Transfer-Encoding: chunked\r\n", b"0" * 17 + b"2\r\nxx\r\n0\r\n\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", b"2;" + b"x" * 5000 + b"\r\nxx\r\n0\r\n\r\n", 400),
        ("Transfer-Encoding: chunked\r\n", b"2\r\nxx\r\n0\r\n" + b"T: x\r\n" * 65 + b"\r\n", 400),
    ],
    ids=[
        "conflicting-lengths",
        "length-list",
        "signed-length",
        "non-numeric-length",
        "unsupported-coding",
        "chunked-and-length",
        "bad-chunk-size",
        "chunk-longer-than-its-size",
        "chunk-eating-its-crlf",
        "gzip-then-chunked-two-fields",
        "chunk-size-over-16-digits",
        "chunk-line-over-4-KiB",
        "over-64-trailer-lines",
    ],
)
def test_a_body_that_cannot_be_delimited_is_refused_and_the_connection_closed(
    conn: Conn, headers: str, body: bytes, status: int
) -> None:
    conn.send(b"POST /api/tasks/t5/log HTTP/1.1\r\nHost: t\r\n" + headers.encode() + b"\r\n" + body + HEALTH)
    reply = conn.reply()
    assert reply.status == status, reply
    assert reply.headers["connection"] == "close"
    error = reply.json()
    assert isinstance(error, dict)
    assert error["status"] == status
    assert error["retryable"] is False
    assert conn.at_eof()  # never a second answer made from the leftovers


def test_repeated_identical_content_lengths_are_fine(conn: Conn) -> None:
    conn.send(
        b"POST /api/tasks/t6/log HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok"
    )
    conn.send(HEALTH)
    assert conn.reply().status == 200
    _assert_healthy(conn.reply())


def test_a_too_large_body_gets_its_413_even_while_the_client_keeps_sending(conn: Conn) -> None:
    conn.send(
        b"POST /api/tasks/t7/log HTTP/1.1\r\nHost: t\r\n"
        + f"Content-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
        + b"x" * (256 * 1024)
    )
    # The server answers without reading the body, then drains before closing: no RST eats the answer.
    reply = conn.reply()
    assert reply.status == 413
    assert reply.headers["connection"] == "close"


def test_a_body_cut_short_by_the_client_is_not_dispatched(server: EmbeddedServer, conn: Conn) -> None:
    conn.send(b"POST /api/tasks/t8/log HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
    conn.sock.shutdown(socket.SHUT_WR)
    reply = conn.reply()
    assert reply.status == 400
    assert server.store.get_logs("t8") == []
