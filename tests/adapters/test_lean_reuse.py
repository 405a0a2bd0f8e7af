"""What the lean transport keeps from one call to the next, and that keeping it changes nothing sent:
the header lines made once per set of fields (a refused set is refused on every call), the first
``send`` that does not wait, and the look at an idle connection before it is reused (the server's
FIN, a reset, or bytes nobody asked for each drop it). Against a scripted server on 127.0.0.1."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Iterator

import pytest

from leasecore.conductor import answer, lean
from leasecore.conductor.lean import LeanTransport
from tests.support import wait_until

from .test_lean_http import ScriptedServer, ok, scripted

__all__ = ["scripted"]  # the fixture, used by name


def post(transport: LeanTransport, headers: dict[str, str], body: bytes | None = b"{}") -> tuple[int, bytes]:
    return transport.send("POST", "/api/tasks/update-v2", body, headers, time.monotonic() + 5,
                          idempotent=False)  # fmt: skip


def test_each_call_sends_its_own_fields_whatever_was_made_before(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    server, transport = scripted([ok(b"") for _ in range(5)])
    plain = {"User-Agent": "ua", "Accept": "application/json", "Content-Type": "application/json"}
    post(transport, plain)
    post(transport, {**plain, "X-Authorization": "token-1"})
    post(transport, plain, b'{"a": 1}')
    post(transport, {**plain, "X-Authorization": "token-2"})
    transport.send("GET", "/api/tasks/t1", None, {"Accept": "text/plain"}, time.monotonic() + 5,
                   idempotent=True)  # fmt: skip
    heads = [request.partition(b"\r\n\r\n")[0].split(b"\r\n") for _, request in server.requests]
    host = b"Host: 127.0.0.1:%d" % server.port
    base = [host, b"Accept-Encoding: identity", b"User-Agent: ua", b"Accept: application/json",
            b"Content-Type: application/json"]  # fmt: skip
    assert heads == [
        [b"POST /api/tasks/update-v2 HTTP/1.1", *base, b"Content-Length: 2"],
        [b"POST /api/tasks/update-v2 HTTP/1.1", *base, b"X-Authorization: token-1", b"Content-Length: 2"],
        [b"POST /api/tasks/update-v2 HTTP/1.1", *base, b"Content-Length: 8"],
        [b"POST /api/tasks/update-v2 HTTP/1.1", *base, b"X-Authorization: token-2", b"Content-Length: 2"],
        [b"GET /api/tasks/t1 HTTP/1.1", host, b"Accept-Encoding: identity", b"Accept: text/plain"],
    ]


def test_a_refused_field_is_refused_on_every_call_and_the_made_ones_stay_bounded(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]],
) -> None:
    server, transport = scripted([ok(b"") for _ in range(lean._FIELD_SETS + 5)])
    for _ in range(2):  # not kept as made after its refusal
        with pytest.raises(ValueError, match="invalid HTTP header"):
            post(transport, {"X-Token": "a\r\nX-Evil: 1"})
        with pytest.raises(UnicodeEncodeError):  # not Latin-1: cannot go out as a header line
            post(transport, {"X-Token": "\u2603"})
    assert server.requests == []
    for n in range(lean._FIELD_SETS + 5):  # a token a call (as after refreshes): the made sets stay few
        post(transport, {"X-Authorization": f"token-{n}"})
        assert len(transport._fields) <= lean._FIELD_SETS
    assert [request.split(b"\r\n")[3] for _, request in server.requests] == [
        b"X-Authorization: token-%d" % n for n in range(lean._FIELD_SETS + 5)]


@pytest.fixture
def pair() -> Iterator[tuple[lean._Connection, socket.socket]]:
    """A pool connection (as the transport makes it) and the server's end of it."""
    listener = socket.create_server(("127.0.0.1", 0))
    conn = lean._Connection(socket.AF_INET, socket.SOCK_STREAM)
    conn.connect(listener.getsockname())
    conn.watch()
    peer, _ = listener.accept()
    listener.close()
    yield conn, peer
    conn.close()
    peer.close()


def test_a_quiet_idle_connection_is_open(pair: tuple[lean._Connection, socket.socket]) -> None:
    conn, peer = pair
    assert lean._still_open(conn)
    peer.sendall(b"x")
    assert conn.recv(1) == b"x"  # read: quiet again
    assert lean._still_open(conn)


@pytest.mark.parametrize("what", ["fin", "reset", "unasked bytes", "half close"])
def test_an_idle_connection_the_server_ended_or_spoke_on_is_not_open(
    pair: tuple[lean._Connection, socket.socket], what: str
) -> None:
    conn, peer = pair
    if what == "fin":
        peer.close()
    elif what == "reset":
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()
    elif what == "unasked bytes":
        peer.sendall(b"HTTP/1.1 408 Request Timeout\r\n\r\n")
    else:
        peer.shutdown(socket.SHUT_WR)
    wait_until(lambda: not lean._still_open(conn), 10, f"the {what} seen on the idle connection")


def test_a_request_that_fits_goes_out_in_one_send_without_arming_a_timer(
    scripted: Callable[..., tuple[ScriptedServer, LeanTransport]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, transport = scripted([ok(b"done")])
    armed: list[int] = []
    real_arm = answer.arm

    def arm(sock: socket.socket, option: int, seconds: float) -> None:
        armed.append(option)
        real_arm(sock, option, seconds)

    monkeypatch.setattr(lean, "arm", arm)
    assert post(transport, {"Content-Type": "application/json"}, b'{"a": 1}') == (200, b"done")
    assert armed == []  # the receive side is armed by the answer's reader (answer.arm), not here
    assert server.requests[0][1].endswith(b'\r\n\r\n{"a": 1}')


def test_no_time_left_sends_nothing(scripted: Callable[..., tuple[ScriptedServer, LeanTransport]]) -> None:
    server, transport = scripted([ok(b"")])
    conn = transport._connect(time.monotonic() + 5)
    with pytest.raises(TimeoutError):
        transport._send_all(conn, b"GET / HTTP/1.1\r\n\r\n", time.monotonic() - 1)
    conn.close()
    assert server.requests == []
