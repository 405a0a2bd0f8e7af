"""The fault proxy itself, against a real TCP echo server on 127.0.0.1:0."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tests.faultproxy import FaultProxy, Mode
from tests.support import wait_until


class EchoServer:
    """Echoes every byte back; one thread per connection."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                try:
                    conn.sendall(data)
                except OSError:
                    return

    def close(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._acceptor.join(5)
        for thread in self._threads:
            thread.join(5)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def proxy(echo: EchoServer) -> Iterator[FaultProxy]:
    with FaultProxy("127.0.0.1", echo.port) as p:
        yield p


def connect(proxy: FaultProxy, timeout_seconds: float = 5.0) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=timeout_seconds)


def roundtrip(sock: socket.socket, payload: bytes) -> bytes:
    sock.sendall(payload)
    received = b""
    while len(received) < len(payload):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def test_pass_forwards_both_ways(proxy: FaultProxy) -> None:
    with connect(proxy) as sock:
        assert roundtrip(sock, b"hello") == b"hello"
        assert roundtrip(sock, b"x" * 200_000) == b"x" * 200_000
    assert proxy.url_for("/api") == f"http://127.0.0.1:{proxy.port}/api"


def test_refuse_closes_new_connections_but_not_existing_ones(proxy: FaultProxy) -> None:
    with connect(proxy) as existing:
        assert roundtrip(existing, b"a") == b"a"
        proxy.set_mode(Mode.REFUSE)
        try:
            with connect(proxy) as refused:
                refused.sendall(b"ping")
                assert refused.recv(10) == b""
        except ConnectionResetError:
            pass  # a close with unread data may turn into RST: refused either way
        assert roundtrip(existing, b"b") == b"b"


def test_reset_aborts_existing_and_new_connections(proxy: FaultProxy) -> None:
    with connect(proxy) as existing:
        assert roundtrip(existing, b"a") == b"a"
        proxy.set_mode(Mode.RESET)
        with pytest.raises(ConnectionResetError):
            # The pump notices the mode within a tick and aborts; keep talking until the RST lands.
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                existing.sendall(b"b")
                existing.recv(10)
        with pytest.raises(ConnectionResetError):
            assert_reset(proxy)


def test_blackhole_stalls_until_the_mode_changes(proxy: FaultProxy) -> None:
    with connect(proxy) as existing:
        assert roundtrip(existing, b"a") == b"a"
        proxy.set_mode(Mode.BLACKHOLE)
        with connect(proxy, timeout_seconds=0.3) as new:  # accepted: the handshake completes
            new.sendall(b"n")
            with pytest.raises(TimeoutError):
                new.recv(10)
            existing.settimeout(0.3)
            existing.sendall(b"e")
            with pytest.raises(TimeoutError):
                existing.recv(10)
            # Back to PASS: what was held flows again.
            proxy.set_mode(Mode.PASS)
            new.settimeout(5)
            existing.settimeout(5)
            assert new.recv(10) == b"n"
            assert existing.recv(10) == b"e"


def test_latency_delays_every_chunk(proxy: FaultProxy) -> None:
    proxy.set_mode(Mode.LATENCY, latency_seconds=0.2)
    with connect(proxy) as sock:
        started = time.monotonic()
        assert roundtrip(sock, b"slow") == b"slow"
        elapsed = time.monotonic() - started
    assert elapsed >= 0.4  # one delay each way
    with pytest.raises(ValueError):
        proxy.set_mode(Mode.LATENCY)


def test_connections_are_bounded(echo: EchoServer) -> None:
    with FaultProxy("127.0.0.1", echo.port, max_connections=2) as proxy:
        a, b = connect(proxy), connect(proxy)
        with a, b:
            assert roundtrip(a, b"1") == b"1"
            assert roundtrip(b, b"2") == b"2"
            assert wait_until(lambda: proxy.open_connections() == 2)
            with pytest.raises(ConnectionResetError):
                assert_reset(proxy)


def assert_reset(proxy: FaultProxy) -> None:
    """Talk on a new connection until the proxy's RST surfaces (at connect, send or recv)."""
    with connect(proxy) as sock:
        for _ in range(2):
            sock.sendall(b"?")
            sock.recv(10)


def test_exit_stops_every_thread(echo: EchoServer) -> None:
    with FaultProxy("127.0.0.1", echo.port) as proxy:
        socks = [connect(proxy) for _ in range(3)]
        for sock in socks:
            assert roundtrip(sock, b"x") == b"x"
        proxy.set_mode(Mode.BLACKHOLE)
        stalled = connect(proxy)
    try:
        assert proxy.open_connections() == 0
        assert not [t for t in threading.enumerate() if t.name.startswith("faultproxy-")]
    finally:
        for sock in [*socks, stalled]:
            sock.close()
