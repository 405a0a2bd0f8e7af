"""Capped exponential backoff with jitter from an injected random source."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from leasecore.backoff import Backoff
from leasecore.errors import ConfigError


def test_heartbeat_retry_delays_are_1_then_1_5_then_2_then_every_2_seconds() -> None:
    # Given the heartbeat retry shape from DESIGN.md §4
    backoff = Backoff(initial_seconds=1.0, multiplier=1.5, max_seconds=2.0)
    # When / Then
    assert [backoff.delay(n) for n in range(1, 7)] == [1.0, 1.5, 2.0, 2.0, 2.0, 2.0]


def test_delays_double_until_the_cap() -> None:
    backoff = Backoff(initial_seconds=0.5, multiplier=2.0, max_seconds=5.0)
    assert list(itertools.islice(backoff.delays(), 6)) == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


def test_multiplier_one_gives_a_constant_delay_even_for_huge_attempt_numbers() -> None:
    assert Backoff(initial_seconds=0.2, multiplier=1.0, max_seconds=1.0).delay(10**9) == 0.2


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert Backoff(initial_seconds=1.0, multiplier=10.0, max_seconds=60.0).delay(100_000) == 60.0


def test_jitter_shortens_a_delay_by_at_most_the_ratio() -> None:
    # Given 20 % jitter
    backoff = Backoff(initial_seconds=1.0, multiplier=2.0, max_seconds=8.0, jitter_ratio=0.2)
    # When the random source draws 0, 0.5 and just under 1
    # Then the delay is the nominal one, 10 % and (almost) 20 % shorter
    assert backoff.delay(3, 0.0) == 4.0
    assert backoff.delay(3, 0.5) == pytest.approx(3.6)
    assert backoff.delay(3, 0.999999) == pytest.approx(3.2, abs=1e-5)


def test_delays_draws_from_the_injected_random_source() -> None:
    draws = iter([0.5, 0.0, 0.25])
    backoff = Backoff(initial_seconds=1.0, multiplier=2.0, max_seconds=10.0, jitter_ratio=0.5)
    assert list(itertools.islice(backoff.delays(lambda: next(draws)), 3)) == [0.75, 2.0, 3.5]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"initial_seconds": 0.0}, "initial"),
        ({"multiplier": 0.5}, "multiplier"),
        ({"initial_seconds": 5.0, "max_seconds": 1.0}, "cap"),
        ({"jitter_ratio": 1.0}, "jitter"),
    ],
)
def test_invalid_shapes_are_config_errors(kwargs: dict[str, float], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        Backoff(**kwargs)


def test_attempt_numbers_and_random_values_are_checked() -> None:
    backoff = Backoff()
    with pytest.raises(ValueError, match="start at 1"):
        backoff.delay(0)
    with pytest.raises(ValueError, match="random_value"):
        backoff.delay(1, 1.5)


@settings(max_examples=50)
@given(
    initial=st.floats(0.01, 10),
    multiplier=st.floats(1, 4),
    extra=st.floats(0, 100),
    jitter=st.floats(0, 0.99),
    attempt=st.integers(1, 200),
    draw=st.floats(0, 1, exclude_max=True),
)
def test_any_delay_lies_between_the_jittered_floor_and_the_cap(
    initial: float, multiplier: float, extra: float, jitter: float, attempt: int, draw: float
) -> None:
    backoff = Backoff(initial, multiplier, initial + extra, jitter)
    nominal = backoff.nominal(attempt)
    delay = backoff.delay(attempt, draw)
    assert initial <= nominal <= initial + extra
    assert nominal * (1 - jitter) - 1e-9 <= delay <= nominal
    assert backoff.nominal(attempt + 1) >= nominal  # never shrinks as attempts grow


def test_the_poll_loop_and_the_reporter_use_this_backoff() -> None:
    # One implementation: the poller's waits (pollpolicy.PollBackoff, injected draws) and the
    # reporter's (finalfailure.REPORT_BACKOFF) are this class's delays.
    from leasecore.lease.finalfailure import REPORT_BACKOFF
    from leasecore.runner.upstream.pollpolicy import BackoffPolicy, PollBackoff

    draws = iter([0.0, 0.5, 0.9, 0.25, 0.0])
    poll = PollBackoff(BackoffPolicy(error_base_seconds=0.5, error_cap_seconds=10.0, jitter=0.5),
                       rand=lambda: next(draws))
    errors = Backoff(0.5, 2.0, 10.0, jitter_ratio=0.5)
    assert [poll.on_error() for _ in range(5)] == [errors.delay(n, r) for n, r in
                                                   zip(range(1, 6), [0.0, 0.5, 0.9, 0.25, 0.0], strict=True)]
    assert [REPORT_BACKOFF.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 5.0]
    assert PollBackoff(BackoffPolicy(empty_base_seconds=0.0), rand=lambda: 0.0).on_empty() == 0.0
