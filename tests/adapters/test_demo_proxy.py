"""SilenceProxy: real HTTP through a loopback relay to the embedded server; silence, resume, stop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from leasecore.conductor.client import ConductorClient
from leasecore.demo.proxy import SilenceProxy
from leasecore.errors import ConductorUnavailable
from leasecore.server import EmbeddedServer
from tests.support import wait_until


@pytest.fixture
def proxy(server: EmbeddedServer) -> Iterator[SilenceProxy]:
    with SilenceProxy("127.0.0.1", server.port) as relay:
        yield relay


def _raw_health(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    return sock


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _closed_without_answer(sock: socket.socket) -> bool:
    """The relay closed the connection (FIN, or RST since our request was never read) and said nothing."""
    sock.settimeout(10)
    try:
        return _read_all(sock) == b""
    except ConnectionResetError:
        return True


def test_relays_http_both_ways(proxy: SilenceProxy) -> None:
    client = ConductorClient(proxy.url_for("/api"), timeout_seconds=5)
    try:
        assert client.health()
        assert proxy.accepted >= 1
    finally:
        client.close()


def test_silence_makes_calls_time_out_and_resume_makes_them_work_again(proxy: SilenceProxy) -> None:
    client = ConductorClient(proxy.url_for("/api"), timeout_seconds=5)
    try:
        proxy.silence()
        assert proxy.silent
        started = time.monotonic()
        with pytest.raises(ConductorUnavailable):
            client.get_task_status("nope", timeout_seconds=0.5)
        assert time.monotonic() - started < 4.0  # the client's own timeout ended it, nothing else
        proxy.resume()
        assert not proxy.silent
        assert client.get_task_status("nope", timeout_seconds=5) is None  # 404: the server answers again
    finally:
        client.close()


def test_bytes_held_during_silence_flow_on_resume(proxy: SilenceProxy) -> None:
    proxy.silence()
    sock = _raw_health(proxy.port)
    sock.settimeout(0.3)
    with pytest.raises(TimeoutError):
        sock.recv(1)  # connected, request sent, and not a byte comes back
    proxy.resume()
    sock.settimeout(10)
    try:
        answer = _read_all(sock)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 200")


def test_stop_closes_connections_and_joins_threads(server: EmbeddedServer) -> None:
    before = threading.active_count()
    relay = SilenceProxy("127.0.0.1", server.port).start()
    relay.silence()
    sock = _raw_health(relay.port)
    try:
        wait_until(lambda: relay.accepted >= 1, 10, "the accept thread to pick the connection up")
        relay.stop()
        assert _closed_without_answer(sock)
    finally:
        sock.close()
    assert threading.active_count() <= before
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", relay.port), timeout=2).close()


def test_an_unreachable_target_closes_the_client_connection() -> None:
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    dead_port = spare.getsockname()[1]
    spare.close()  # nothing listens there any more
    with SilenceProxy("127.0.0.1", dead_port) as relay:
        sock = _raw_health(relay.port)
        try:
            assert _closed_without_answer(sock)
        finally:
            sock.close()
