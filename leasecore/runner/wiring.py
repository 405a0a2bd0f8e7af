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
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from leasecore.checkbudget import CheckBudget, max_queue_seconds
from leasecore.clock import SystemClock
from leasecore.conductor.client import ConductorClient
from leasecore.config.settings import ResolvedConfig
from leasecore.errors import ConductorError, ConductorUnavailable
from leasecore.lease import FenceAction
from leasecore.lease.finalcheck import LATE_BEAT_MARGIN_SECONDS
from leasecore.masking import mask_result
from leasecore.metrics import NO_METRICS, Observer
from leasecore.models import Task, TaskResult
from leasecore.process import Supervisor, to_task_result
from leasecore.runner import childenv, fdbudget, treegroups
from leasecore.runner.leasing.engine import LeaseEngine
from leasecore.runner.leasing.finalupdates import make_result_stick
from leasecore.runner.loop.runner import Runner
from leasecore.runner.loop.signals import SignalRelay, StartupInterrupted, capture_signals
from leasecore.runner.loop.status import StatusTee
from leasecore.runner.plans import Masking, Reloader, most_leases, options_for, plan_for
from leasecore.runner.ports import (
    LiveChange,
    RunOutcome,
    StatusPort,
    TaskTypePlan,
    UpdatePort,
)
from leasecore.runner.secretbook import installed
from leasecore.runner.upstream.reporter import Reporter, ReportOutcome
from leasecore.runner.upstream.server_contact import RecordedLeaseCalls, ServerContact
from leasecore.snapshot import RunnerSnapshot, redact_url
from leasecore.state.control import ControlServer
from leasecore.state.directory import StateDir
from leasecore.state.orphans import take_over, tree_meta
from leasecore.state.outbox import Outbox, OutboxEntry
from leasecore.state.statefile import StatePublisher

if TYPE_CHECKING:  # prometheus-client is imported only with metrics on (idle footprint)
    from leasecore.metrics.service import MetricsService
    from leasecore.process.spec import ChildExit, CommandSpec

log = logging.getLogger("conductor_run.worker")
_REQUEST_TIMEOUT_SECONDS = 10.0  # the client's (and a heartbeat's) longest attempt
_MAX_REPORT_SENDERS = 64  # the reporter's threads at most, whatever the concurrency

STARTUP_CHECK_TIMEOUT_SECONDS = 5.0


def warn_if_root(config: ResolvedConfig) -> None:
    """One warning at start when the runner is root and some task's children would run as root too."""
    if os.geteuid() != 0:
        return
    as_root = [task.type for task in config.tasks if task.user is None]
    if as_root:
        log.warning("running as root with no user set: the children of %s run as root too, and root can "
                    "read this runner's memory (its credentials); set --user NAME or [worker] user",
                    ", ".join(as_root))


def _to_result(
    task: Task, exit_: ChildExit, spec: CommandSpec, worker_id: str, *, timed_out: bool = False
) -> TaskResult:
    return to_task_result(task, exit_, spec, worker_id=worker_id, timed_out=timed_out)


def _echoing(echo: Callable[[Task, TaskResult], None]) -> Callable[..., TaskResult]:
    def to_result(
        task: Task, exit_: ChildExit, spec: CommandSpec, worker_id: str, *, timed_out: bool = False
    ) -> TaskResult:
        result = _to_result(task, exit_, spec, worker_id, timed_out=timed_out)
        masker = spec.masker  # what is printed is masked like what is sent
        try:
            if masker:
                echo(dataclasses.replace(task, raw=masker.mask_value(task.raw)), mask_result(masker, result))
            else:
                echo(task, result)
        except Exception:  # printing must never lose a result
            log.exception("task %s: echoing its result failed", task.task_id)
        return result

    return to_result


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
    load_again: Callable[[], ResolvedConfig] | None = None,
    on_reloaded: Callable[[ResolvedConfig], None] | None = None,
    echo_result: Callable[[Task, TaskResult], None] | None = None,
    mask_environ: Mapping[str, str] | None = None,
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
    ``load_again()``: the configuration loaded again the way ``config`` was (same flags and
    environment; ``ConfigError`` when it cannot be), for ``conductor-run reload`` and SIGHUP; None:
    a reload is refused. ``on_reloaded(config)`` once a reload is accepted (the CLI's logging).
    While the runner serves, its control socket (``leasecore.state.control``) is in the state dir.
    ``echo_result(task, result)``: called on the main thread with each result made from a child's
    exit (``worker stdio --verbose`` prints them).
    ``mask_environ``: the environment the configuration was resolved from, when it held more than
    ``environ`` (the secrets a re-exec handed over): its secret variables' values are masked too.
    """
    relay = SignalRelay()
    masking = Masking(config, {**environ, **(mask_environ or {})})
    with capture_signals(relay, on_reload=relay.reload), installed(masking.book):
        outcome = _serve(config, environ, relay, on_snapshot, load_again, on_reloaded, echo_result, masking)
    if outcome.signum is None and relay.first is not None:
        outcome = dataclasses.replace(outcome, signum=relay.first)
    if relay.count > 1 and not outcome.forced:  # the second signal came during setup or cleanup
        outcome = dataclasses.replace(outcome, forced=True)
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
    load_again: Callable[[], ResolvedConfig] | None = None,
    on_reloaded: Callable[[ResolvedConfig], None] | None = None,
    echo_result: Callable[[Task, TaskResult], None] | None = None,
    masking: Masking | None = None,
) -> RunOutcome:
    server = config.server
    # Local things first (the config and the commands were checked by load_config): a bad state
    # directory is exit 3 whether or not the server is up, not exit 4 because it happens to be down.
    state = StateDir.for_run(config.runner.state_dir, environ)  # made and checked here, once
    _raise_fd_limit(config)  # before the fork server starts: it (and every tree) inherits the limit
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
            observer = metrics.observer if metrics is not None else NO_METRICS
            _deliver_saved(outbox, client, stop=lambda: relay.first is not None, observer=observer)
            reloader = None if load_again is None else Reloader(config, load_again, metrics, on_reloaded,
                                                                  masking)
            runner = _make_runner(config, client, supervisor, outbox, state, on_snapshot, metrics,
                                  cgroup=setup.describe(), reload=reloader, echo_result=echo_result,
                                  masking=masking)
            relay.target = runner.handle_signal
            relay.reload_target = runner.handle_reload_signal
            if relay.first is not None:  # stopped during setup: nothing was polled yet
                return RunOutcome(signum=relay.first)
            warn_if_root(config)
            if (handing := childenv.warning_for(server)) is not None:
                log.warning("%s", handing)
            redelivery = Redelivery(outbox, client, observer=observer)
            control = _start_control(state, runner)
            log.info("serving %s on %s as %s", ", ".join(t.type for t in config.tasks),
                     redact_url(server.url), config.tasks[0].worker_id)
            redelivery.start()
            try:
                return runner.run(install_signal_handlers=False)
            finally:
                relay.reload_target = None
                if control is not None:
                    control.close()
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


def _raise_fd_limit(config: ResolvedConfig) -> None:
    needed = fdbudget.fds_needed([task.concurrency for task in config.tasks])
    raised = fdbudget.raise_soft_limit(needed)
    if raised.error is not None:
        log.warning("the open-file limit (RLIMIT_NOFILE) stays at %d: raising it to %d for the "
                    "concurrency asked was refused: %s", raised.before, raised.asked, raised.error)
    elif raised.after != raised.before:
        log.info("open-file limit (RLIMIT_NOFILE) raised from %d to %d (the hard limit is %d)",
                 raised.before, raised.after, raised.hard)


def fit_fd_limit(plans: list[TaskTypePlan]) -> list[TaskTypePlan]:
    """``plans`` with no more slots than the open-file limit holds (warned, once per start);
    ConfigError (exit 3) when it cannot hold one tree per task type."""
    fitted, warning = fdbudget.fit_plans(plans, fdbudget.current_limit())
    if warning is not None:
        log.warning("%s", warning)
    return fitted


def _start_control(state: StateDir, runner: Runner) -> ControlServer | None:
    """The runner's control socket, listening; None (logged) when it cannot be made: the runner
    serves all the same, it can only be stopped by a signal then."""
    control = ControlServer(state.path, runner.control)
    try:
        control.start()
    except OSError as exc:
        log.warning("no control socket (pause, resume, reload and drain will not reach this runner): "
                    "cannot listen on %s: %s", control.path, exc.strerror or exc)
        return None
    return control


def _start_metrics(config: ResolvedConfig) -> MetricsService | None:
    """The metrics endpoint, listening, when ``metrics_port`` is set (else None, nothing imported)."""
    if config.runner.metrics_port is None:
        return None
    from leasecore.metrics.service import MetricsService

    metrics = MetricsService(config)
    metrics.start()
    return metrics


def _deliver_saved(
    outbox: Outbox, client: ConductorClient, *, stop: Callable[[], bool], quiet: bool = False,
    observer: Observer = NO_METRICS,
) -> None:
    report = outbox.deliver(
        lambda r: client.update(r, timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS), stop=stop,
        read_task=lambda task_id: client.get_task_ownership(task_id,
                                                            timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS),
        quiet=quiet, delivered=lambda entry: _read_back_saved(entry, client, observer),
    )
    if report.delivered or report.dropped:
        log.info("saved results: %d delivered, %d dropped, %d kept", report.delivered, report.dropped,
                 report.kept)


def _read_back_saved(entry: OutboxEntry, client: ConductorClient, observer: Observer) -> None:
    """A saved result delivered while a heartbeat of its task may still reach the server (one in
    flight when it was saved: a request timeout + the margin after the save) is read back then, and
    sent again if undone (docs/final-results.md); later deliveries, the usual case, read nothing."""
    late_after_save = _REQUEST_TIMEOUT_SECONDS + LATE_BEAT_MARGIN_SECONDS
    left = entry.saved_at + late_after_save - time.time()
    if left <= 0:
        return

    def resend(result: TaskResult) -> bool:
        try:
            client.update(result, timeout_seconds=STARTUP_CHECK_TIMEOUT_SECONDS)
        except ConductorError as exc:
            log.warning("task %s: sending the saved result again failed: %s", result.task_id, exc)
            return False
        return True

    clock = SystemClock()
    make_result_stick(entry.result, read_at=clock.monotonic() + left, poll_count=entry.poll_count,
                      reader=client, resend=resend, clock=clock,
                      on_resent=lambda: observer.on_final_result_resent(""))


class Redelivery:
    """While the runner serves: results the reporter saved to the outbox (the server was unreachable
    past their retry time) are delivered as soon as it answers again, under the start's rules (each
    only while the task is still ours), instead of waiting for the next start, by which time the
    server may have retried the task and the finished work be done again."""

    def __init__(self, outbox: Outbox, client: ConductorClient, *, interval_seconds: float = 10.0,
                 observer: Observer = NO_METRICS) -> None:  # fmt: skip
        self._outbox = outbox
        self._client = client
        self._observer = observer
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
                _deliver_saved(self._outbox, self._client, stop=self._stop.is_set, quiet=True,
                               observer=self._observer)
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
    reload: Callable[[], LiveChange] | None = None,
    echo_result: Callable[[Task, TaskResult], None] | None = None,
    masking: Masking | None = None,
) -> Runner:
    options = options_for(config)
    queue_seconds = max_queue_seconds(most_leases(config), config.runner.ownership_check_rate)
    plans = [plan_for(task, check_queue_seconds=queue_seconds, server=config.server) for task in config.tasks]
    if masking is not None:
        plans = masking.plans(config, plans)
    plans = fit_fd_limit(plans)
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
        # Ownership checks share one budget per runner (leasecore.checkbudget).
        budget = CheckBudget(config.runner.ownership_check_rate)
        # Each lease's kill-by times go to its tree's dead-man's switch in the fork server.
        engines.append(LeaseEngine(lease_calls, on_fence, observer=observer, check_budget=budget,
                                   on_kill_by=supervisor.kill_by.renew))  # fmt: skip
        return engines[-1]

    def make_reporter(updates: UpdatePort, done: Callable[[ReportOutcome], None]) -> Reporter:
        # ``updates``: the runner's guarded update (no heartbeat overlaps or follows a final update)
        # One sender per running task (up to a bound): a result parked after a heartbeat of unknown
        # fate waits a moment on its sender (docs/final-results.md) and must not hold up the others'.
        senders = min(_MAX_REPORT_SENDERS, max(4, sum(plan.poll.concurrency for plan in plans)))
        return Reporter(updates, done, outbox=outbox, observer=observer, senders=senders)

    runner = Runner(
        plans,
        conductor=client,
        make_engine=make_engine,
        supervisor=supervisor,
        to_result=_to_result if echo_result is None else _echoing(echo_result),
        options=options,
        status=status,
        reporter=make_reporter,
        contact=contact,
        on_force=client.abort,
        metrics=observer,
        reload=reload,
        secrets=masking.book if masking is not None else None,
    )
    if metrics is not None:
        metrics.attach(runner=runner, engine=engines[0], supervisor=supervisor, contact=contact,
                       outbox=outbox)
    return runner


