"""The Prometheus side of the metrics hooks (prometheus-client; imported only with metrics on).

Names and labels: the Conductor SDKs' canonical worker metrics (python-sdk METRICS.md, selected
there with ``WORKER_CANONICAL_METRICS=true``: ``task_poll_total``, ``task_execute_time_seconds``...,
label ``taskType``, error counters with ``exception`` = a class name, time histograms with
``status`` = ``SUCCESS`` / ``FAILURE``, their buckets), so dashboards made for SDK workers work, plus
``conductor_run_*`` for what no SDK exports: lease health (heartbeats, lateness, fences, ownership
checks, the smallest lease left) and the runner's slots and outbox. The task type's label name is
``taskType`` unless ``metrics_task_type_label = "task_type"`` (promtool's snake_case lint).

Events are counted as they happen, exactly, in plain numbers (``leasecore.metrics.tally``: one lock
and a dict lookup an event; prometheus-client builds the families when Prometheus scrapes). Gauges
are read at the scrape too (``RunnerGauges``), from what the runner, the lease engine (``views()``)
and the outbox already know: nothing is kept up to date on the hot paths for them but the count of
commands running and waiting, one integer per task type written with the event that changes it.

Threads: built at a scrape, on the metrics endpoint's thread.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from leasecore.lease import FenceReason
from leasecore.metrics import ExitView, error_label, execute_error, final_status
from leasecore.metrics.tally import Tallies
from leasecore.models import TaskResult, TaskStatus

# The SDKs' canonical buckets (python-sdk canonical_metrics_collector.py).
TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000)
# A command runs for minutes or hours where an SDK function takes milliseconds: the same buckets
# (so SDK dashboards' quantiles still work), then more up to an hour.
EXECUTE_BUCKETS = (*TIME_BUCKETS, 30.0, 60.0, 300.0, 900.0, 1800.0, 3600.0)
LATENESS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

SUCCESS, FAILURE = "SUCCESS", "FAILURE"
# The label that carries the task type: the SDKs' name (their dashboards), or promtool's snake_case.
TASK_TYPE_LABELS = ("taskType", "task_type")
_NO_LABELS: tuple[str, ...] = ()


class GaugeSource(Protocol):
    """What the scrape-time gauges read (``leasecore.metrics.service`` adapts the live objects)."""

    def running(self) -> Mapping[str, int]: ...
    def waiting(self) -> Mapping[str, int]: ...
    def free_slots(self) -> Mapping[str, int]: ...
    def outbox_results(self) -> int: ...
    def lease_remaining_seconds(self) -> float | None: ...
    def paused(self) -> Mapping[str, bool]: ...
    def task_progress(self) -> Mapping[str, tuple[str, float]]: ...  # task id -> (type, 0..1)


class PrometheusObserver:
    """Counts the runner's events in its own registry (plus the process, platform and GC metrics)."""

    enabled = True

    def __init__(self, task_types: Iterable[str], *, task_type_label: str = "taskType") -> None:
        if task_type_label not in TASK_TYPE_LABELS:
            raise ValueError(f"task_type_label: {' or '.join(TASK_TYPE_LABELS)}, not {task_type_label!r}")
        self.task_type_label = tt = task_type_label
        disable_created_metrics()  # type: ignore[no-untyped-call]  # no *_created series: half the series, none a dashboard uses
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        t = self._tallies = Tallies()
        self._lock = t.lock
        # -- the SDKs' canonical names
        self._poll = t.counter("task_poll", "Poll requests sent.", tt).values
        self._poll_error = t.counter("task_poll_error", "Poll requests that failed.", tt, "exception").values
        self._started = t.counter("task_execution_started", "Tasks whose command was started (the SDKs: "
                                  "dispatched to the worker).", tt).values
        self._execute_error = t.counter("task_execute_error",
                                        "Tasks whose command failed: a non-zero exit, a signal, a fence, "
                                        "a start that failed.", tt, "exception").values
        self._update_error = t.counter("task_update_error", "Attempts to send a task's result that failed.",
                                       tt, "exception").values
        self._poll_time = t.histogram("task_poll_time_seconds", "Poll request latency.", (tt, "status"),
                                      TIME_BUCKETS).observe
        self._execute_time = t.histogram("task_execute_time_seconds", "Run time of the task's command.",
                                         (tt, "status"), EXECUTE_BUCKETS).observe
        self._update_time = t.histogram("task_update_time_seconds", "Latency of one attempt to send a "
                                        "task's result.", (tt, "status"), TIME_BUCKETS).observe
        self._request_time = t.histogram("http_api_client_request_seconds", "HTTP requests to the Conductor "
                                         "server.", ("method", "uri", "status"), TIME_BUCKETS).observe
        self._result_size = t.histogram("task_result_size_bytes", "Size of a task result's outputData as "
                                        "JSON.", (tt,), SIZE_BUCKETS).observe
        # -- lease health, which no SDK exports
        self._results = t.counter("conductor_run_task_results",
                                  "Tasks that left the runner, by the status the server accepted "
                                  "(or UNDELIVERED, OWNERSHIP_LOST).", tt, "status").values
        self._heartbeats = t.counter("conductor_run_heartbeats", "Heartbeats (extendLease), acknowledged "
                                     "(ok) or not (failed).", tt, "result").values
        self._lateness = t.histogram("conductor_run_heartbeat_lateness_seconds", "Heartbeat send time minus "
                                     "its due time.", (), LATENESS_BUCKETS).observe
        self._fences = t.counter("conductor_run_fences", "Task trees stopped by a fence, by reason.", tt,
                                 "reason").values
        self._switch_fences = t.counter("conductor_run_switch_fences", "Task trees ended by the fork "
                                        "server's dead-man's switch while the runner was stalled, by the "
                                        "deadline that passed.", tt, "reason").values
        self._checks = t.counter("conductor_run_ownership_checks", "Ownership checks (GET /tasks/{id}): "
                                 "ok, lost or failed.", tt, "result").values
        self._resent = t.counter("conductor_run_final_results_resent",
                                 "Final results sent again: a heartbeat that reached the server after "
                                 "the final update had undone it (docs/final-results.md).", tt).values
        self.registry.register(t)
        self.running_by_type: dict[str, int] = {name: 0 for name in task_types}
        # held before their start
        self.waiting_by_type: dict[str, int] = dict.fromkeys(self.running_by_type, 0)
        for task_type in self.running_by_type:  # zero, not absent, until the first event
            self._poll[(task_type,)] = 0
            self._started[(task_type,)] = 0
            self._resent[(task_type,)] = 0

    def watch(self, source: GaugeSource) -> None:
        """Serve the scrape-time gauges from ``source`` (once the runner exists)."""
        self.registry.register(RunnerGauges(source, task_type_label=self.task_type_label))

    # ---------------------------------------------------------------- hooks
    # Each takes the one lock for its few additions: any thread may call any hook (exact counts).

    def on_poll(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        key = (task_type,)
        with self._lock:
            self._poll[key] = self._poll.get(key, 0) + 1
            if error is None:
                self._poll_time((task_type, SUCCESS), seconds)
            else:
                self._poll_time((task_type, FAILURE), seconds)
                _add(self._poll_error, (task_type, error_label(error)))

    def on_update(self, task_type: str, seconds: float, error: BaseException | None) -> None:
        with self._lock:
            if error is None:
                self._update_time((task_type, SUCCESS), seconds)
            else:
                self._update_time((task_type, FAILURE), seconds)
                _add(self._update_error, (task_type, error_label(error)))

    def on_request(self, method: str, uri: str, status: str, seconds: float) -> None:
        with self._lock:
            self._request_time((method, uri, status), seconds)

    def on_heartbeat(self, task_type: str, ok: bool, lateness_seconds: float | None) -> None:
        with self._lock:
            _add(self._heartbeats, (task_type, "ok" if ok else "failed"))
            if lateness_seconds is not None:
                self._lateness(_NO_LABELS, lateness_seconds)

    def on_ownership_check(self, task_type: str, result: str) -> None:
        with self._lock:
            _add(self._checks, (task_type, result))

    def on_final_result_resent(self, task_type: str) -> None:
        with self._lock:
            _add(self._resent, (task_type,))

    def on_task_held(self, task_type: str, held: bool, fence: FenceReason | None = None) -> None:
        with self._lock:
            waiting = self.waiting_by_type.get(task_type, 0)
            self.waiting_by_type[task_type] = waiting + 1 if held else max(0, waiting - 1)
            if fence is not None:
                _add(self._fences, (task_type, fence.value))

    def on_task_started(self, task_type: str) -> None:
        key = (task_type,)
        with self._lock:
            self._started[key] = self._started.get(key, 0) + 1
            self.running_by_type[task_type] = self.running_by_type.get(task_type, 0) + 1

    def on_task_exited(self, task_type: str, exit_: ExitView | BaseException | None,
                       fence: FenceReason | None, in_progress_exit_code: int | None) -> None:
        error = execute_error(exit_, fence, in_progress_exit_code)
        seconds = None  # never ran (or lost track of): no run time
        if exit_ is not None and not isinstance(exit_, BaseException) and exit_.start_error is None:
            seconds = exit_.duration_seconds
        with self._lock:
            running = self.running_by_type.get(task_type, 0)
            self.running_by_type[task_type] = max(0, running - 1)
            if seconds is not None:
                self._execute_time((task_type, SUCCESS if error is None else FAILURE), seconds)
            if error is not None:
                _add(self._execute_error, (task_type, error))
            if fence is not None:
                _add(self._fences, (task_type, fence.value))

    def on_switch_fenced(self, task_type: str, fence: FenceReason | None) -> None:
        with self._lock:
            _add(self._switch_fences, (task_type, (fence or FenceReason.LEASE_EXPIRED).value))

    def on_result(self, task_type: str, result: TaskResult) -> None:
        size = len(result.output_json())  # the text the update sends, encoded once for both
        with self._lock:
            self._result_size((task_type,), size)

    def on_task_done(self, task_type: str, status: TaskStatus | None, fence: FenceReason | None) -> None:
        key = (task_type, final_status(status, fence))
        with self._lock:
            self._results[key] = self._results.get(key, 0) + 1


def _add(counts: dict[tuple[str, ...], int], key: tuple[str, ...]) -> None:
    counts[key] = counts.get(key, 0) + 1


class RunnerGauges:
    """The gauges, read from ``source`` at each scrape (a prometheus-client custom collector)."""

    def __init__(self, source: GaugeSource, *, task_type_label: str = "taskType") -> None:
        self._source = source
        self._label = task_type_label

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(None))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._source))

    def _families(self, source: GaugeSource | None) -> list[Metric]:
        tt = [self._label]
        active = GaugeMetricFamily("active_workers", "Tasks whose command is running now (the SDKs' "
                                   "name).", labels=tt)
        running = GaugeMetricFamily("conductor_run_tasks_running", "Tasks whose command is running now.",
                                    labels=tt)
        waiting = GaugeMetricFamily("conductor_run_tasks_waiting", "Tasks polled and held, lease kept, "
                                    "whose command has not started yet (a previous holder may still run "
                                    "it, or an earlier attempt's tree is dying here).", labels=tt)
        free = GaugeMetricFamily("conductor_run_slots_free", "Free slots: concurrency minus the commands "
                                 "running and the tasks waiting to start.", labels=tt)
        outbox = GaugeMetricFamily("conductor_run_outbox_results", "Results waiting in the outbox for the "
                                   "server to take them.")
        lease = GaugeMetricFamily("conductor_run_lease_remaining_seconds", "Seconds until the nearest "
                                  "lease deadline over the tasks in flight (absent: none).")
        paused = GaugeMetricFamily("conductor_run_task_type_paused", "1 while the task type is paused "
                                   "(configured paused, conductor-run pause, a reload): nothing is polled "
                                   "for it; 0 while it is polled.", labels=tt)
        progress = GaugeMetricFamily("conductor_run_task_progress", "A task in flight's progress (0..1), "
                                     "from its checkpoint's \"progress\" (absent: none given).",
                                     labels=[*tt, "taskId"])
        if source is not None:
            for task_type, is_paused in sorted(source.paused().items()):
                paused.add_metric([task_type], 1 if is_paused else 0)
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
            for task_id, (task_type, fraction) in sorted(source.task_progress().items()):
                progress.add_metric([task_type, task_id], fraction)
        return [active, running, waiting, free, outbox, lease, paused, progress]
