"""first_attempt_spread: a batch of leases polled together does not beat in one burst (1000 leases did)."""

from __future__ import annotations

import pytest

from leasecore.errors import ConfigError
from leasecore.lease import CheckOwnership, Lease, LeasePolicy, SendHeartbeat


def _first_attempts(spread: float, draw: float) -> tuple[float, float]:
    # no grace, no margin: the interval is 0.8 R, as in test_lease's policy()
    policy = LeasePolicy(response_timeout_seconds=10, first_attempt_spread=spread, kill_grace_seconds=0.0,
                         fence_margin_seconds=0.0)
    lease = Lease(policy, 100.0, random=lambda: draw)
    beat = check = None
    for step in range(1, 1000):
        now = 100.0 + step * 0.01
        for action in lease.on_tick(now):
            if isinstance(action, SendHeartbeat) and beat is None:
                beat = now
                lease.on_heartbeat_ok(now, sent_at=now)
            elif isinstance(action, CheckOwnership) and check is None:
                check = now
                lease.on_ownership_check_failed(now)
        if beat is not None and check is not None:
            break
    assert beat is not None and check is not None
    return beat - 100.0, check - 100.0


def test_without_spread_the_first_beat_and_check_are_on_time() -> None:
    beat, check = _first_attempts(0.0, 0.9)
    assert beat == pytest.approx(8.0, abs=0.011)  # 0.8 R
    assert check == pytest.approx(5.0, abs=0.011)  # the ownership check interval


def test_spread_draws_the_first_attempts_earlier_never_later() -> None:
    beat, check = _first_attempts(1.0, 0.25)
    assert beat == pytest.approx(8.0 * 0.75, abs=0.011)
    assert check == pytest.approx(5.0 * 0.75, abs=0.011)


def test_spread_is_a_fraction() -> None:
    with pytest.raises(ConfigError):
        LeasePolicy(response_timeout_seconds=10, first_attempt_spread=1.5)
