"""The ``conductor`` fixture: one conformance suite, run against the embedded and the real server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from leasecore.server import EmbeddedServer
from tests.conformance.harness import Harness
from tests.realserver import SESSION_SERVER_ENV


@pytest.fixture(scope="session")
def embedded_conductor_url() -> Iterator[str]:
    # The same CONDUCTOR_SECRET_/CONDUCTOR_ENV_ pair as the session's real server (runtimeMetadata).
    with EmbeddedServer(runtime_environ=SESSION_SERVER_ENV) as srv:
        yield srv.url


@pytest.fixture(params=["embedded", pytest.param("real", marks=pytest.mark.real_server)])
def conductor(request: pytest.FixtureRequest) -> Iterator[Harness]:
    kind: str = request.param
    if kind == "embedded":
        url: str = request.getfixturevalue("embedded_conductor_url")
    else:
        url = request.getfixturevalue("real_server_url")
    harness = Harness(url, kind)
    try:
        yield harness
    finally:
        harness.close()
