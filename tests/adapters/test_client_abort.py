"""``ConductorClient.abort()`` (a forced stop) cuts a call in flight instead of letting it wait for
its timeout, on the lean http:// path and on https:// through requests; later calls get a short bound."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from leasecore.conductor.client import ABORTED_CALL_SECONDS, ConductorClient
from leasecore.errors import ConductorUnavailable
from leasecore.models import TaskResult, TaskStatus
from leasecore.server import EmbeddedServer
from tests.faultproxy import FaultProxy
from tests.tlsrelay import TlsRelay, make_private_ca

RESULT = TaskResult("t", "wf", TaskStatus.COMPLETED)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for sock in held:
            sock.close()
        listener.close()


def _cut_in_flight(client: ConductorClient) -> float:
    """Start an update that cannot be answered, abort once it is under way; seconds it took to end."""
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            client.update(RESULT, timeout_seconds=10.0)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)  # let the call reach its blocking read (no event to wait on from outside)
    started = time.monotonic()
    client.abort()
    thread.join(timeout=15)
    assert not thread.is_alive()
    assert isinstance(outcome[0], ConductorUnavailable), outcome
    return time.monotonic() - started


def test_abort_cuts_a_lean_call_in_flight_and_bounds_later_ones() -> None:
    with EmbeddedServer() as server, FaultProxy("127.0.0.1", server.port) as proxy:
        client = ConductorClient(proxy.url_for("/api"))
        try:
            assert client.connections_opened is not None  # the lean path
            proxy.set_mode("blackhole")
            assert _cut_in_flight(client) < 2.0  # not the 10 s timeout
            started = time.monotonic()
            with pytest.raises(ConductorUnavailable):
                client.update(RESULT, timeout_seconds=10.0)
            assert time.monotonic() - started < ABORTED_CALL_SECONDS + 1.0
            proxy.set_mode("pass")  # a server that answers still takes calls after the abort
            assert client.health(timeout_seconds=10.0)
        finally:
            client.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_abort_cuts_an_https_call_in_flight(tmp_path: Path, silent_port: int) -> None:
    certs = make_private_ca(tmp_path / "ca")
    with TlsRelay(certs, "127.0.0.1", silent_port) as relay:
        client = ConductorClient(relay.url_for("/api"), ca_bundle=str(certs.ca))
        try:
            assert client.connections_opened is None  # through requests
            assert _cut_in_flight(client) < 2.0
        finally:
            client.close()
