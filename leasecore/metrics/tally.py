"""Exact event counts as plain numbers, turned into prometheus-client metric families at each scrape.

What it owns: the counters and histograms of ``leasecore.metrics.prom`` (``Tallies``), kept as
dicts of ints and lists under one lock, and their collector (``Tallies.collect``), which builds
prometheus-client's own ``CounterMetricFamily`` / ``HistogramMetricFamily`` for the registry: the
text format is still prometheus-client's (``generate_latest``), none is written here.

Why not prometheus-client's ``Counter``/``Histogram`` on the hot path: each ``inc`` / ``observe``
there is four or five Python calls and a lock per value (a histogram: its sum, then a loop over the
buckets to the one that takes the value, each with its lock). Here an event is one lock taken, one
dict lookup, ``bisect`` for a histogram's bucket and two additions; cumulative buckets, ``_count``
and ``_sum`` are worked out when Prometheus asks.

Threads: any thread may count (the hooks run on the runner's main thread, the pollers, the reporter's
pool, the lease senders, the client's callers); the lock keeps every count exact. The scrape
(``collect``, on the endpoint's request thread) copies under the same lock, then builds outside it.
It must not touch the runner: it only knows the names, label names and numbers it was given.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

Key = tuple[str, ...]


class CounterTally:
    """One counter: label values -> count. Count with ``Tallies.lock`` held."""

    __slots__ = ("doc", "labels", "name", "values")

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.values: dict[Key, int] = {}

    def family(self, values: dict[Key, int] | None = None) -> Metric:
        family = CounterMetricFamily(self.name, self.doc, labels=self.labels)
        for key, count in sorted((values or {}).items()):
            family.add_metric(list(key), count)
        return family


class HistogramTally:
    """One histogram: label values -> [count in each bucket (not cumulative) ..., +Inf's, sum].

    A value goes in the first bucket whose bound is >= it (Prometheus' ``le``), as prometheus-client's
    ``Histogram.observe`` does."""

    __slots__ = ("_les", "bounds", "cells", "doc", "labels", "name")

    def __init__(self, name: str, doc: str, labels: Sequence[str], bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: bucket bounds must increase")
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.bounds = tuple(float(b) for b in bounds)
        self._les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        self.cells: dict[Key, list[float]] = {}

    def observe(self, key: Key, value: float) -> None:
        """Count ``value`` for ``key`` (``Tallies.lock`` held)."""
        cell = self.cells.get(key)
        if cell is None:
            cell = self.cells[key] = [0] * (len(self.bounds) + 1) + [0.0]
        cell[bisect_left(self.bounds, value)] += 1
        cell[-1] += value

    def family(self, cells: dict[Key, list[float]] | None = None) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        for key, cell in sorted((cells or {}).items()):
            running, buckets = 0.0, []
            for le, count in zip(self._les, cell[:-1], strict=True):
                running += count
                buckets.append((le, running))
            family.add_metric(list(key), buckets, sum_value=cell[-1])
        return family


class Tallies:
    """Every counter and histogram of one observer; a prometheus-client custom collector."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._counters: list[CounterTally] = []
        self._histograms: list[HistogramTally] = []

    def counter(self, name: str, doc: str, *labels: str) -> CounterTally:
        tally = CounterTally(name, doc, labels)
        self._counters.append(tally)
        return tally

    def histogram(self, name: str, doc: str, labels: Sequence[str],
                  bounds: Sequence[float]) -> HistogramTally:
        tally = HistogramTally(name, doc, labels, bounds)
        self._histograms.append(tally)
        return tally

    def describe(self) -> Iterator[Metric]:
        """The families without samples (the registry checks names against other collectors')."""
        return iter([c.family() for c in self._counters] + [h.family() for h in self._histograms])

    def collect(self) -> Iterator[Metric]:
        with self.lock:  # a copy: counting goes on while the families are built
            counts = [dict(c.values) for c in self._counters]
            cells = [{key: list(cell) for key, cell in h.cells.items()} for h in self._histograms]
        families = [c.family(v) for c, v in zip(self._counters, counts, strict=True)]
        families += [h.family(v) for h, v in zip(self._histograms, cells, strict=True)]
        return iter(families)
