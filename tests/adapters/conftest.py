"""Fixtures of the adapter tests: an embedded server on a free loopback port, and a harness over it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

from leasecore.clock import SystemClock
from leasecore.conductor.client import MAX_BODY_BYTES, POOL_MAXSIZE, ConductorClient
from leasecore.conductor.lean import LeanTransport
from leasecore.conductor.transport import RequestsTransport
from leasecore.server import EmbeddedServer
from tests.conformance.harness import Harness


@pytest.fixture
def server() -> Iterator[EmbeddedServer]:
    """A fresh embedded server (no auth, ideal timing); a test module may override it."""
    with EmbeddedServer() as srv:
        yield srv


@pytest.fixture
def api(server: EmbeddedServer) -> Iterator[Harness]:
    """Plain-HTTP helper calls (the conformance harness) against ``server``."""
    harness = Harness(server.url, "embedded")
    yield harness
    harness.close()


# -- the client on each transport ----------------------------------------------------------------

TRANSPORTS = ("lean", "requests")


class Connect:
    """``connect(base_url, **ConductorClient options)``: a client on this run's transport (``kind``),
    so the client's contract tests run on the lean socket transport and on requests alike."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.clients: list[ConductorClient] = []

    def __call__(self, base_url: str, **options: Any) -> ConductorClient:
        if self.kind == "requests":
            clock = options.get("clock") or SystemClock()
            parts = urlsplit(base_url)
            options["transport"] = RequestsTransport(
                f"{parts.scheme}://{parts.netloc}",
                pool_maxsize=options.get("pool_maxsize", POOL_MAXSIZE),
                max_body_bytes=MAX_BODY_BYTES,
                monotonic=clock.monotonic,
            )
        client = ConductorClient(base_url, **options)
        expected = RequestsTransport if self.kind == "requests" else LeanTransport
        assert type(client.transport) is expected  # the transport under test is the one in use
        self.clients.append(client)
        return client


@pytest.fixture(params=TRANSPORTS)
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    factory = Connect(str(request.param))
    yield factory
    for client in factory.clients:
        client.close()
