"""Pure arithmetic for the report: percentiles, medians, lease-confirmation gaps. No I/O."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between closest ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50.0)


def summary(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, p50, p99 and max of ``values`` (None when there are none)."""
    return {
        "count": len(values),
        "p50": percentile(values, 50.0),
        "p99": percentile(values, 99.0),
        "max": max(values) if values else None,
    }


def confirmation_gaps(claims: Iterable[float], leases: Iterable[float], end: float | None) -> list[float]:
    """Gaps between consecutive lease confirmations of one task (a claim by poll counts as one).

    Confirmations after ``end`` (the final update, when known) are ignored: once the task is
    reported, the lease no longer matters.
    """
    times = sorted([*claims, *leases])
    if end is not None:
        times = [t for t in times if t <= end]
    return [b - a for a, b in itertools.pairwise(times)]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
