"""`conductor-run fleet` against the real Conductor OSS server, with real `conductor-run run` processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.fleet_scenario import check_the_scenario, two_runners_and_a_stalled_type
from tests.realserver import RealConductorServer

pytestmark = pytest.mark.real_server


def test_fleet_shows_two_runners_polling_and_the_type_nobody_polls_first(
    tmp_path: Path, real_server: RealConductorServer
) -> None:
    worlds, doc = two_runners_and_a_stalled_type(tmp_path, real_server)
    try:
        check_the_scenario(doc, worlds, real_server.url)
    finally:
        for world in worlds:
            world.close()
