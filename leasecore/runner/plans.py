"""What a runner needs from a resolved configuration, per task type, and again at a reload.

Owns: ``plan_for`` (a ``[[task]]`` as the runner's ``TaskTypePlan``: the command, its lease policy,
its polling, what the child is handed), ``options_for``, the exit-code policy's rules, the secret
values masked per task type (``Masking``), and ``Reloader`` (``conductor-run reload`` and SIGHUP:
the configuration loaded again, checked by ``config.live``, the plans built again). ``wiring``
builds the runner from these.

Must not: start anything, print, or exit. Threads: the CLI's main thread (``Reloader`` runs on the
runner's main loop); ``WarnWhenCapped`` on the pollers' threads.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from leasecore.checkbudget import max_queue_seconds
from leasecore.config.checks import exit_rule_of
from leasecore.config.settings import ResolvedConfig, ServerSettings, TaskSettings
from leasecore.errors import ConfigError
from leasecore.lease import LeasePolicy
from leasecore.masking import Masker
from leasecore.models import Task, TaskStatus
from leasecore.process import CommandSpec
from leasecore.process.spec import ExitRule
from leasecore.runner import childenv, fdbudget, treegroups
from leasecore.runner.ports import LiveChange, PollSettings, RunOptions, TaskTypePlan
from leasecore.runner.secretbook import SecretBook, static_values

if TYPE_CHECKING:  # prometheus-client is imported only with metrics on (idle footprint)
    from leasecore.metrics.service import MetricsService
    from leasecore.process.linux.runas import RunAs

log = logging.getLogger("conductor_run.worker")


# A lease's first heartbeat (and ownership check) is drawn uniformly over its interval: a batch of
# tasks polled together then beats at a steady rate, not in one burst at 0.8 R (as 1000 leases did).
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


def plan_for(
    task: TaskSettings, *, check_queue_seconds: float = 0.0, server: ServerSettings | None = None
) -> TaskTypePlan:
    """What the runner needs for one ``[[task]]``. ``check_queue_seconds``: the most the runner's
    ownership-check budget holds a due check (``leasecore.checkbudget.max_queue_seconds``).
    ``server``: what the child is told about the server (``childenv.handed_env``); None: nothing."""
    spec = CommandSpec(
        argv=tuple(task.command) if task.command is not None else None,
        shell=task.shell,
        cwd=task.cwd,
        env=dict(task.env),
        terminal_exit_codes=frozenset(task.terminal_exit_codes),
        in_progress_exit_code=task.in_progress_exit_code,
        callback_after_seconds=task.callback_after_seconds,
        exit_codes=exit_rules(task.exit_codes),
        exec_timeout_seconds=task.exec_timeout,
        kill_grace_seconds=task.kill_grace,
        secret_env_names=tuple(task.secrets),  # stripped from the child's environment
        protocol=task.protocol,
        run_as=run_as_for(task),
        limits=treegroups.limits_of(task),  # the task's resource limits
        handed_env=childenv.handed_env(server) if server is not None else {},
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
        required_metadata=tuple(task.required_secrets),
    )


def run_as_for(task: TaskSettings) -> RunAs | None:
    """The user ``task``'s children run as: None without ``user``, or when this runner already is
    that user (not root: load_config refused any other user). ConfigError if it cannot be found."""
    if task.user is None or os.geteuid() != 0:
        return None
    from leasecore.process.linux.runas import RunAsError, resolve_run_as  # only with a user: start-up CPU

    try:
        return resolve_run_as(task.user, task.group)
    except RunAsError as exc:
        source = str(task.sources.get(exc.key))
        raise ConfigError(f"task {task.type!r}: {exc} (from {source})", key=exc.key, source=source) from None


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


def with_masker(plan: TaskTypePlan, masker: Masker) -> TaskTypePlan:
    """``plan`` masking ``masker``'s values, its spec too: a task without runtime metadata then runs
    the plan's own spec object (the supervisor keeps its inherited environment per spec object)."""
    if not masker:
        return plan
    return dataclasses.replace(plan, masker=masker, spec=dataclasses.replace(plan.spec, masker=masker))


class Masking:
    """The secret values of a runner: the runner's own log's (``book``) and each task type's plans'.
    A reload builds the plans again with the values of the configuration it loaded."""

    def __init__(self, config: ResolvedConfig, environ: Mapping[str, str]) -> None:
        self._environ = environ
        values = secret_values(config, environ)
        self.book = SecretBook(value for per_type in values.values() for value in per_type)

    def plans(self, config: ResolvedConfig, plans: Iterable[TaskTypePlan]) -> list[TaskTypePlan]:
        values = secret_values(config, self._environ)
        return [with_masker(plan, Masker.of(values.get(plan.poll.task_type, ()))) for plan in plans]


def secret_values(config: ResolvedConfig, environ: Mapping[str, str]) -> dict[str, list[str]]:
    """Per task type, the values masked whatever the task (docs/secrets.md): the runner's
    credentials (key, secret, token, a password in the URL) and the values of the variables of
    ``environ`` and of the type's ``env`` table that are kept from its children."""
    server = config.server
    credentials = [server.auth_key, server.auth_secret, server.auth_token, urlsplit(server.url).password]
    return {task.type: static_values(environ, task.env, task.secrets, credentials) for task in config.tasks}


class Reloader:
    """``conductor-run reload`` and SIGHUP, the wiring's part: load the configuration again, refuse it
    whole (``ConfigError``: it does not load, or a restart-only value changed, ``config.live``), or
    build every task type's plan again and hand the runner a ``LiveChange``. Main thread."""

    def __init__(
        self, config: ResolvedConfig, load_again: Callable[[], ResolvedConfig],
        metrics: MetricsService | None, on_reloaded: Callable[[ResolvedConfig], None] | None,
        masking: Masking | None = None,
    ) -> None:
        self.config = config
        self._masking = masking
        self._load = load_again
        self._metrics = metrics
        self._on_reloaded = on_reloaded

    def __call__(self) -> LiveChange:
        from leasecore.config.live import reload_changes  # only a reload compares configs: start-up CPU

        new = self._load()
        changes = reload_changes(self.config, new)
        if not changes.accepted:
            raise ConfigError("; ".join(changes.refused))
        queue_seconds = max_queue_seconds(most_leases(new), new.runner.ownership_check_rate)
        plans = tuple(
            plan_for(task, check_queue_seconds=queue_seconds, server=new.server) for task in new.tasks
        )
        if self._masking is not None:
            plans = tuple(self._masking.plans(new, plans))
        # no more slots than the open-file limit holds (fdbudget), said in the reload's answer
        fitted, fd_warning = fdbudget.fit_plans(plans, fdbudget.current_limit())  # (ConfigError: refused)
        plans = tuple(fitted)
        if self._metrics is not None:
            self._metrics.reconfigure(new)  # a new port is listened on before anything changes
        old, self.config = self.config, new
        if self._on_reloaded is not None:
            self._on_reloaded(new)
        return LiveChange(plans, options_for(new), paused=changes.paused, changes=changes.changed,
                          warnings=tuple(w for w in new.warnings if w not in old.warnings)
                          + ((fd_warning,) if fd_warning is not None else ()))


def most_leases(config: ResolvedConfig) -> int:
    """The most leases a runner holds at once: every slot, plus the results that may wait to be
    delivered (max(concurrency, 8) per type), each with at most one ownership check queued."""
    return sum(t.concurrency + max(t.concurrency, 8) for t in config.tasks)


def exit_rules(policy: Mapping[str, str]) -> dict[int, ExitRule]:
    """The checked ``exit_codes`` setting ({"3": "IN_PROGRESS:30"}) as the spec's rules."""
    rules = {}
    for code, rule in policy.items():
        status, seconds = exit_rule_of(rule)
        rules[int(code)] = ExitRule(TaskStatus(status), seconds)
    return rules
