"""Build the real collaborators from a resolved configuration and run the worker.

Owns: the one place that knows every adapter's constructor (``ConductorClient``, ``Supervisor``,
``LeaseEngine``, ``StatePublisher``, the outbox, the metrics service) and the start's order: local
things first (the state directory, made and checked once as a ``StateDir`` and handed on to the
outbox, the supervisor's records, the sweep's hand-over and the publisher; the cgroup mechanism; the
metrics port), then the server check, the sweep of a dead runner's trees, the saved results, and the
runner. The CLI calls ``run_worker``; errors of the tree propagate (a server unreachable at start
raises ``ConductorUnavailable`` before anything runs).

Must not: decide anything about a task (the runner and the pure core do), print, or exit.
Threads: the CLI's main thread (``run_worker`` captures signals for the whole call); ``Redelivery``
runs one ``outbox-redelivery`` thread while the runner serves.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from leasecore.checkbudget import CheckBudget, max_queue_seconds
from leasecore.clock import SystemClock
from leasecore.conductor.client import ConductorClient
from leasecore.config.settings import ResolvedConfig, TaskSettings
from leasecore.errors import ConductorUnavailable, ConfigError
from leasecore.lease import FenceAction, LeasePolicy
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskResult
from leasecore.process import CommandSpec, Supervisor, to_task_result
from leasecore.process.runas import RunAs, RunAsError, resolve_run_as
from leasecore.runner import treegroups
from leasecore.runner.contact import RecordedLeaseCalls, ServerContact
from leasecore.runner.engine import LeaseEngine
from leasecore.runner.ports import PollSettings, RunOptions, RunOutcome, StatusPort, TaskTypePlan, UpdatePort
from leasecore.runner.reporter import Reporter, ReportOutcome
from leasecore.runner.runner import Runner
from leasecore.runner.signals import SignalRelay, StartupInterrupted, capture_signals
from leasecore.runner.status import StatusTee
from leasecore.snapshot import RunnerSnapshot, redact_url
from leasecore.state.directory import StateDir
from leasecore.state.orphans import take_over, tree_meta
from leasecore.state.outbox import Outbox
from leasecore.state.statefile import StatePublisher

if TYPE_CHECKING:  # prometheus-client is imported only with metrics on (idle footprint)
    from leasecore.metrics.service import MetricsService

log = logging.getLogger("conductor_run.worker")

STARTUP_CHECK_TIMEOUT_SECONDS = 5.0
# A lease's first heartbeat (and ownership check) is drawn uniformly over its interval: a batch of
# tasks polled together then beats at a steady rate, not in one burst at 0.8 R (#9: 1000 leases).
FIRST_ATTEMPT_SPREAD = 1.0


class WarnWhenCapped:
    """``make_policy`` that warns once (per task type) when the lease caps a configured value.

    A heartbeat timeout longer than the task's responseTimeoutSeconds would keep the tree running past
    the moment the server may hand the task to another worker, so the lease caps it (``LeasePolicy``);
    likewise a kill_grace longer than a quarter of the lease: the tree is TERMed kill_grace before the
    deadline, so a longer grace would leave the lease hardly any time. The user asked for more, so say
    so, once per value and task type, not per task. Called on the pollers' threads.
    """

    def __init__(self, task_type: str, make_policy: Callable[[Task], LeasePolicy]) -> None:
        self._task_type = task_type
        self._make_policy = make_policy
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def __call__(self, task: Task) -> LeasePolicy:
        policy = self._make_policy(task)
        if policy.heartbeat_timeout_capped and self._first("heartbeat_timeout"):
            log.warning("task type %s: heartbeat_timeout %gs is capped at the task's "
                        "responseTimeoutSeconds %gs: past it the server may give the task to "
                        "another worker", self._task_type, policy.heartbeat_timeout_seconds,
                        policy.response_timeout_seconds)
        if policy.kill_grace_capped and self._first("kill_grace"):
            log.warning("task type %s: kill_grace %gs is capped at %gs, at most a quarter of the task's "
                        "lease (responseTimeoutSeconds, or a shorter heartbeat_timeout or timeoutSeconds) "
                        "and no more than leaves its heartbeats room: the tree is TERMed kill_grace before "
                        "the deadline and must be dead by it", self._task_type, policy.kill_grace_seconds,
                        policy.effective_kill_grace_seconds)  # fmt: skip
        return policy

    def _first(self, what: str) -> bool:
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        return first


def plan_for(task: TaskSettings, *, check_queue_seconds: float = 0.0) -> TaskTypePlan:
    """What the runner needs for one ``[[task]]``. ``check_queue_seconds``: the most the runner's
    ownership-check budget holds a due check (``leasecore.checkbudget.max_queue_seconds``, #23)."""
    spec = CommandSpec(
        argv=tuple(task.command) if task.command is not None else None,
        shell=task.shell,
        cwd=task.cwd,
        env=dict(task.env),
        terminal_exit_codes=frozenset(task.terminal_exit_codes),
        in_progress_exit_code=task.in_progress_exit_code,
        callback_after_seconds=task.callback_after_seconds,
        exec_timeout_seconds=task.exec_timeout,
        kill_grace_seconds=task.kill_grace,
        secret_env_names=tuple(task.secrets),  # stripped from the child's environment
        protocol=task.protocol,
        run_as=run_as_for(task),
        limits=treegroups.limits_of(task),  # issue 19
    )
    make_policy: Callable[[Task], LeasePolicy] = WarnWhenCapped(task.type, functools.partial(
        LeasePolicy.from_task,
        heartbeat_timeout_seconds=task.heartbeat_timeout,
        lease_extend_enabled=task.lease_extend_enabled,
        kill_grace_seconds=task.kill_grace,
        exec_timeout_seconds=task.exec_timeout,
        ownership_check_interval_seconds=task.ownership_check_interval,
        first_attempt_spread=FIRST_ATTEMPT_SPREAD,
        check_queue_seconds=check_queue_seconds,
    ))
    poll = PollSettings(
        task_type=task.type,
        concurrency=task.concurrency,
        timeout_ms=task.poll_timeout,
        worker_id=task.worker_id,
        domain=task.domain,
        paused=task.paused,
        interval_seconds=task.poll_interval / 1000.0,
    )
    return TaskTypePlan(
        poll=poll,
        spec=spec,
        worker_id=task.worker_id,
        make_policy=make_policy,
        kill_grace_seconds=task.kill_grace,
    )


def run_as_for(task: TaskSettings) -> RunAs | None:
    """The user ``task``'s children run as: None without ``user``, or when this runner already is
    that user (not root: load_config refused any other user). ConfigError if it cannot be found."""
    if task.user is None or os.geteuid() != 0:
        return None
    try:
        return resolve_run_as(task.user, task.group)
    except RunAsError as exc:
        source = str(task.sources.get(exc.key))
        raise ConfigError(f"task {task.type!r}: {exc} (from {source})", key=exc.key, source=source) from None


def warn_if_root(config: ResolvedConfig) -> None:
    """One warning at start when the runner is root and some task's children would run as root too."""
    if os.geteuid() != 0:
        return
    as_root = [task.type for task in config.tasks if task.user is None]
    if as_root:
        log.warning("running as root with no user set: the children of %s run as root too, and root can "
                    "read this runner's memory (its credentials); set --user NAME or [worker] user",
                    ", ".join(as_root))


def options_for(config: ResolvedConfig) -> RunOptions:
    r = config.runner
    return RunOptions(
        once=r.once,
        max_tasks=r.max_tasks,
        drain=r.drain,
        drain_timeout_seconds=r.drain_timeout,
        once_wait_seconds=r.once_wait,
        update_v2=r.update_v2,
    )


def _to_result(task: Task, exit_: Any, spec: Any, worker_id: str, *, timed_out: bool = False) -> TaskResult:
    return to_task_result(task, exit_, spec, worker_id=worker_id, timed_out=timed_out)


def check_server(client: ConductorClient) -> None:
    """At start: the server answers, and accepts our credentials when we have some.

    ``/health`` needs no auth, so with credentials configured the token is fetched too: a refused
    key or secret is ``ConductorAuthError`` here (exit 4) instead of a poll loop that never works.
    (A server without a token endpoint, Conductor OSS, means "no auth": the credentials go unused.)
    """
    if not client.health(timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS):
        raise ConductorUnavailable("the server's health check failed")
    if client.auth is not None:
        client.auth.current(STARTUP_CHECK_TIMEOUT_SECONDS)


def run_worker(
    config: ResolvedConfig,
    *,
    environ: Mapping[str, str],
    on_snapshot: Callable[[RunnerSnapshot], None] | None = None,
) -> RunOutcome:
    """Check the server, sweep leftovers, deliver saved results, then serve until stopped.

    The sweep kills the trees of a runner that died with this state directory and saves a FAILED
    result for each task it held (``orphans``); the delivery of saved results then reports them,
    each only while the task is still ours, so the server retries them now, not after R.

    Signals are captured for the whole call, setup and cleanup included (``SignalRelay``): one that
    arrives during setup ends the run before any task is polled; during the run it goes to the runner
    (the second one forces); after it, cleanup (killing whatever the supervisor still holds) still
    runs to the end. The returned outcome carries the first signal, whenever it came.
    ``on_snapshot`` gets the runner's status snapshot in memory at every publish (a live view).
    """
    relay = SignalRelay()
    with capture_signals(relay):
        outcome = _serve(config, environ, relay, on_snapshot)
    if outcome.signum is None and relay.first is not None:
        outcome = dataclasses.replace(outcome, signum=relay.first)
    if outcome.refused is not None and outcome.signum is None:
        # The first polls were refused (no or wrong credentials, no permission): the same error, and
        # exit 4, as a refusal by the start-up check, never a quiet "no task" (everything is cleaned up).
        raise outcome.refused
    return outcome


def _serve(
    config: ResolvedConfig,
    environ: Mapping[str, str],
    relay: SignalRelay,
    on_snapshot: Callable[[RunnerSnapshot], None] | None,
) -> RunOutcome:
    server = config.server
    # Local things first (the config and the commands were checked by load_config): a bad state
    # directory is exit 3 whether or not the server is up, not exit 4 because it happens to be down.
    state = StateDir.for_run(config.runner.state_dir, environ)  # made and checked here, once
    setup = treegroups.setup_for(config)  # once; a forced mode that cannot work: exit 3
    client = ConductorClient(server.url, auth_key=server.auth_key, auth_secret=server.auth_secret,
                             auth_token=server.auth_token, ca_bundle=server.ca_bundle)  # fmt: skip
    metrics: MetricsService | None = None
    try:
        metrics = _start_metrics(config)  # a port that cannot be listened on is exit 3 too, server or not
        if metrics is not None:
            client.request_hook = metrics.observer.on_request
        try:
            with relay.interrupting():  # a silent server must not hold a stop for the check's timeout
                check_server(client)
        except StartupInterrupted as stop:
            return RunOutcome(signum=stop.signum)
        outbox = Outbox(state.outbox, server=server.url)
        treegroups.log_setup(config, setup)
        supervisor = Supervisor(state.path, tree_meta=tree_meta(server.url), cgroup_setup=setup)
        dirs = supervisor.task_dirs
        log.info("task files under %s%s", dirs.fast or dirs.disk,
                 f" (a tmpfs; under {dirs.disk} for a memory-limited task type, or when it is full)"
                 if dirs.fast else "")
        try:
            # Dead trees first, then their tasks into the outbox (and their runner's snapshot out),
            # then every saved result out: a retry must never start while its old tree may still run.
            supervisor.sweep_leftovers(lambda runner_pid, trees: take_over(state, runner_pid, trees))
            _deliver_saved(outbox, client, stop=lambda: relay.first is not None)
            runner = _make_runner(config, client, supervisor, outbox, state, on_snapshot, metrics,
                                  cgroup=setup.describe())
            relay.target = runner.handle_signal
            if relay.first is not None:  # stopped during setup: nothing was polled yet
                return RunOutcome(signum=relay.first)
            warn_if_root(config)
            redelivery = Redelivery(outbox, client)
            log.info("serving %s on %s as %s", ", ".join(t.type for t in config.tasks),
                     redact_url(server.url), config.tasks[0].worker_id)
            redelivery.start()
            try:
                return runner.run(install_signal_handlers=False)
            finally:
                if metrics is not None:
                    metrics.stopped()
                redelivery.stop()
                relay.target = None  # every child is dead and reported: later signals are recorded
        finally:
            supervisor.close()  # kills whatever it still holds (a task's leftover descendants)
    finally:
        client.close()
        if metrics is not None:
            metrics.close()


def _start_metrics(config: ResolvedConfig) -> MetricsService | None:
    """The metrics endpoint, listening, when ``metrics_port`` is set (else None, nothing imported)."""
    if config.runner.metrics_port is None:
        return None
    from leasecore.metrics.service import MetricsService

    metrics = MetricsService(config)
    metrics.start()
    return metrics


def _deliver_saved(
    outbox: Outbox, client: ConductorClient, *, stop: Callable[[], bool], quiet: bool = False
) -> None:
    report = outbox.deliver(
        lambda r: client.update(r, timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS), stop=stop,
        read_task=lambda task_id: client.get_task_ownership(task_id,
                                                            timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS),
        quiet=quiet,
    )
    if report.delivered or report.dropped:
        log.info("saved results: %d delivered, %d dropped, %d kept", report.delivered, report.dropped,
                 report.kept)


class Redelivery:
    """While the runner serves: results the reporter saved to the outbox (the server was unreachable
    past their retry time) are delivered as soon as it answers again, under the start's rules (each
    only while the task is still ours), instead of waiting for the next start, by which time the
    server may have retried the task and the finished work be done again."""

    def __init__(self, outbox: Outbox, client: ConductorClient, *, interval_seconds: float = 10.0) -> None:
        self._outbox = outbox
        self._client = client
        self._interval = interval_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-redelivery", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop looking; a delivery in progress ends after its current result (the rest waits)."""
        self._stop.set()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            if not self._outbox.any_saved():
                continue
            try:
                _deliver_saved(self._outbox, self._client, stop=self._stop.is_set, quiet=True)
            except Exception:  # a thread's top level: log it, look again later
                log.exception("delivering saved results failed; will try again")


def _make_runner(
    config: ResolvedConfig,
    client: ConductorClient,
    supervisor: Supervisor,
    outbox: Outbox,
    state: StateDir,
    on_snapshot: Callable[[RunnerSnapshot], None] | None,
    metrics: MetricsService | None = None,
    *,
    cgroup: str = "",
) -> Runner:
    # The most leases this runner holds at once: every slot, plus the results that may wait to be
    # delivered (max(concurrency, 8) per type), each with at most one ownership check queued.
    options = options_for(config)
    most_leases = sum(t.concurrency + max(t.concurrency, 8) for t in config.tasks)
    queue_seconds = max_queue_seconds(most_leases, config.runner.ownership_check_rate)
    plans = [plan_for(task, check_queue_seconds=queue_seconds) for task in config.tasks]
    publisher = StatePublisher.for_this_process(
        state,
        worker_id=plans[0].worker_id,
        server_url=config.server.url,
        task_types=[p.poll.task_type for p in plans],
        cgroup=cgroup,
    )
    status: StatusPort = publisher
    if on_snapshot is not None:
        status = StatusTee(publisher, publisher.runner_info, on_snapshot, clock=SystemClock())

    # Heartbeats and ownership checks count as server contact for `status`, like the runner's calls.
    contact = ServerContact()
    contact.answered()  # check_server just had its answer: ready from the start, not after a poll
    lease_calls = RecordedLeaseCalls(client, contact)
    observer: Observer = metrics.observer if metrics is not None else NO_METRICS
    engines: list[LeaseEngine] = []

    def make_engine(on_fence: Callable[[str, FenceAction], None]) -> LeaseEngine:
        # Ownership checks share one budget per runner (#23, leasecore.checkbudget).
        budget = CheckBudget(config.runner.ownership_check_rate)
        # Each lease's kill-by times go to its tree's dead-man's switch in the fork server.
        engines.append(LeaseEngine(lease_calls, on_fence, observer=observer, check_budget=budget,
                                   on_kill_by=supervisor.kill_by.renew))  # fmt: skip
        return engines[-1]

    def make_reporter(updates: UpdatePort, done: Callable[[ReportOutcome], None]) -> Reporter:
        # ``updates``: the runner's guarded update (no heartbeat overlaps or follows a final update)
        return Reporter(updates, done, outbox=outbox, observer=observer)

    runner = Runner(
        plans,
        conductor=client,
        make_engine=make_engine,
        supervisor=supervisor,
        to_result=_to_result,
        options=options,
        status=status,
        reporter=make_reporter,
        contact=contact,
        on_force=client.abort,
        metrics=observer,
    )
    if metrics is not None:
        metrics.attach(runner=runner, engine=engines[0], supervisor=supervisor, contact=contact,
                       outbox=outbox)
    return runner
