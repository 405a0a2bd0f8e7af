"""The Prometheus side of the metrics hooks (prometheus-client; imported only with metrics on).

Names and labels: the Conductor SDKs' canonical worker metrics (python-sdk METRICS.md, selected
there with ``WORKER_CANONICAL_METRICS=true``: ``task_poll_total``, ``task_execute_time_seconds``...,
label ``taskType``, error counters with ``exception`` = a class name, time histograms with
``status`` = ``SUCCESS`` / ``FAILURE``, their buckets), so dashboards made for SDK workers work, plus
``conductor_run_*`` for what no SDK exports: lease health (heartbeats, lateness, fences, ownership
checks, the smallest lease left) and the runner's slots and outbox.

Events are counted as they happen (counters and histograms, each label set's child looked up once
and kept: an event costs a dict lookup and prometheus-client's own lock). Gauges are read when
Prometheus scrapes (``RunnerGauges``), from what the runner, the pollers, the lease engine
(``views()``) and the outbox already know: nothing is kept up to date on the hot paths for them
but the count of children running, one integer per task type written by the runner's main thread.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from leasecore.lease import FenceReason
from leasecore.metrics import Observer, error_label, execute_error, final_status
from leasecore.models import TaskResult

# The SDKs' canonical buckets (python-sdk canonical_metrics_collector.py).
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000)
# A command runs for minutes or hours where an SDK function takes milliseconds: the same buckets
# (so SDK dashboards' quantiles still work), then more up to an hour.
EXECUTE_BUCKETS = (*TIME_BUCKETS, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

SUCCESS, FAILURE = "SUCCESS", "FAILURE"


class GaugeSource(Protocol):
    """What the scrape-time gauges read (``leasecore.metrics.service`` adapts the live objects)."""

    def running(self) -> Mapping[str, int]: ...
    def waiting(self) -> Mapping[str, int]: ...
    def free_slots(self) -> Mapping[str, int]: ...
    def outbox_results(self) -> int: ...
    def lease_remaining_seconds(self) -> float | None: ...


class _Children:
    """The labelled children of one metric, looked up once per label values (``labels()`` builds
    a tuple and takes a lock on every call)."""

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._kids: dict[tuple[str, ...], Any] = {}

    def __call__(self, *values: str) -> Any:
        kid = self._kids.get(values)
        if kid is None:
            kid = self._kids[values] = self._metric.labels(*values)  # a race makes the same child
        return kid


class PrometheusObserver(Observer):
    """Counts the runner's events in its own registry (plus the process, platform and GC metrics)."""

    enabled = True

    def __init__(self, task_types: Iterable[str]) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: half the series, none a dashboard uses
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        reg = self.registry

        def counter(name: str, doc: str, *labels: str) -> _Children:
            return _Children(Counter(name, doc, labels, registry=reg))

        def histogram(name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]) -> _Children:
            return _Children(Histogram(name, doc, labels, registry=reg, buckets=buckets))

        tt = "taskType"
        # -- the SDKs' canonical names
        self._poll = counter("task_poll", "Poll requests sent.", tt)
        self._poll_error = counter("task_poll_error", "Poll requests that failed.", tt, "exception")
        self._started = counter("task_execution_started",
                                "Tasks whose command was started (the SDKs: dispatched to the worker).", tt)
        self._execute_error = counter("task_execute_error",
                                      "Tasks whose command failed: a non-zero exit, a signal, a fence, "
                                      "a start that failed.", tt, "exception")
        self._update_error = counter("task_update_error", "Attempts to send a task's result that failed.",
                                     tt, "exception")
        self._poll_time = histogram("task_poll_time_seconds", "Poll request latency.", (tt, "status"),
                                    TIME_BUCKETS)
        self._execute_time = histogram("task_execute_time_seconds", "Run time of the task's command.",
                                       (tt, "status"), EXECUTE_BUCKETS)
        self._update_time = histogram("task_update_time_seconds", "Latency of one attempt to send a "
                                      "task's result.", (tt, "status"), TIME_BUCKETS)
        self._request_time = histogram("http_api_client_request_seconds", "HTTP requests to the Conductor "
                                       "server.", ("method", "uri", "status"), TIME_BUCKETS)
        self._result_size = histogram("task_result_size_bytes", "Size of a task result's outputData as "
                                      "JSON.", (tt,), SIZE_BUCKETS)
        # -- lease health, which no SDK exports
        self._results = counter("conductor_run_task_results",
                                "Tasks that left the runner, by the status the server accepted "
                                "(or UNDELIVERED, OWNERSHIP_LOST).", tt, "status")
        self._heartbeats = counter("conductor_run_heartbeats", "Heartbeats (extendLease), acknowledged "
                                   "(ok) or not (failed).", tt, "result")
        lateness = Histogram("conductor_run_heartbeat_lateness_seconds", "Heartbeat send time minus its "
                             "due time.", registry=reg, buckets=LATENESS_BUCKETS)
        self._lateness = lateness.observe
        self._fences = counter("conductor_run_fences", "Task trees stopped by a fence, by reason.", tt,
                               "reason")
        self._checks = counter("conductor_run_ownership_checks", "Ownership checks (GET /tasks/{id}): "
                               "ok, lost or failed.", tt, "result")
        self.running_by_type: dict[str, int] = {t: 0 for t in task_types}
        self.waiting_by_type: dict[str, int] = {t: 0 for t in task_types}  # held before their start
        for task_type in self.running_by_type:  # zero, not absent, until the first event
            self._poll(task_type)
            self._started(task_type)

    def watch(self, source: GaugeSource) -> None:
        """Serve the scrape-time gauges from ``source`` (once the runner exists)."""
        self.registry.register(RunnerGauges(source))

    # ---------------------------------------------------------------- hooks

    def on_poll(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        self._poll(task_type).inc()
        if error is None:
            self._poll_time(task_type, SUCCESS).observe(seconds)
        else:
            self._poll_time(task_type, FAILURE).observe(seconds)
            self._poll_error(task_type, error_label(error)).inc()

    def on_update(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        if error is None:
            self._update_time(task_type, SUCCESS).observe(seconds)
        else:
            self._update_time(task_type, FAILURE).observe(seconds)
            self._update_error(task_type, error_label(error)).inc()

    def on_request(self, method: str, uri: str, status: str, seconds: float) -> None:
        self._request_time(method, uri, status).observe(seconds)

    def on_heartbeat(self, task_type: str, ok: bool, lateness_seconds: float | None) -> None:
        self._heartbeats(task_type, "ok" if ok else "failed").inc()
        if lateness_seconds is not None:
            self._lateness(lateness_seconds)

    def on_ownership_check(self, task_type: str, result: str) -> None:
        self._checks(task_type, result).inc()

    def on_task_held(self, task_type: str, held: bool, fence: FenceReason | None = None) -> None:
        waiting = self.waiting_by_type.get(task_type, 0)
        self.waiting_by_type[task_type] = waiting + 1 if held else max(0, waiting - 1)
        if fence is not None:
            self._fences(task_type, fence.value).inc()

    def on_task_started(self, task_type: str) -> None:
        self._started(task_type).inc()
        self.running_by_type[task_type] = self.running_by_type.get(task_type, 0) + 1

    def on_task_exited(self, task_type: str, exit_: Any, fence: FenceReason | None,
                       in_progress_exit_code: int | None) -> None:
        running = self.running_by_type.get(task_type, 0)
        self.running_by_type[task_type] = max(0, running - 1)
        error = execute_error(exit_, fence, in_progress_exit_code)
        seconds = getattr(exit_, "duration_seconds", None)
        if isinstance(seconds, int | float) and getattr(exit_, "start_error", None) is None:
            self._execute_time(task_type, SUCCESS if error is None else FAILURE).observe(seconds)
        if error is not None:
            self._execute_error(task_type, error).inc()
        if fence is not None:
            self._fences(task_type, fence.value).inc()

    def on_result(self, task_type: str, result: TaskResult) -> None:
        output = result.output_data
        size = len(json.dumps(output).encode("utf-8")) if output else 2  # "{}"
        self._result_size(task_type).observe(size)

    def on_task_done(self, task_type: str, status: Any, fence: FenceReason | None) -> None:
        self._results(task_type, final_status(status, fence)).inc()


class RunnerGauges:
    """The gauges, read from ``source`` at each scrape (a prometheus-client custom collector)."""

    def __init__(self, source: GaugeSource) -> None:
        self._source = source

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._source))

    @staticmethod
    def _families(source: GaugeSource | None = None) -> list[Metric]:
        active = GaugeMetricFamily("active_workers", "Tasks whose command is running now (the SDKs' "
                                   "name).", labels=["taskType"])
        running = GaugeMetricFamily("conductor_run_tasks_running", "Tasks whose command is running now.",
                                    labels=["taskType"])
        waiting = GaugeMetricFamily("conductor_run_tasks_waiting", "Tasks polled and held, lease kept, "
                                    "whose command has not started yet (a previous holder may still run "
                                    "it, or an earlier attempt's tree is dying here).", labels=["taskType"])
        free = GaugeMetricFamily("conductor_run_slots_free", "Free slots: concurrency minus the commands "
                                 "running and the tasks waiting to start.", labels=["taskType"])
        outbox = GaugeMetricFamily("conductor_run_outbox_results", "Results waiting in the outbox for the "
                                   "server to take them.")
        lease = GaugeMetricFamily("conductor_run_lease_remaining_seconds", "Seconds until the nearest "
                                  "lease deadline over the tasks in flight (absent: none).")
        if source is not None:
            for task_type, count in sorted(source.running().items()):
                active.add_metric([task_type], count)
                running.add_metric([task_type], count)
            for task_type, count in sorted(source.waiting().items()):
                waiting.add_metric([task_type], count)
            for task_type, count in sorted(source.free_slots().items()):
                free.add_metric([task_type], count)
            outbox.add_metric([], source.outbox_results())
            left = source.lease_remaining_seconds()
            if left is not None and math.isfinite(left):
                lease.add_metric([], left)
        return [active, running, waiting, free, outbox, lease]
