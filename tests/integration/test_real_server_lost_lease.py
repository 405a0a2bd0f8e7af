"""The lost lease's read-first on the real Conductor OSS server (3.32.1): a stalled runner's FAILED
"lease expired" never lands on the delivery the test polled meanwhile (the scenario and why:
``test_lost_lease_report_e2e.py``)."""

from __future__ import annotations

import pytest

from tests.integration.realworld import RealWorld
from tests.integration.test_lost_lease_report_e2e import scenario

pytestmark = pytest.mark.real_server


def test_a_stalled_runners_failed_never_lands_on_another_runners_delivery(real_world: RealWorld) -> None:
    scenario(real_world)
