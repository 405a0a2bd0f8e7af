"""The ownership checks' budget (leasecore.checkbudget): a token bucket on an injected clock."""

from __future__ import annotations

import pytest

from leasecore.checkbudget import CheckBudget, check_period, max_queue_seconds


def test_the_period_is_the_interval_until_the_tasks_outgrow_the_rate() -> None:
    assert check_period(5.0, 1, 20.0) == 5.0
    assert check_period(5.0, 100, 20.0) == 5.0
    assert check_period(5.0, 1000, 20.0) == 50.0
    assert check_period(5.0, 1000, 0.0) == 5.0  # no budget
    assert check_period(5.0, 0, 20.0) == 5.0


def test_a_quiet_runner_starts_a_seconds_worth_at_once_then_the_rate() -> None:
    budget = CheckBudget(10.0, now=100.0)
    started = 0
    while budget.available(100.0):
        budget.take(100.0)
        started += 1
    assert started == 10  # the burst: one second's worth
    assert budget.wait_seconds(100.0) == pytest.approx(0.1)
    assert budget.available(100.05) == 0
    assert budget.available(100.1) == 1
    # Over a long busy spell: no more than the rate, whoever asks.
    now, count = 100.1, 0
    while now < 110.1:
        while budget.available(now):
            budget.take(now)
            count += 1
        now += 0.01
    assert 99 <= count <= 101
    assert budget.started == started + count


def test_the_bucket_never_holds_more_than_its_burst() -> None:
    budget = CheckBudget(2.0, now=0.0)
    assert budget.available(3600.0) == 2
    assert CheckBudget(0.5, now=0.0).available(10.0) == 1  # at least one token


def test_rate_zero_is_no_limit_and_bad_rates_are_refused() -> None:
    budget = CheckBudget(0.0)
    for _ in range(10_000):
        assert budget.available(0.0) > 0
        budget.take(0.0)
    assert budget.wait_seconds(0.0) == 0.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="ownership check rate"):
            CheckBudget(bad)


def test_the_longest_hold_is_the_most_leases_over_the_rate() -> None:
    assert max_queue_seconds(12, 20.0) == pytest.approx(0.6)
    assert max_queue_seconds(1000, 20.0) == pytest.approx(50.0)
    assert max_queue_seconds(12, 0.0) == 0.0  # no budget: no hold
