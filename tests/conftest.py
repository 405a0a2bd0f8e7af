"""Fixtures shared by the whole suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


# The modules holding real_server tests (the conformance suite's [real] half included). Under
# pytest-xdist they all run on one worker, so one JVM serves them; collection fails when a module
# with a real_server test is missing here.
REAL_SERVER_MODULES = frozenset({
    "tests/conformance/test_fleet_queues.py",
    "tests/conformance/test_metadata_logs_errors.py",
    "tests/conformance/test_poll.py",
    "tests/conformance/test_resume_facts.py",
    "tests/conformance/test_timeouts_and_retries.py",
    "tests/conformance/test_update.py",
    "tests/integration/test_real_server_e2e.py",
    "tests/integration/test_real_server_chain.py",
    "tests/integration/test_real_server_fleet.py",
    "tests/integration/test_real_server_late_heartbeat.py",
    "tests/integration/test_real_server_lost_lease.py",
    "tests/integration/test_real_server_protocol.py",
    "tests/integration/test_real_server_resume.py",
    "tests/integration/test_real_server_smoke.py",
    "tests/integration/test_secrets_real_server.py",
    "tests/integration/test_stdio_real_server.py",
})


def schedule_scope(nodeid: str) -> str:
    """What one xdist worker runs as a unit: the test's module, or every real-server module at once."""
    module = nodeid.split("::", 1)[0]
    return "real_server" if module in REAL_SERVER_MODULES else module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A real_server test in a module REAL_SERVER_MODULES does not name would start a second JVM."""
    unlisted = sorted({
        item.nodeid.split("::", 1)[0] for item in items if item.get_closest_marker("real_server") is not None
    } - REAL_SERVER_MODULES)
    if unlisted:
        raise pytest.UsageError(
            f"real_server tests in {unlisted}: add the modules to REAL_SERVER_MODULES (tests/conftest.py)"
        )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (``scripts/test``): one worker runs a whole module, never two of its tests at once (a
    module finds the processes it started by a command line its tests share, ``sleep 3218``, and kills
    its leftovers after each test), and all real-server modules go to one worker. An explicit
    ``--dist`` other than the default ``load`` is left to xdist. (Not ``--dist loadgroup``: on pytest
    9.2 it silently stops grouping, pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return schedule_scope(nodeid)

    return ModuleScheduling(config, log)


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
