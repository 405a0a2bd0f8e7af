"""Name resolution bounded by the attempt's deadline (leasecore.conductor.resolve), alone and under the lean
transport and the client: a resolver that hangs costs the attempt no more than its budget."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import pytest

from leasecore.conductor.client import ConductorClient
from leasecore.conductor.lean import LeanTransport
from leasecore.conductor.resolve import BoundedResolver, ResolveTimeout
from leasecore.errors import ConductorUnavailable
from leasecore.server import EmbeddedServer


class HangingLookup:
    """A getaddrinfo that blocks until released, counting its calls."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, host: str, port: int, *args: Any) -> list[tuple[Any, ...]]:
        with self.lock:
            self.calls += 1
        self.release.wait(30)
        return socket.getaddrinfo("127.0.0.1", port, 0, socket.SOCK_STREAM)


def test_a_hanging_lookup_ends_at_the_timeout_and_is_shared_by_every_waiter() -> None:
    lookup = HangingLookup()
    resolver = BoundedResolver(lookup)
    errors: list[BaseException] = []

    def attempt() -> None:
        try:
            resolver.resolve("conductor.invalid", 8080, 0.3)
        except BaseException as exc:
            errors.append(exc)

    started = time.monotonic()
    threads = [threading.Thread(target=attempt) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    elapsed = time.monotonic() - started
    try:
        assert len(errors) == 4 and all(isinstance(e, ResolveTimeout) for e in errors), errors
        assert 0.25 <= elapsed < 2.0
        assert lookup.calls == 1  # one parked thread per name, not one per attempt
    finally:
        lookup.release.set()
    # Once the lookup comes back, its waiters get its answer; the next attempt looks up afresh (no cache).
    assert resolver.resolve("conductor.invalid", 8080, 5.0)[0][4] == ("127.0.0.1", 8080)
    calls = lookup.calls
    assert resolver.resolve("conductor.invalid", 8080, 5.0)[0][4] == ("127.0.0.1", 8080)
    assert lookup.calls == calls + 1


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_literal_address_is_never_looked_up(host: str) -> None:
    lookup = HangingLookup()
    ((family, kind, _, _, address),) = BoundedResolver(lookup).resolve(host, 80, 0.01)
    assert address == (host, 80)
    assert family == (socket.AF_INET6 if ":" in host else socket.AF_INET) and kind == socket.SOCK_STREAM
    assert lookup.calls == 0


def test_a_name_that_does_not_resolve_raises_the_lookups_error() -> None:
    def refuse(*args: Any) -> list[tuple[Any, ...]]:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    with pytest.raises(socket.gaierror):
        BoundedResolver(refuse).resolve("nowhere.invalid", 80, 5.0)


def test_the_lean_transport_connects_through_the_resolver(server: EmbeddedServer) -> None:
    seen: list[str] = []

    def lookup(host: str, port: int, *args: Any) -> list[tuple[Any, ...]]:
        seen.append(host)
        return socket.getaddrinfo("127.0.0.1", port, 0, socket.SOCK_STREAM)

    transport = LeanTransport(
        "conductor.test", server.port, max_idle=1, monotonic=time.monotonic, resolver=BoundedResolver(lookup)
    )
    try:
        status, body = transport.send("GET", "/health", None, {}, time.monotonic() + 5, idempotent=True)
    finally:
        transport.close()
    assert status == 200 and b"healthy" in body
    assert seen == ["conductor.test"]


def test_a_client_call_through_a_hanging_resolver_is_unavailable_within_its_budget() -> None:
    lookup = HangingLookup()
    transport = LeanTransport(
        "conductor.test", 9, max_idle=1, monotonic=time.monotonic, resolver=BoundedResolver(lookup)
    )
    client = ConductorClient("http://conductor.test:9/api", transport=transport)
    started = time.monotonic()
    try:
        with pytest.raises(ConductorUnavailable) as info:
            client.extend_lease("t1", "w1", timeout_seconds=0.5)
        elapsed = time.monotonic() - started
    finally:
        lookup.release.set()
        client.close()
    assert 0.45 <= elapsed < 2.0
    assert "cannot resolve the host name in time" in str(info.value)
    assert info.value.retryable and info.value.status_code is None
