"""A yield whose answer was lost is not sent again once its next run was polled, on the REAL Conductor
OSS server (3.32.1): the scenario of ``test_lost_yield_e2e.py`` (a proxy lets the yield through and
loses its answer until the runner polled the next run) against the jar. Sent again, the yield would
re-queue that run (the jar's IN_PROGRESS update of a polled task makes it SCHEDULED again)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.realworld import RealWorld
from tests.integration.test_lost_yield_e2e import run_lost_yield_scenario

pytestmark = pytest.mark.real_server


def test_a_yield_whose_answer_was_lost_is_not_sent_again_on_the_real_server(
    real_world: RealWorld, tmp_path: Path
) -> None:
    run_lost_yield_scenario(real_world, tmp_path)
