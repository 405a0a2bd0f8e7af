"""The exact tallies behind the metrics (``leasecore.metrics.tally``): the same exposition as
prometheus-client's own Counter and Histogram for the same events, exact counts under many threads,
and the task type's label name (``metrics_task_type_label``) on every family that carries it."""

from __future__ import annotations

import random
import threading

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from leasecore.lease import FenceReason
from leasecore.metrics.prom import EXECUTE_BUCKETS, SIZE_BUCKETS, PrometheusObserver
from leasecore.metrics.tally import Tallies
from leasecore.models import TaskResult, TaskStatus
from tests.adapters.test_metrics_endpoint import _NoGauges


def _samples(registry: CollectorRegistry) -> set[tuple[str, str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return {(f.type, s.name, tuple(sorted(s.labels.items())), s.value)
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_the_tallies_expose_what_prometheus_clients_own_metrics_would() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tallies = Tallies()
    count = tallies.counter("jobs", "Jobs.", "kind").values
    observe = tallies.histogram("job_seconds", "Job time.", ("kind",), EXECUTE_BUCKETS).observe
    size = tallies.histogram("job_bytes", "Job size.", (), SIZE_BUCKETS).observe
    ours.register(tallies)
    counter = Counter("jobs", "Jobs.", ["kind"], registry=theirs)
    histogram = Histogram("job_seconds", "Job time.", ["kind"], buckets=EXECUTE_BUCKETS, registry=theirs)
    sizes = Histogram("job_bytes", "Job size.", buckets=SIZE_BUCKETS, registry=theirs)
    rnd = random.Random(20)
    # Every bound itself (a value on a bound is in that bucket: le), just above it, and beyond the last.
    values = [b for b in EXECUTE_BUCKETS] + [b * 1.0001 for b in EXECUTE_BUCKETS] + [0.0, 5000.0]
    for _ in range(2000):
        kind = rnd.choice(["a", "b"])
        value = rnd.choice(values)
        count[(kind,)] = count.get((kind,), 0) + 1
        counter.labels(kind).inc()
        observe((kind,), value)
        histogram.labels(kind).observe(value)
        nbytes = rnd.choice([2, 100, 101, 10**6, 10**8])
        size((), nbytes)
        sizes.observe(nbytes)
    created = {"jobs_created", "job_seconds_created", "job_bytes_created"}
    assert _samples(ours) == {s for s in _samples(theirs) if s[1] not in created}


def test_counts_stay_exact_with_many_threads_counting_at_once() -> None:
    observer = PrometheusObserver(["demo"])
    per_thread, threads = 5000, 8

    def work() -> None:
        for _ in range(per_thread):
            observer.on_request("POST", "/tasks", "200", 0.002)
            observer.on_heartbeat("demo", True, 0.01)
            observer.on_task_started("demo")

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    got = {(name, labels): value for _, name, labels, value in _samples(observer.registry)}
    total = per_thread * threads
    assert got[("http_api_client_request_seconds_count",
                (("method", "POST"), ("status", "200"), ("uri", "/tasks")))] == total
    assert got[("conductor_run_heartbeats_total", (("result", "ok"), ("taskType", "demo")))] == total
    assert got[("conductor_run_heartbeat_lateness_seconds_count", ())] == total
    assert got[("task_execution_started_total", (("taskType", "demo"),))] == total
    assert observer.running_by_type == {"demo": total}


def _fed(label: str) -> PrometheusObserver:
    observer = PrometheusObserver(["demo"], task_type_label=label)
    observer.watch(_NoGauges())
    observer.on_poll("demo", 0.01, None)
    observer.on_poll("demo", 0.01, OSError("down"))
    observer.on_update("demo", 0.01, None)
    observer.on_heartbeat("demo", True, 0.0)
    observer.on_ownership_check("demo", "ok")
    observer.on_task_held("demo", True)
    observer.on_task_held("demo", False, FenceReason.SHUTDOWN)
    observer.on_task_started("demo")
    observer.on_task_exited("demo", None, FenceReason.LEASE_EXPIRED, None)
    observer.on_result("demo", TaskResult("t", "w", TaskStatus.FAILED, {"a": 1}))
    observer.on_task_done("demo", TaskStatus.FAILED, None)
    return observer


def test_the_task_type_label_is_taskType_or_task_type_on_every_family_that_has_it() -> None:
    sdk, snake = _samples(_fed("taskType").registry), _samples(_fed("task_type").registry)
    with_type = {name for _, name, labels, _ in sdk if dict(labels).get("taskType") == "demo"}
    assert {"task_poll_total", "task_execution_started_total", "task_execute_error_total",
            "conductor_run_fences_total", "conductor_run_tasks_running", "conductor_run_slots_free",
            "active_workers", "task_result_size_bytes_count"} <= with_type
    assert not any("task_type" in dict(labels) for _, _, labels, _ in sdk)
    assert not any("taskType" in dict(labels) for _, _, labels, _ in snake)

    def renamed(labels: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(("task_type" if k == "taskType" else k, v) for k, v in labels))

    # The same series, the label renamed, nothing else (process metrics differ between two scrapes).
    def ours(samples: set[tuple[str, str, tuple[tuple[str, str], ...], float]]) -> set[object]:
        return {(t, n, renamed(ls), v) for t, n, ls, v in samples
                if not n.startswith(("process_", "python_"))}

    assert ours(sdk) == ours(snake)


def test_a_label_name_other_than_the_two_is_refused() -> None:
    with pytest.raises(ValueError, match="taskType or task_type"):
        PrometheusObserver(["demo"], task_type_label="task-type")
