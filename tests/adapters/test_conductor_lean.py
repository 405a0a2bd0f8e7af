"""The Conductor client's keep-alive behaviour: reuse, a dead kept-alive connection resent once for
idempotent calls only (never a poll), cut answers, answers whose framing is refused, the transport
choice; against a raw socket server on 127.0.0.1 that can misbehave exactly where a real one might.

Tests taking ``raw`` run on both transports (the ``connect`` fixture); ``raw_lean`` ones check what only
the lean transport does (the one resend of an idempotent call on a fresh connection: requests' pool has
no such resend, and a call that dies on a kept-alive connection fails there)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import cast

import pytest
import requests

from leasecore.conductor import lean
from leasecore.conductor.client import ConductorClient, translate_errors
from leasecore.conductor.lean import LeanTransport
from leasecore.conductor.transport import RequestsTransport, open_transport
from leasecore.errors import ConductorProtocolError, ConductorUnavailable
from leasecore.models import TaskResult, TaskStatus

from .conftest import Connect
from .rawsocket import ThreadedSocketServer

# What the raw server does with the n-th request (0-based) on a connection: answer it, or close the
# connection without a word, or send a cut answer.
Behaviour = Callable[[int], str]  # "answer" | "answer-then-close" | "close" | "cut" | "raw <head>"


class RawServer(ThreadedSocketServer):
    """HTTP/1.1 keep-alive by hand: one thread per connection, a behaviour per request of it."""

    def __init__(self, behaviour: Behaviour, body: bytes = b"[]") -> None:
        self.behaviour = behaviour
        self.body = body
        self.requests: list[tuple[int, str]] = []  # (connection number, request line)
        super().__init__()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(10)
        reader = conn.makefile("rb")
        try:
            for index in range(1000):
                line = reader.readline()
                if not line:
                    return
                length = 0
                while (header := reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = header.decode("latin-1").partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value.strip())
                reader.read(length)
                with self.lock:
                    self.requests.append((number, line.decode("latin-1").strip()))
                what = self.behaviour(index)
                if what == "close":
                    return
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                if what.startswith("raw "):  # "raw <status line and fields>": the test's own framing
                    conn.sendall(what[4:].encode("latin-1") + b"\r\n" + self.body)
                    return
                if what == "cut":
                    conn.sendall(head + b"Content-Length: %d\r\n\r\n" % (len(self.body) + 50) + self.body)
                    return
                conn.sendall(head + b"Content-Length: %d\r\n\r\n" % len(self.body) + self.body)
                if what == "answer-then-close":
                    return
        except OSError:
            return
        finally:
            reader.close()
            conn.close()


def _servers(
    make_client: Callable[[str], ConductorClient],
) -> Iterator[Callable[..., tuple[RawServer, ConductorClient]]]:
    opened: list[tuple[RawServer, ConductorClient]] = []

    def start(behaviour: Behaviour, body: bytes = b"[]") -> tuple[RawServer, ConductorClient]:
        server = RawServer(behaviour, body)
        client = make_client(server.url)
        opened.append((server, client))
        return server, client

    yield start
    for server, client in opened:
        client.close()
        server.close()


@pytest.fixture
def raw(connect: Connect) -> Iterator[Callable[..., tuple[RawServer, ConductorClient]]]:
    """A raw server and a client on each transport in turn."""
    yield from _servers(lambda url: connect(url, timeout_seconds=5))


@pytest.fixture
def raw_lean() -> Iterator[Callable[..., tuple[RawServer, ConductorClient]]]:
    """A raw server and a client on the lean transport (the default for plain HTTP)."""
    yield from _servers(lambda url: ConductorClient(url, timeout_seconds=5))


def second_request_dies(index: int) -> str:
    """Answer the first request of a connection; close it, silently, under the second."""
    return "answer" if index == 0 else "close"


def test_calls_reuse_one_kept_alive_connection(
    connect: Connect, raw: Callable[..., tuple[RawServer, ConductorClient]]
) -> None:
    server, client = raw(lambda index: "answer", body=b'{"taskId": "t1", "status": "IN_PROGRESS"}')
    for _ in range(5):
        client.extend_lease("t1", "w1")
        assert client.get_task_status("t1") is TaskStatus.IN_PROGRESS
    assert client.connections_opened == (1 if connect.kind == "lean" else None)
    assert server.connections == 1
    assert len(server.requests) == 10


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.extend_lease("t1", "w1"), id="extendLease"),
        pytest.param(lambda c: c.update(TaskResult("t1", "w1", TaskStatus.COMPLETED)), id="final update"),
        pytest.param(lambda c: c.get_task("t1"), id="GET task"),
    ],
)
def test_an_idempotent_call_on_a_dead_kept_alive_connection_is_resent_once_on_a_new_one(
    raw_lean: Callable[..., tuple[RawServer, ConductorClient]], call: Callable[[ConductorClient], object]
) -> None:
    # Given a warm connection that the server will drop under the next request
    server, client = raw_lean(second_request_dies, body=b'{"taskId": "t1"}')
    client.get_task("t1")
    # When an idempotent call goes out on it
    call(client)
    # Then it was sent twice, the second time on a fresh connection, and succeeded
    assert [number for number, _ in server.requests] == [1, 1, 2]
    assert server.requests[1][1] == server.requests[2][1]


def test_a_poll_on_a_dead_kept_alive_connection_is_never_sent_twice(
    raw: Callable[..., tuple[RawServer, ConductorClient]],
) -> None:
    # Given a warm connection that the server will drop under the next request
    server, client = raw(second_request_dies)
    assert client.poll("shell", count=1, timeout_ms=0) == []
    # When a poll goes out on it, then it fails as unavailable (a retryable attempt for the poller)
    with pytest.raises(ConductorUnavailable) as info:
        client.poll("shell", count=1, timeout_ms=0)
    assert info.value.status_code is None
    # And the server saw it exactly once: a lost answer may have claimed tasks, a resend would claim more
    polls = [line for _, line in server.requests]
    assert len(polls) == 2 and all(line.startswith("GET /api/tasks/poll/batch/shell?") for line in polls)
    # And the next poll works, on a new connection
    assert client.poll("shell", count=1, timeout_ms=0) == []
    assert server.connections == 2


@pytest.mark.parametrize("callback", [0, 60], ids=["yield", "park"])
def test_an_in_progress_update_on_a_dead_kept_alive_connection_is_never_sent_twice(
    raw: Callable[..., tuple[RawServer, ConductorClient]], callback: int
) -> None:
    # Given a warm connection that the server will drop under the next request (it may have applied
    # it: only the answer is lost)
    server, client = raw(second_request_dies, body=b'{"taskId": "t1"}')
    client.get_task("t1")
    # When an IN_PROGRESS update (it re-queues the task) goes out on it, then it fails with no answer
    result = TaskResult("t1", "w1", TaskStatus.IN_PROGRESS, callback_after_seconds=callback)
    with pytest.raises(ConductorUnavailable) as info:
        client.update(result)
    assert info.value.status_code is None  # no answer: the reporter reads the task back before a resend
    # And the server saw it exactly once: sent again after the next run was polled, it would re-queue
    # that run
    assert [line for _, line in server.requests] == ["GET /api/tasks/t1 HTTP/1.1", "POST /api/tasks HTTP/1.1"]


def test_an_idempotent_call_is_resent_at_most_once(
    raw: Callable[..., tuple[RawServer, ConductorClient]],
) -> None:
    # Given a server that drops every request but the first of the first connection
    server, client = raw(lambda index: "close")
    with pytest.raises(ConductorUnavailable):
        client.extend_lease("t1", "w1")  # a fresh connection that dies: not resent
    assert len(server.requests) == 1


def test_a_cut_answer_is_unavailable_not_a_short_body(
    raw: Callable[..., tuple[RawServer, ConductorClient]],
) -> None:
    body = json.dumps([{"taskId": "t1", "workflowInstanceId": "w1", "taskType": "shell"}]).encode()
    _, client = raw(lambda index: "cut", body=body)
    with pytest.raises(ConductorUnavailable, match="mid-answer"):
        client.poll("shell", count=1, timeout_ms=0)


def test_an_idle_connection_the_server_closed_is_dropped_before_use(
    connect: Connect, raw: Callable[..., tuple[RawServer, ConductorClient]],
) -> None:
    # Given a pooled connection that the server closed after answering (as an idle timeout would)
    server, client = raw(lambda index: "answer-then-close")
    assert client.poll("shell", count=1, timeout_ms=0) == []
    deadline = time.monotonic() + 10
    while any(thread.is_alive() for thread in server.threads) and time.monotonic() < deadline:
        server.threads[0].join(0.05)
    assert not any(thread.is_alive() for thread in server.threads)
    # When a poll (never resent) goes out, then it succeeds: the dead idle socket was not used
    assert client.poll("shell", count=1, timeout_ms=0) == []
    opened = 2 if connect.kind == "lean" else None
    assert (client.connections_opened, server.connections, len(server.requests)) == (opened, 2, 2)


def test_proxies_https_and_injected_sessions_keep_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HTTP_PROXY", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    plain = ConductorClient("http://conductor.test:8080/api")
    assert type(plain.transport) is LeanTransport and plain.connections_opened == 0
    plain.close()
    session = requests.Session()
    with ConductorClient("http://conductor.test:8080/api", session=session) as client:
        assert type(client.transport) is RequestsTransport and client.connections_opened is None
        assert cast(RequestsTransport, client.transport).session is session
        assert cast(RequestsTransport, client.transport).verify is None  # the session's own setting
    assert session.adapters  # an injected session is its owner's: the client left it open
    session.close()
    with ConductorClient("https://conductor.test/api") as client:
        assert type(client.transport) is RequestsTransport and client.connections_opened is None
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    with ConductorClient("http://conductor.test:8080/api") as client:
        assert type(client.transport) is RequestsTransport
    monkeypatch.setenv("NO_PROXY", "conductor.test")  # a host the proxy is not for: lean again
    with ConductorClient("http://conductor.test:8080/api") as client:
        assert type(client.transport) is LeanTransport


def test_a_ca_bundle_is_an_input_of_the_transport_choice() -> None:
    bundle = "/etc/conductor/ca.pem"

    def choose(url: str) -> object:
        return open_transport(url, verify=bundle, pool_maxsize=4, max_body_bytes=99, monotonic=time.monotonic)

    secure, plain = choose("https://conductor.test/api"), choose("http://conductor.test/api")
    try:
        assert isinstance(secure, RequestsTransport) and secure.verify == bundle
        assert isinstance(plain, LeanTransport)  # no TLS: nothing to verify
    finally:
        for transport in (secure, plain):
            assert isinstance(transport, RequestsTransport | LeanTransport)
            transport.close()


def test_a_session_and_a_transport_together_are_refused() -> None:
    transport = open_transport(
        "http://conductor.test/api", pool_maxsize=4, max_body_bytes=1024, monotonic=time.monotonic
    )
    with pytest.raises(TypeError, match="not both"):
        ConductorClient("http://conductor.test/api", session=requests.Session(), transport=transport)
    transport.close()


@pytest.mark.parametrize(
    "exc",
    [
        http.client.RemoteDisconnected("Remote end closed connection without response"),
        http.client.IncompleteRead(b"abc", 10),
        http.client.BadStatusLine("garbage"),
        lean.RemoteDisconnected("Remote end closed connection without response"),
        lean.IncompleteRead(b"abc", 10),
        lean.BadStatusLine("garbage"),
        lean.LineTooLong("answer's header section"),
        lean.HTTPException("a chunk does not end where its size says"),
        TimeoutError("timed out"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
)
def test_http_client_errors_are_unavailable(exc: BaseException) -> None:
    with pytest.raises(ConductorUnavailable) as info, translate_errors("POST", "/tasks"):
        raise exc
    assert info.value.__cause__ is exc
    assert info.value.status_code is None


CHUNKED_LIST = b"2\r\n[]\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    ("head", "body"),
    [
        pytest.param("Transfer-Encoding: gzip, chunked\r\n", CHUNKED_LIST, id="gzip, chunked"),
        pytest.param("Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n", CHUNKED_LIST,
                     id="gzip then chunked"),
        pytest.param("Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", CHUNKED_LIST,
                     id="Content-Length and chunked"),
        pytest.param("Transfer-Encoding: chunked, chunked\r\n", CHUNKED_LIST, id="chunked twice"),
        pytest.param("Content-Length: +2\r\n", b"[]", id="signed Content-Length"),
    ],
)
def test_an_answer_whose_framing_is_ambiguous_is_a_protocol_error_on_both_transports(
    raw: Callable[..., tuple[RawServer, ConductorClient]], head: str, body: bytes
) -> None:
    # The server's own rules (leasecore.http_framing) refuse these in a request; the client refuses
    # them in an answer, whichever transport carries it: never read "gzip, chunked" as plain chunked.
    _, client = raw(lambda index: "raw HTTP/1.1 200 OK\r\n" + head, body=body)
    with pytest.raises(ConductorProtocolError, match="answer refused") as info:
        client.poll("shell", count=1, timeout_ms=0)
    assert info.value.status_code == 200


def test_a_refused_framing_after_an_error_status_is_that_status_not_a_delivery(
    raw: Callable[..., tuple[RawServer, ConductorClient]],
) -> None:
    # A final update answered 503 with a body that cannot be read: the server did not take the result,
    # so this must not be the "2xx we could not parse" protocol error a reporter counts as delivered.
    head = "raw HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: gzip, chunked\r\n"
    _, client = raw(lambda index: head, body=CHUNKED_LIST)
    with pytest.raises(ConductorUnavailable, match="answer refused") as info:
        client.update(TaskResult("t1", "w1", TaskStatus.COMPLETED))
    assert info.value.status_code == 503 and info.value.retryable


def test_a_bad_chunk_size_is_refused(
    connect: Connect, raw: Callable[..., tuple[RawServer, ConductorClient]]
) -> None:
    _, client = raw(lambda index: "raw HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n",
                    body=b"zz\r\n[]\r\n0\r\n\r\n")
    # The lean transport reads chunks with the server's parser; requests with urllib3's, which calls
    # a bad size a broken connection: refused either way, never taken for a body.
    expected = ConductorProtocolError if connect.kind == "lean" else ConductorUnavailable
    with pytest.raises(expected):
        client.poll("shell", count=1, timeout_ms=0)


class SilentServer(ThreadedSocketServer):
    """Reads a request and never answers; records how its connection then ended: "reset" (RST) or
    "closed" (FIN)."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        self.done = threading.Event()
        super().__init__()

    def serve(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(10)
        try:
            conn.recv(65536)  # the request; no answer ever
            try:
                how = "closed" if conn.recv(65536) == b"" else "more bytes"
            except ConnectionResetError:
                how = "reset"
            with self.lock:
                self.ended.append(how)
        except OSError as exc:
            with self.lock:
                self.ended.append(repr(exc))
        finally:
            conn.close()
            self.done.set()


def test_a_request_given_up_on_has_its_connection_reset_not_closed() -> None:
    # A request that timed out may still be handled if its bytes reach a server later: the lean
    # transport resets the connection, so a server that has not handled it drops it
    # (docs/final-results.md: a late heartbeat can undo a final update).
    server = SilentServer()
    client = ConductorClient(f"http://127.0.0.1:{server.port}/api", timeout_seconds=5)
    try:
        with pytest.raises(ConductorUnavailable):
            client.extend_lease("t1", "w1", timeout_seconds=0.2)
        assert server.done.wait(10)
        assert server.ended == ["reset"]
    finally:
        client.close()
        server.close()
