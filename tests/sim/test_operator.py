"""The operator's pause, resume and drain in the simulator: exercised in the default campaign, clean
there, and each of their rules broken by a harness switch is found (``leasecore.sim.claims``)."""

from __future__ import annotations

import pytest

from leasecore.sim.scenario import SeedResult, SimOptions, run_seed
from leasecore.sim.setting import Bugs


def first_violation(options: SimOptions, seeds: int = 200) -> SeedResult | None:
    for seed in range(1, seeds + 1):
        result = run_seed(seed, options)
        if result.violations:
            return result
    return None


def test_pauses_and_drains_happen_in_the_default_campaign_and_run_clean() -> None:
    seen = {"PAUSE": 0, "RESUME": 0, "DRAIN": 0, "drained, exits": 0}
    for seed in range(1, 6):
        result = run_seed(seed, SimOptions(minutes=10, keep_trace=True))
        assert result.violations == [], (seed, result.violations)
        for line in result.trace:
            for key in seen:
                seen[key] += key in line
    # Each drain that ended by itself was checked: nothing left behind, nothing started after it.
    assert all(seen.values()), seen


def test_without_the_operator_nothing_is_paused_or_drained() -> None:
    result = run_seed(3, SimOptions(minutes=5, keep_trace=True, operator=False))
    assert not any("PAUSE" in line or "DRAIN" in line for line in result.trace)


@pytest.mark.parametrize(("bug", "invariant"), [
    ("pause_ignored", "claim while paused"),  # a paused runner polls on
    ("drain_starts_held", "drain"),  # a drained runner starts a held delivery instead of handing it back
])
def test_each_broken_operator_rule_is_found_within_200_seeds(bug: str, invariant: str) -> None:
    result = first_violation(SimOptions(minutes=10, bugs=Bugs(**{bug: True})))
    assert result is not None, f"{bug} not found in 200 seeds"
    assert result.violations[0].startswith(invariant), result.violations
