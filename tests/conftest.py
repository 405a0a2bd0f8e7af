"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from leasecore.server import EmbeddedServer
from tests.integration.helpers import AUTH_KEY, AUTH_SECRET, World
from tests.integration.realworld import RealWorld

if TYPE_CHECKING:  # an annotation only: tests.realserver is loaded as a pytest plugin first
    from tests.realserver import RealConductorServer

# tests.realserver: the real Conductor OSS server fixtures (real_server_url); tests.durations: the
# ``slow`` marks from the measured tests/durations.json.
pytest_plugins = ["tests.realserver", "tests.durations"]

_PREFIXES = ("CONDUCTOR_", "conductor_", "conductor.")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``), every real_server test goes to one worker: one JVM."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("real_server") is not None:
            item.add_marker(pytest.mark.xdist_group("real_server"))


@pytest.fixture(autouse=True)
def clean_environ(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No test sees the developer's CONDUCTOR_* / conductor_worker_* settings."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES):
            monkeypatch.delenv(name, raising=False)
    yield


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """An embedded server on a free port, a task type with a short R, and the runner processes started."""
    with EmbeddedServer() as server:
        w = World(tmp_path, server)
        try:
            yield w
        finally:
            w.close()


@pytest.fixture
def auth_world(tmp_path: Path) -> Iterator[World]:
    """As ``world``, with a server that wants ``AUTH_KEY``/``AUTH_SECRET`` and runners that send them."""
    with EmbeddedServer(auth_key=AUTH_KEY, auth_secret=AUTH_SECRET) as server:
        w = World(tmp_path, server, auth_key=AUTH_KEY, auth_secret=AUTH_SECRET)
        try:
            yield w
        finally:
            w.close()


@pytest.fixture
def real_world(tmp_path: Path, real_server: RealConductorServer) -> Iterator[RealWorld]:
    """As ``world``, on the session's one real Conductor OSS server; cleans up its workflows and trees."""
    w = RealWorld(tmp_path, real_server)
    try:
        yield w
    finally:
        w.close()
