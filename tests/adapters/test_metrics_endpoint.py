"""The metrics adapters: the endpoint on loopback, the Prometheus observer fed by the real lease
engine, poller and reporter with scripted ports; counts checked exactly against what the ports saw."""

from __future__ import annotations

import errno
import json
import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from leasecore.clock import FakeClock
from leasecore.errors import ConductorRejected, ConductorUnavailable, ConfigError
from leasecore.lease import FenceAction, LeasePolicy
from leasecore.metrics.endpoint import MetricsEndpoint
from leasecore.metrics.prom import PrometheusObserver
from leasecore.models import Task, TaskOwnership, TaskResult, TaskStatus
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.senders import InlineSenders
from leasecore.runner.ports import PollSettings
from leasecore.runner.upstream.poller import Poller, WorkBudget
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from tests.adapters.engine_support import step_until
from tests.integration.helpers import ROOT
from tests.support import wait_until


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def samples(observer: PrometheusObserver) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(observer.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(observer: PrometheusObserver, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(observer).items() if n == name and want <= ls)


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    state = {"ready": (False, "stopping: no new work is taken")}
    ep = MetricsEndpoint("127.0.0.1", 0, exposition=lambda: (b"# metrics\n", "text/plain; version=0.0.4"),
                         liveness=lambda: (True, "serving"), readiness=lambda: state["ready"])
    ep.start()
    try:
        yield ep
    finally:
        ep.close()


def test_the_endpoint_serves_metrics_and_probes_and_nothing_else(endpoint: MetricsEndpoint) -> None:
    assert endpoint.port > 0 and endpoint.url == f"http://127.0.0.1:{endpoint.port}"
    assert get(endpoint.port, "/metrics") == (200, "# metrics\n")
    assert get(endpoint.port, "/healthz") == (200, "ok: serving\n")
    assert get(endpoint.port, "/readyz") == (503, "unavailable: stopping: no new work is taken\n")
    assert get(endpoint.port, "/healthz?verbose=1")[0] == 200
    assert get(endpoint.port, "/") == (404, "not found: /metrics, /healthz, /readyz\n")


def test_close_releases_the_port(endpoint: MetricsEndpoint) -> None:
    port = endpoint.port
    endpoint.close()
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # free again
    with pytest.raises(OSError):
        get(port, "/healthz")


def test_a_port_in_use_and_an_address_not_here_are_config_errors_naming_their_key() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ep = MetricsEndpoint("127.0.0.1", port, exposition=lambda: (b"", ""), liveness=lambda: (True, ""),
                             readiness=lambda: (True, ""),
                             sources=("default", "env CONDUCTOR_RUN_METRICS_PORT"))
        with pytest.raises(ConfigError) as info:
            ep.start()
    assert info.value.key == "metrics_port"
    assert str(info.value) == (f"invalid metrics_port = {port} (from env CONDUCTOR_RUN_METRICS_PORT): cannot "
                               f"listen on http://127.0.0.1:{port}: Address already in use (another process "
                               "listens there: pick another port)")
    # An address this host does not have (not bound here: tests stay on loopback).
    ep = MetricsEndpoint("10.255.255.1", 9464, exposition=lambda: (b"", ""), liveness=lambda: (True, ""),
                         readiness=lambda: (True, ""), sources=("flag --metrics-host", "flag --metrics-port"))
    error = ep._bind_error(OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address"))
    assert error.key == "metrics_host"
    assert str(error) == ("invalid metrics_host = '10.255.255.1' (from flag --metrics-host): cannot listen "
                          "there: Cannot assign requested address (an address of this host, such as "
                          "127.0.0.1 or 0.0.0.0)")


# ------------------------------------------------------------------------------- the observer, fed


class ScriptedLeasePort:
    """Task "good": heartbeats acknowledged; ownership ours once, then COMPLETED (lost). Task "bad":
    every heartbeat refused (its lease then expires)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.beats: list[tuple[str, str]] = []
        self.checks: list[tuple[str, str]] = []

    def extend_lease(self, task_id: str, workflow_id: str, *, timeout_seconds: float) -> None:
        outcome = "failed" if task_id == "bad" else "ok"
        with self.lock:
            self.beats.append((task_id, outcome))
        if outcome == "failed":
            raise ConductorUnavailable("connection refused")

    def get_task_ownership(self, task_id: str, *, timeout_seconds: float) -> TaskOwnership | None:
        with self.lock:
            first = not self.checks
            self.checks.append((task_id, "ok" if first else "lost"))
        return TaskOwnership(TaskStatus.IN_PROGRESS if first else TaskStatus.COMPLETED, poll_count=1)


def test_the_lease_engine_counts_each_heartbeat_and_check_by_its_result() -> None:
    observer = PrometheusObserver(["demo"])
    port = ScriptedLeasePort()
    fences: list[tuple[str, FenceAction]] = []
    clock = FakeClock()  # stepped: the engine's requests run in this thread at their wake-ups
    engine = LeaseEngine(port, lambda task_id, action: fences.append((task_id, action)), observer=observer,
                         clock=clock, executor=InlineSenders())  # fmt: skip

    def task(task_id: str) -> Task:
        return Task(task_id=task_id, workflow_id="w", task_type="demo", response_timeout_seconds=2,
                    poll_count=1)

    # R = 3 s: kill_grace capped at R/4 = 0.75 s, so a beat every 0.8 x (3 - 0.75 - 0.4) = 1.48 s
    # and the TERM point 1.15 s before the deadline; "good"'s ownership checks every 2.2 s,
    # "bad"'s never (its refused beats fence it at 1.85 s).
    engine.track(task("good"), LeasePolicy(response_timeout_seconds=3, kill_grace_seconds=1.0,
                                           ownership_check_interval_seconds=2.2))
    engine.track(task("bad"), LeasePolicy(response_timeout_seconds=3, kill_grace_seconds=1.0,
                                          ownership_check_interval_seconds=3600))
    step_until(engine, clock, lambda: len(port.checks) >= 2, within_seconds=30)
    step_until(engine, clock, lambda: {"good", "bad"} <= {k for k, _ in fences}, within_seconds=30)
    with port.lock:
        beats, checks = list(port.beats), list(port.checks)
    assert ("good", "ok") in beats and ("bad", "failed") in beats
    ok = value(observer, "conductor_run_heartbeats_total", taskType="demo", result="ok")
    failed = value(observer, "conductor_run_heartbeats_total", taskType="demo", result="failed")
    assert ok == beats.count(("good", "ok"))
    # Every refused beat, plus any the engine gave up before sending (too late to try): never fewer.
    assert failed >= beats.count(("bad", "failed")) >= 1
    assert value(observer, "conductor_run_heartbeat_lateness_seconds_count") == len(beats)  # one per send
    assert value(observer, "conductor_run_ownership_checks_total", taskType="demo", result="ok") == 1
    lost = value(observer, "conductor_run_ownership_checks_total", taskType="demo", result="lost")
    assert lost == sum(1 for _, result in checks if result == "lost") >= 1
    assert value(observer, "conductor_run_ownership_checks_total", taskType="demo") == len(checks)


class ScriptedPolls:
    def __init__(self) -> None:
        self.calls = 0
        self.stop = threading.Event()

    def poll(self, task_type: str, *, count: int, timeout_ms: int, worker_id: str | None = None,
             domain: str | None = None) -> list[Task]:
        self.calls += 1
        if self.calls == 2:
            raise ConductorUnavailable("connection refused")
        if self.calls >= 4:
            self.stop.set()
        return []


def test_the_poller_counts_polls_their_errors_and_times() -> None:
    observer = PrometheusObserver(["demo"])
    polls = ScriptedPolls()
    poller = Poller(polls, PollSettings("demo", interval_seconds=0.01), lambda *_: None,
                    budget=WorkBudget(None), stop=polls.stop, observer=observer)
    poller.start()
    assert poller.join(30)
    assert value(observer, "task_poll_total", taskType="demo") == polls.calls
    assert value(observer, "task_poll_error_total", taskType="demo", exception="ConductorUnavailable") == 1
    assert value(observer, "task_poll_time_seconds_count", taskType="demo", status="FAILURE") == 1
    successes = value(observer, "task_poll_time_seconds_count", taskType="demo", status="SUCCESS")
    assert successes == polls.calls - 1


class ScriptedUpdates:
    def __init__(self) -> None:
        self.calls = 0

    def update(self, result: TaskResult, *, timeout_seconds: float | None = None) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ConductorUnavailable("connection refused")  # retried
        if result.task_id == "refused":
            raise ConductorRejected("bad request", status_code=409)  # final, not retried


def test_the_reporter_counts_each_attempt_and_its_error() -> None:
    observer = PrometheusObserver(["demo"])
    port = ScriptedUpdates()
    done: list[ReportOutcome] = []
    reporter = Reporter(port, done.append, observer=observer)
    reporter.submit(TaskResult("t1", "w1", TaskStatus.COMPLETED), retry_seconds=30, task_type="demo")
    wait_until(lambda: done, what="the first report")
    reporter.submit(TaskResult("refused", "w2", TaskStatus.IN_PROGRESS), retry_seconds=30, task_type="demo")
    reporter.close()
    assert [o.delivered for o in done] == [True, False] and port.calls == 3
    assert value(observer, "task_update_time_seconds_count", taskType="demo", status="SUCCESS") == 1
    assert value(observer, "task_update_time_seconds_count", taskType="demo", status="FAILURE") == 2
    assert value(observer, "task_update_error_total", taskType="demo", exception="ConductorUnavailable") == 1
    assert value(observer, "task_update_error_total", taskType="demo", exception="ConductorRejected") == 1


def test_the_dashboard_asks_only_for_metrics_the_runner_exports() -> None:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "conductor-run.json").read_text())
    observer = PrometheusObserver(["demo"])
    observer.watch(_NoGauges())
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    exported = {family.name + suffix for family in observer.registry.collect()
                for suffix in suffixes.get(family.type, ("",))}
    titles = [panel["title"] for panel in dashboard["panels"]]
    for wanted in ("Throughput", "Failures by status", "Heartbeat lateness p99", "Fences by reason",
                   "Running vs slots"):
        assert any(title.startswith(wanted) for title in titles), wanted
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            asked = set(re.findall(r"\b((?:task|conductor_run|active|http)_[a-z_]+)", target["expr"]))
            assert asked, target["expr"]
            assert asked <= exported, (panel["title"], asked - exported)


class _NoGauges:
    def running(self) -> dict[str, int]:
        return {"demo": 0}

    def waiting(self) -> dict[str, int]:
        return {"demo": 0}

    def free_slots(self) -> dict[str, int]:
        return {"demo": 1}

    def outbox_results(self) -> int:
        return 0

    def lease_remaining_seconds(self) -> float | None:
        return 1.0

    def paused(self) -> dict[str, bool]:
        return {"demo": False}

    def task_progress(self) -> dict[str, tuple[str, float]]:
        return {"t1": ("demo", 0.5)}


# ------------------------------------------------------------------------------- the service's facts


class FakeRunner:
    def __init__(self) -> None:
        self.loop_at: float | None = None
        self.stopping = False
        self.failed: list[str] = []
        self.paused: list[str] = []

    def failed_pollers(self) -> list[str]:
        return list(self.failed)

    def paused_types(self) -> list[str]:
        return list(self.paused)


class FakeEngine:
    def __init__(self) -> None:
        self.up = True
        self.deadlines: list[float | None] = []

    def alive(self) -> bool:
        return self.up

    def views(self) -> dict[str, object]:
        from types import SimpleNamespace

        return {str(i): SimpleNamespace(lease_deadline=d) for i, d in enumerate(self.deadlines)}


class FakeSupervisor:
    forkserver_up = True


class FakeContact:
    last_ok_at: float | None = None


class FakeOutbox:
    def saved_count(self) -> int:
        return 2


def test_the_service_reads_the_probes_and_gauges_from_the_live_objects() -> None:
    from leasecore.clock import FakeClock
    from leasecore.config.loader import parse_toml, resolve
    from leasecore.metrics.service import MetricsService

    text = '[worker]\nmetrics_port = 0\n[[task]]\ntype = "demo"\ncommand = ["true"]\nconcurrency = 3\n'
    config = resolve(parse_toml(text, "conductor.toml"), {}, {}, cwd="/work", hostname="h")
    clock = FakeClock()
    service = MetricsService(config, clock=clock)
    assert service.liveness() == (True, "starting")
    assert service.readiness() == (False, "starting: not polling yet")
    runner, engine, supervisor, contact = FakeRunner(), FakeEngine(), FakeSupervisor(), FakeContact()
    service.attach(runner=runner, engine=engine, supervisor=supervisor, contact=contact, outbox=FakeOutbox())
    runner.loop_at = clock.monotonic()
    assert service.readiness() == (False, "no answer from the Conductor server yet")
    contact.last_ok_at = clock.monotonic()
    assert service.readiness() == (True, "ready") and service.liveness() == (True, "serving")
    clock.advance(16.0)  # past the 15 s window (1 s poll + 1 s pause, 5 s checks, + 10 s); loop turned
    runner.loop_at = clock.monotonic()
    assert service.readiness() == (False, "no answer from the Conductor server for 16 s (poll window 15 s)")
    contact.last_ok_at = clock.monotonic()
    supervisor.forkserver_up = False
    assert service.readiness()[1] == "the fork server is down (a new one starts with the next task)"
    supervisor.forkserver_up = True
    engine.up = False
    assert service.liveness() == (False, "dead: the lease engine's timer thread")
    engine.up = True
    runner.failed = ["demo"]
    assert service.liveness() == (False, "dead: the poller of demo")
    runner.failed = []
    clock.advance(31.0)
    contact.last_ok_at = clock.monotonic()
    assert service.liveness() == (False, "the runner's main loop has not turned for 31 s")
    runner.loop_at = clock.monotonic()
    runner.stopping = True
    assert service.liveness() == (True, "stopping")
    assert service.readiness() == (False, "stopping: no new work is taken")
    # Gauges: running from the observer, free slots = concurrency - running, the nearest lease.
    service.observer.on_task_started("demo")
    engine.deadlines = [clock.monotonic() + 7.5, None, clock.monotonic() + 2.5]
    assert value(service.observer, "conductor_run_tasks_running", taskType="demo") == 1
    assert value(service.observer, "active_workers", taskType="demo") == 1
    assert value(service.observer, "conductor_run_slots_free", taskType="demo") == 2
    assert value(service.observer, "conductor_run_outbox_results") == 2
    assert value(service.observer, "conductor_run_lease_remaining_seconds") == 2.5
    service.stopped()
    assert service.liveness() == (False, "the runner has stopped")


def test_a_reload_moves_the_endpoint_and_follows_the_paused_types() -> None:
    from dataclasses import replace

    from leasecore.clock import FakeClock
    from leasecore.config.loader import parse_toml, resolve
    from leasecore.metrics.service import MetricsService

    def free_port() -> int:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])

    first, second = free_port(), free_port()
    text = f'[worker]\nmetrics_port = {first}\n[[task]]\ntype = "demo"\ncommand = ["true"]\nconcurrency = 3\n'
    config = resolve(parse_toml(text, "conductor.toml"), {}, {}, cwd="/work", hostname="h")
    clock = FakeClock()
    service = MetricsService(config, clock=clock)
    service.start()
    try:
        runner, contact = FakeRunner(), FakeContact()
        service.attach(runner=runner, engine=FakeEngine(), supervisor=FakeSupervisor(), contact=contact,
                       outbox=FakeOutbox())
        runner.loop_at = contact.last_ok_at = clock.monotonic()
        runner.paused = ["demo"]
        assert get(first, "/readyz") == (200, "ok: ready; paused: demo\n")
        assert service.paused() == {"demo": True}

        moved = replace(config, runner=replace(config.runner, metrics_port=second),
                        tasks=(replace(config.tasks[0], concurrency=5),))
        service.reconfigure(moved)
        assert get(second, "/healthz")[0] == 200
        with pytest.raises(OSError):
            get(first, "/healthz")  # the old address is closed
        assert service.free_slots() == {"demo": 5}

        taken = replace(config, runner=replace(config.runner, metrics_port=second), tasks=moved.tasks)
        service.reconfigure(taken)  # same address: nothing re-bound
        assert get(second, "/healthz")[0] == 200
    finally:
        service.close()
