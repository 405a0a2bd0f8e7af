"""Metrics for one run: the Prometheus observer, the endpoint, and what its gauges and probes read.

``leasecore.runner.wiring`` makes one when ``metrics_port`` is set (imported there only then: this module
loads prometheus-client), starts it before anything else of the run (a bad port is exit 3 even with
the server down), hands ``observer`` to the client, the pollers, the reporter, the lease engine and
the runner, ``attach``es the live objects once they exist, and ``close``s it last.

Owns: the run's ``PrometheusObserver``, its endpoint, and the probes' facts (``/healthz``,
``/readyz``) drawn from the attached objects. Must not: change what it reads (the runner, engine,
supervisor, contact and outbox are only looked at), or be imported on a run without metrics.
Threads: the observer's hooks run on whichever thread observes (pollers, the engine's, the reporter's,
the main loop); the endpoint's own thread serves scrapes and reads the gauges then.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from leasecore.clock import Clock, SystemClock
from leasecore.config.settings import ResolvedConfig
from leasecore.metrics.endpoint import MetricsEndpoint
from leasecore.metrics.health import HealthFacts, RunPhase, liveness, readiness
from leasecore.metrics.prom import PrometheusObserver

log = logging.getLogger("conductor_run.metrics")

_HTTP_TIMEOUT_SECONDS = 10.0  # the client's per-request bound: an answer can take this long


class _Runner(Protocol):
    loop_at: float | None

    @property
    def stopping(self) -> bool: ...
    def failed_pollers(self) -> list[str]: ...
    def paused_types(self) -> list[str]: ...


class _Engine(Protocol):
    def views(self) -> Mapping[str, Any]: ...
    def alive(self) -> bool: ...


class _Supervisor(Protocol):
    @property
    def forkserver_up(self) -> bool: ...


class _Contact(Protocol):
    last_ok_at: float | None


class _Outbox(Protocol):
    def saved_count(self) -> int: ...


def poll_window_seconds(config: ResolvedConfig) -> float:
    """How old the server's newest answer may be on a healthy runner: a poll answers within its
    timeout and the next follows within the pause after an empty one (at most 1 s, or the configured
    interval); with every slot busy, the ownership checks talk to it instead; plus the HTTP timeout."""
    longest = 0.0
    for task in config.tasks:
        polling = task.poll_timeout / 1000.0 + max(1.0, task.poll_interval / 1000.0)
        longest = max(longest, polling, task.ownership_check_interval)
    return longest + _HTTP_TIMEOUT_SECONDS


class MetricsService:
    """See the module docstring."""

    def __init__(self, config: ResolvedConfig, *, clock: Clock | None = None) -> None:
        runner = config.runner
        if runner.metrics_port is None:
            raise ValueError("metrics are off: no metrics_port")
        self._clock = clock or SystemClock()
        self._types = [t.type for t in config.tasks]
        self._concurrency = {t.type: t.concurrency for t in config.tasks}
        self._window = poll_window_seconds(config)
        self.observer = PrometheusObserver(self._types, task_type_label=runner.metrics_task_type_label)
        sources = (str(runner.sources.get("metrics_host", "default")),
                   str(runner.sources.get("metrics_port", "default")))
        self._listen = (runner.metrics_host, runner.metrics_port)  # as configured (port 0: any)
        self.endpoint = MetricsEndpoint(runner.metrics_host, runner.metrics_port, exposition=self._exposition,
                                        liveness=self.liveness, readiness=self.readiness, sources=sources)
        self._runner: _Runner | None = None
        self._engine: _Engine | None = None
        self._supervisor: _Supervisor | None = None
        self._contact: _Contact | None = None
        self._outbox: _Outbox | None = None
        self._stopped = False

    def start(self) -> None:
        """Bind (``ConfigError`` if it cannot) and serve; logs where."""
        self.endpoint.start()
        log.info("metrics on %s/metrics (probes /healthz, /readyz)", self.endpoint.url)

    def reconfigure(self, config: ResolvedConfig) -> None:
        """A reload: the concurrency and poll window from ``config``; a new ``metrics_host`` or
        ``metrics_port`` is listened on first (``ConfigError`` if it cannot: nothing changes), then
        the old endpoint closes. Turning metrics on or off, or a new label, needs a restart
        (``leasecore.config.live`` refuses those before this is called)."""
        runner = config.runner
        if runner.metrics_port is None:
            raise ValueError("metrics are off: no metrics_port")
        old = self.endpoint
        if (runner.metrics_host, runner.metrics_port) != self._listen:
            sources = (str(runner.sources.get("metrics_host", "default")),
                       str(runner.sources.get("metrics_port", "default")))
            endpoint = MetricsEndpoint(runner.metrics_host, runner.metrics_port, exposition=self._exposition,
                                       liveness=self.liveness, readiness=self.readiness, sources=sources)
            endpoint.start()
            self.endpoint, self._listen = endpoint, (runner.metrics_host, runner.metrics_port)
            old.close()
            log.info("metrics moved to %s/metrics", endpoint.url)
        self._concurrency = {t.type: t.concurrency for t in config.tasks}
        self._window = poll_window_seconds(config)

    def attach(self, *, runner: _Runner, engine: _Engine, supervisor: _Supervisor, contact: _Contact,
               outbox: _Outbox) -> None:
        """The live objects, once the runner is built; the gauges are served from then on."""
        self._runner, self._engine, self._supervisor = runner, engine, supervisor
        self._contact, self._outbox = contact, outbox
        self.observer.watch(self)

    def stopped(self) -> None:
        """The runner has returned: the probes say so until ``close``."""
        self._stopped = True

    def close(self) -> None:
        self.endpoint.close()

    # ---------------------------------------------------------------- /metrics and its gauges

    def _exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.observer.registry), CONTENT_TYPE_LATEST

    def running(self) -> Mapping[str, int]:
        return dict(self.observer.running_by_type)  # a dict copy is atomic under the GIL

    def waiting(self) -> Mapping[str, int]:
        return dict(self.observer.waiting_by_type)

    def free_slots(self) -> Mapping[str, int]:
        # Concurrency minus the commands running and the tasks held before their start (they hold
        # their slot): a slot a poll has reserved for the tasks it may bring is still free (it is
        # free for them), as is one whose task is only reporting its result.
        running, waiting = self.observer.running_by_type, self.observer.waiting_by_type
        return {t: max(0, n - running.get(t, 0) - waiting.get(t, 0)) for t, n in self._concurrency.items()}

    def paused(self) -> Mapping[str, bool]:
        paused = set(self._runner.paused_types()) if self._runner is not None else set()
        return {t: t in paused for t in self._types}

    def outbox_results(self) -> int:
        return self._outbox.saved_count() if self._outbox is not None else 0

    def task_progress(self) -> Mapping[str, tuple[str, float]]:
        progress = getattr(self._runner, "task_progress", None)  # replaced whole by the runner
        return dict(progress) if isinstance(progress, dict) else {}

    def lease_remaining_seconds(self) -> float | None:
        if self._engine is None:
            return None
        now = self._clock.monotonic()
        deadlines = [v.lease_deadline for v in self._engine.views().values() if v.lease_deadline is not None]
        return min(deadlines) - now if deadlines else None

    # ---------------------------------------------------------------- probes

    def facts(self) -> HealthFacts:
        now = self._clock.monotonic()
        runner = self._runner
        if self._stopped:
            return HealthFacts(phase=RunPhase.STOPPED)
        if runner is None or runner.loop_at is None:
            return HealthFacts(phase=RunPhase.STARTING)
        dead = [f"the poller of {t}" for t in runner.failed_pollers()]
        paused = runner.paused_types()
        if self._engine is not None and not self._engine.alive():
            dead.append("the lease engine's timer thread")
        last_ok = self._contact.last_ok_at if self._contact is not None else None
        return HealthFacts(
            phase=RunPhase.STOPPING if runner.stopping else RunPhase.SERVING,
            loop_age_seconds=now - runner.loop_at,
            dead_threads=tuple(dead),
            forkserver_up=self._supervisor.forkserver_up if self._supervisor is not None else True,
            contact_age_seconds=None if last_ok is None else now - last_ok,
            poll_window_seconds=self._window,
            talking=len(paused) < len(self._types) or sum(self.running().values()) > 0,
            paused=tuple(paused),
        )

    def liveness(self) -> tuple[bool, str]:
        return liveness(self.facts())

    def readiness(self) -> tuple[bool, str]:
        return readiness(self.facts())
