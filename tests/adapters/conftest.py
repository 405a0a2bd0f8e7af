"""Fixtures of the adapter tests: an embedded server on a free loopback port, and a harness over it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
