"""Every configuration option, declared once, on the field of the settings that holds it.

Owns: the frozen dataclasses ``ServerSettings``, ``RunnerSettings``, ``TaskSettings`` and
``ResolvedConfig``; each option is one field, declared with :func:`option`: its name (the field's,
which is the configuration key: ``conductor-run config`` prints them by these names, the contract of
DESIGN.md §6, so a unit that is not seconds is said in the declaration, not in the name), its type
(the annotation), its default, its checker, environment spellings, flag, help, where it may be set
(the class is its scope; ``file``/``worker``) and whether a reload may change it (``restart``). Also
``Source``, the provenance every value carries (``<settings>.sources[key]``: default | file | env |
flag, and exactly where).

Everything else is derived from these declarations: the key table (``config.keys``), the merge's
layers (``config.merge``), the refusals of a reload (``config.live``), the ``run`` flags (typer's,
``cli/runoptions.py``, and the lean path's, ``cli/fastrun.py``), ``--help``, ``init``'s starter file
and the configuration reference in docs/configuration.md (``cli/reference.py``).

Must not: read files or the environment, run checkers (``config.checks``; a declaration only names
its checker), merge layers (``config.merge``). Pure: values only.

Threads: none of its own; the values are immutable and shared freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from leasecore.config.checks import (
    MAX_SECONDS,
    Checker,
    argv,
    byte_size,
    check_bool,
    choice,
    cpu_count,
    env_names,
    env_table,
    exit_code_policy,
    exit_codes,
    int_range,
    ip_literal,
    metadata_names,
    nonempty_str,
    optional_str,
    rate_per_second,
    seconds,
    server_url,
)

__all__ = [
    "DEFAULT",
    "OPTION",
    "STATE_DIR_DEFAULT",
    "ResolvedConfig",
    "RunnerSettings",
    "ServerSettings",
    "Source",
    "TaskSettings",
    "default_of",
    "option",
]

OPTION = "option"  # the key of a field's metadata that holds its declaration

# leasecore.state.statefile.default_state_dir when state_dir is unset
STATE_DIR_DEFAULT = "$XDG_RUNTIME_DIR/conductor-run, else ~/.local/state/conductor-run"
_CREDENTIALS = "credentials are read once, at start"
_BUDGET = "the task budget is fixed at start"
_RUN_AS = "the runner's user switching is checked at start"


def option(
    default: Any = MISSING,
    *,
    check: Checker,
    help: str,
    factory: Any = MISSING,
    repr: bool = True,
    **declared: Any,
) -> Any:
    """One option: a dataclass field whose metadata holds the rest of its declaration.

    ``declared`` takes the :class:`~leasecore.config.checks.KeySpec` fields (``env``, ``worker_prop``,
    ``flag``, ``metavar``, ``kind``, ``unit``, ``unset``, ``example``, ``doc``, ``restart``, ``path``,
    ``combined``...) and ``file``/``worker`` (may the file set it; may ``[worker]``); name,
    scope and default come from the field itself (``config.keys``).
    """
    metadata = {OPTION: {"check": check, "help": help, **declared}}
    if factory is not MISSING:
        return field(default_factory=factory, repr=repr, metadata=metadata)
    return field(default=default, repr=repr, metadata=metadata)


@dataclass(frozen=True, eq=False)
class Source:
    """Where one value came from: ``layer`` is default | file | env | flag; ``where`` says exactly."""

    layer: str
    where: str = ""

    def __str__(self) -> str:
        return self.where or self.layer


DEFAULT = Source("default")


@dataclass(frozen=True, eq=False)
class ServerSettings:
    """How to reach the Conductor server: ``[server]``. Every key is read once, at start."""

    url: str = option(
        "http://localhost:8080/api", check=server_url,
        help="Conductor API base URL (/api is appended when missing)",
        env=("CONDUCTOR_SERVER_URL",), flag="--server", dest="server", metavar="URL",
        restart="the server's address is fixed for the runner's connections and leases",
    )
    auth_key: str | None = option(
        None, check=nonempty_str, help="key id for token auth; prefer the environment",
        env=("CONDUCTOR_AUTH_KEY",), sensitive=True, repr=False, unset="no auth", example="<key id>",
        doc="With `auth_secret`: both or neither.", restart=_CREDENTIALS,
    )
    auth_secret: str | None = option(
        None, check=nonempty_str, help="key secret; prefer the environment",
        env=("CONDUCTOR_AUTH_SECRET",), sensitive=True, repr=False, unset="no auth", example="<key secret>",
        doc="In the file, `auth_secret` (also `auth_token`, a password in `url`) needs the file private "
        "(0600) when a `user` is set: exit 3 otherwise, a warning without one "
        "([Security notes](security.md#security-notes)).",
        restart=_CREDENTIALS,
    )
    auth_token: str | None = option(
        None, check=nonempty_str,
        help="a ready-made token sent as X-Authorization (conductor-cli's; instead of key and secret, "
        "never refreshed); prefer the environment",
        env=("CONDUCTOR_AUTH_TOKEN",), sensitive=True, repr=False, unset="no auth", example="<token>",
        doc="Unused, with a warning, when `auth_key`/`auth_secret` are set.", restart=_CREDENTIALS,
    )
    # absolute after resolve; load_config reads the file into auth_secret
    auth_secret_file: str | None = option(
        None, check=nonempty_str,
        help="file holding the key secret (mode 0600 or stricter: systemd/Kubernetes credentials)",
        env=("CONDUCTOR_AUTH_SECRET_FILE",), unset="none",
        example="/run/credentials/conductor-run.service/conductor-secret", path=True,
        doc="Mode 0600 or 0400 (group- or world-accessible is refused); surrounding whitespace is dropped; "
        "`auth_secret` wins when both are set, with a warning.",
        restart=_CREDENTIALS,
    )
    ca_bundle: str | None = option(  # absolute after resolve; None: certifi's CAs
        None, check=nonempty_str, help="PEM file of the CA certificates to trust for https:// (a private CA)",
        # the Python ssl module's variable, then requests', then curl's
        env=("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"), flag="--ca-bundle", metavar="FILE",
        unset="certifi's CA bundle", example="/etc/ssl/private-ca.pem", path=True,
        doc="A file (or directory) of CAs; missing or unreadable: exit 3.",
        restart="the TLS trust is set up once, at start",
    )
    pass_credentials: bool = option(  # read by leasecore.runner.childenv
        False, check=check_bool,
        help="hand the runner's credentials to every child (CONDUCTOR_AUTH_*, CONDUCTOR_ACCESS_KEY_*) so it "
        "can call back into Conductor; off: no child sees them",
        env=("CONDUCTOR_RUN_PASS_CREDENTIALS",), flag="--pass-credentials",
        doc="On: a warning at start ([worker stdio](worker-stdio.md)); `CONDUCTOR_SERVER_URL` is set "
        "either way.",
        restart="it is read once, at start",
    )
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, eq=False)
class RunnerSettings:
    """Settings of the runner process as a whole: ``[worker]`` (durations in seconds)."""

    state_dir: str | None = option(  # None: state.directory.default_state_dir(environ)
        None, check=nonempty_str, help="directory of the status snapshots read by `conductor-run status`",
        env=("CONDUCTOR_RUN_STATE_DIR",), flag="--state-dir", metavar="DIR", unset=STATE_DIR_DEFAULT,
        example="/run/user/1000/conductor-run", path=True,
        restart="the state directory holds this runner's records, outbox and control socket",
    )
    log_format: str = option(
        "text", check=choice("text", "json"), help="log lines as text or json",
        env=("CONDUCTOR_RUN_LOG_FORMAT",), flag="--log-format", metavar="text|json",
    )
    log_level: str = option(  # applied by the CLI (cli/run.py), at start and by every reload
        "info", check=choice("debug", "info", "warning", "error"),
        help="the least severe log lines shown: debug, info, warning or error",
        env=("CONDUCTOR_RUN_LOG_LEVEL",), flag="--log-level", metavar="debug|info|warning|error",
        doc="`info`: a line as each task starts and ends; `warning`: only what went wrong or needs "
        "a look; `debug` adds each result's delivery and every HTTP call (a line per poll). A reload "
        "changes it at once ([Reload](operating.md#reload)).",
    )
    drain: bool = option(
        False, check=check_bool, help="on the first signal, let running children finish",
        env=("CONDUCTOR_RUN_DRAIN",), flag="--drain",
    )
    drain_timeout: float = option(
        60.0, check=seconds(), help="seconds to wait for children when draining",
        env=("CONDUCTOR_RUN_DRAIN_TIMEOUT",), flag="--drain-timeout", metavar="SECONDS", unit="s",
    )
    once: bool = option(
        False, check=check_bool, help="run one task, then exit", flag="--once", file=False,
        flag_help="run one task, then exit (exit 6 when none came within --once-wait)", restart=_BUDGET,
    )
    once_wait: float = option(  # a cron slot's worth of patience
        30.0, check=seconds(positive=True), help="--once: seconds to wait for a task before exiting 6",
        flag="--once-wait", metavar="SECONDS", unit="s", file=False, restart=_BUDGET,
    )
    max_tasks: int | None = option(
        None, check=int_range(1), help="exit after this many tasks (exit 5 when any of them failed)",
        flag="--max-tasks", metavar="N", unset="no limit", file=False, restart=_BUDGET,
    )
    metrics_port: int | None = option(  # None: no metrics endpoint
        None, check=int_range(0, 65535, "a TCP port"),
        help="serve /metrics, /healthz and /readyz on this port (0: any free port, logged)",
        env=("CONDUCTOR_RUN_METRICS_PORT",), flag="--metrics-port", metavar="PORT", unset="off", example=9464,
        doc="[Metrics and health](metrics.md). A reload may move it, not turn it on or off.",
    )
    metrics_host: str = option(
        "127.0.0.1", check=ip_literal, help="the address the metrics endpoint listens on",
        env=("CONDUCTOR_RUN_METRICS_HOST",), flag="--metrics-host", metavar="ADDR", doc="An IP address.",
    )
    metrics_task_type_label: str = option(
        "taskType", check=choice("taskType", "task_type"),
        help="the metrics' label name for the task type: taskType (the Conductor SDKs' name, which their "
        "dashboards query) or task_type (snake_case: promtool check metrics finds nothing)",
        env=("CONDUCTOR_RUN_METRICS_TASK_TYPE_LABEL",), flag="--metrics-task-type-label",
        metavar="taskType|task_type", restart="the metrics' label names are fixed when they are registered",
    )
    cgroup: str = option(  # leasecore.process.linux.cgroups
        "auto", check=choice("auto", "v2", "v1", "off"),
        help="task trees in cgroups: auto (v2 if it can limit, else v1, else none), v2, v1 or off",
        env=("CONDUCTOR_RUN_CGROUP",), flag="--cgroup", metavar="auto|v2|v1|off",
        restart="the cgroup mechanism is detected once, at start",
    )
    ownership_check_rate: float = option(  # the shared budget: leasecore.checkbudget
        20.0, check=rate_per_second,
        help="ownership checks per second at most, shared by every task of the runner (0: no limit); each "
        "task is checked every max(ownership_check_interval, tasks / rate) s",
        env=("CONDUCTOR_RUN_OWNERSHIP_CHECK_RATE",), unit="checks/s",
        restart="the ownership-check budget is made once, at start",
    )
    update_v2: bool = option(  # leasecore.runner.chain
        True, check=check_bool,
        help="report final results with update-v2 when the server has it, claiming each next task in the "
        "same call (false: v1 POST /api/tasks only, a poll per task)",
        env=("CONDUCTOR_RUN_UPDATE_V2",),
        doc="[How](leases.md#claiming-the-next-task-with-the-report-update-v2).",
        restart="update chaining is chosen once, at start",
    )
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, eq=False)
class TaskSettings:
    """Everything about serving one task type: ``[[task]]``, most keys with a default for every task in
    ``[worker]``. Durations in seconds, except the two polling ones in milliseconds (``poll_timeout``,
    ``poll_interval``: the SDKs' units, kept by their key names)."""

    type: str = option(
        check=nonempty_str, help="the Conductor task type to poll", flag="--task-type", dest="task_type",
        metavar="NAME", worker=False, unset="",
        flag_help="the task type to poll (with a config file: only this [[task]] runs)",
        doc="Required.",
    )
    command: tuple[str, ...] | None = option(  # one of command / shell after resolve (or none: config only)
        None, check=argv, help="argv to run (no shell); exactly one of command / shell", flag="--",
        metavar="-- CMD [ARGS]", worker=False, unset="",
    )
    shell: str | None = option(
        None, check=nonempty_str, help="a string run with /bin/sh -c; task input never enters it",
        flag="--shell", metavar="COMMAND", worker=False, unset="",
        flag_help="run this string with /bin/sh -c instead of -- CMD [ARGS] (task input never enters it)",
    )
    cwd: str = option(  # absolute after resolve
        ".", check=nonempty_str, help="working directory (relative: to the config file's directory)",
        path=True, doc="Default: the directory conductor-run is started in.",
    )
    env: Mapping[str, str] = option(  # values may be credentials
        check=env_table, help="extra environment variables for the child ([worker] + [[task]])",
        factory=dict, repr=False, example={"LANG": "C.UTF-8"}, combined=True,
    )
    concurrency: int = option(
        1, check=int_range(1, 1000), help="children run at once (SDK: thread_count)",
        worker_prop="thread_count", aliases=("thread_count",), flag="--concurrency", metavar="N",
        doc="A finished child's slot is free while its result is sent, but no more tasks are claimed while "
        "max(`concurrency`, 8) results wait to be delivered.",
    )
    worker_id: str = option(  # the hostname after resolve
        "", check=nonempty_str, help="worker id reported to the server", worker_prop="worker_id",
        flag="--worker-id", metavar="NAME", unset="the hostname", example="worker-1",
        restart="the runner's identity (status, fleet, the server's poll data) is fixed at start",
    )
    domain: str | None = option(
        None, check=optional_str, help="task domain to poll (empty: none)", worker_prop="domain",
        flag="--domain", metavar="NAME", unset="none", example="",
    )
    lease_extend_enabled: bool = option(
        True, check=check_bool, help="send extendLease heartbeats", worker_prop="lease_extend_enabled",
        flag="--lease-extend/--no-lease-extend",
    )
    heartbeat_timeout: float | None = option(
        None, check=seconds(positive=True),
        help="seconds without an acknowledged heartbeat before the child is killed",
        worker_prop="heartbeat_timeout", flag="--heartbeat-timeout", metavar="SECONDS", unit="s",
        unset="the task's responseTimeoutSeconds", example=60.0,
        doc="Can only shorten the lease: a value above the task's responseTimeoutSeconds is capped at it, "
        "with one warning per task type.",
    )
    kill_grace: float = option(
        10.0, check=seconds(),
        help="seconds between SIGTERM and SIGKILL (capped at a quarter of each task's lease)",
        worker_prop="kill_grace", flag="--kill-grace", metavar="SECONDS", unit="s",
        doc="The lease: responseTimeoutSeconds, or a shorter `heartbeat_timeout` or timeoutSeconds; capped "
        "with one warning per task type ([the lease's timings](leases.md#the-leases-timings)).",
    )
    exec_timeout: float = option(
        0.0, check=seconds(), help="kill the child after this many seconds (0: never)",
        worker_prop="exec_timeout", flag="--exec-timeout", metavar="SECONDS", unit="s", zero="none",
    )
    terminal_exit_codes: tuple[int, ...] = option(
        (), check=exit_codes, help="exit codes reported FAILED_WITH_TERMINAL_ERROR",
        flag="--terminal-exit-code", metavar="CODE", kind="ints", example=[2],
        flag_help="an exit code reported FAILED_WITH_TERMINAL_ERROR (repeatable; 1..255)",
    )
    in_progress_exit_code: int | None = option(
        None, check=int_range(1, 255, "an exit code"),
        help="exit code that hands the task back as IN_PROGRESS, to be polled again later",
        unset="none", example=75,
    )
    callback_after_seconds: int = option(
        60, check=int_range(0, MAX_SECONDS, "whole seconds"),
        help="with in_progress_exit_code: when the server hands the task out again", unit="s",
    )
    # the exit-code policy; terminal_exit_codes / in_progress_exit_code are its shorthands
    exit_codes: Mapping[str, str] = option(  # "code" -> "STATUS[:SECONDS]"
        check=exit_code_policy, factory=dict,
        help="exit-code policy: CODE = STATUS[:SECONDS] (COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR, "
        "IN_PROGRESS with its callbackAfterSeconds)",
        flag="--exit-code", metavar="CODE=STATUS[:SECONDS]", kind="strs",
        example={"3": "FAILED_WITH_TERMINAL_ERROR", "75": "IN_PROGRESS:30"},
        flag_help="map an exit code to COMPLETED, FAILED, FAILED_WITH_TERMINAL_ERROR or "
        "IN_PROGRESS[:callbackAfterSeconds] (repeatable; 1..255)",
        doc="[Long jobs](long-jobs.md).",
    )
    poll_timeout: int = option(
        1000, check=int_range(0, 5000, "milliseconds"), help="long-poll wait in ms (<= 5000)",
        worker_prop="poll_timeout", flag="--poll-timeout", metavar="MS", unit="ms",
    )
    poll_interval: int = option(
        100, check=int_range(0, MAX_SECONDS * 1000, "milliseconds"), help="pause in ms after an empty poll",
        worker_prop="poll_interval", unit="ms",
    )
    paused: bool = option(
        False, check=check_bool, help="do not poll this task (SDK pause switch)", worker_prop="paused",
        doc="A runner whose every type is paused idles until stopped (with `--once`: exit 6 after "
        "`--once-wait`).",
    )
    ownership_check_interval: float = option(
        5.0, check=seconds(positive=True), help="seconds between GET /api/tasks/{id} ownership checks",
        unit="s",
        doc="With many tasks the runner's `ownership_check_rate` stretches it "
        "([the budget](leases.md#ownership-checks-per-runner-a-shared-budget)); a short R shortens it "
        "to fit the ownership window (a task whose checks all fail is fenced R after its last "
        "confirmed one, so a re-delivered task waits R, + twice the budget's longest hold, for its "
        "previous holder).",
    )
    secrets: tuple[str, ...] = option(
        (), check=env_names,
        help="names of runner environment variables never passed to the child ([worker] + [[task]])",
        example=["DATABASE_PASSWORD"], doc="Glob patterns such as `AWS_*` too.", combined=True,
        restart="secrets are removed from the runner's own environment at start",
    )
    required_secrets: tuple[str, ...] = option(
        (), check=metadata_names,
        help="runtime metadata names every task must carry resolved (else FAILED_WITH_TERMINAL_ERROR, the "
        "command not run), on top of those its task definition declares",
        example=["STRIPE_API_KEY"], doc="[Secrets](secrets.md).",
    )
    protocol: str = option(
        "native", check=choice("native", "stdio"),
        help="the child's contract: native (input on stdin, exit code, output file) or stdio "
        "(conductor-cli worker stdio: the task on stdin, one JSON result on stdout)",
        worker_prop="protocol", flag="--protocol", metavar="native|stdio",
        doc="[The child's interface](child-interface.md).",
    )
    user: str | None = option(
        None, check=nonempty_str, help="run each child as this user (name or uid; the runner must be root)",
        flag="--user", metavar="NAME", unset="the runner's own; as root, a warning", example="nobody",
        doc="With its groups. An unknown name, or a uid above "
        "4294967294, is exit 3; not root: exit 3 (unless it names the runner's own user and group).",
        restart=_RUN_AS,
    )
    group: str | None = option(
        None, check=nonempty_str,
        help="with user: run each child with this group (name or gid) instead of the user's own",
        flag="--group", metavar="NAME", unset="the user's primary group", example="nogroup", restart=_RUN_AS,
    )
    # per-tree limits (None: none): bytes, processes, cores, open files
    memory_max: int | None = option(
        None, check=byte_size,
        help="memory limit of the task's tree (64M, 2G; per process where no cgroup can enforce it)",
        worker_prop="memory_max", flag="--memory-max", metavar="SIZE", kind="str", unset="no limit",
        example="2G", doc="`64M`, `512K`, `2G`, `1.5G` (powers of 1024) or bytes.",
    )
    pids_max: int | None = option(
        None, check=int_range(1, 4_194_304), help="most processes the task's tree may hold at once",
        worker_prop="pids_max", flag="--pids-max", metavar="N", unset="no limit", example=512,
    )
    cpu_max: float | None = option(
        None, check=cpu_count,
        help="CPU cores the task's tree may use (0.5, 2; needs a cgroup cpu controller)",
        worker_prop="cpu_max", flag="--cpu-max", metavar="CORES", kind="str", unset="no limit", example=2,
    )
    nofile: int | None = option(
        None, check=int_range(1, 1 << 30), help="open files per process of the task's tree (RLIMIT_NOFILE)",
        worker_prop="nofile", flag="--nofile", metavar="N", unset="inherited", example=4096,
    )
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True, eq=False)
class ResolvedConfig:
    """The merge's result: every value plus where it came from (``<settings>.sources[key]``)."""

    server: ServerSettings
    runner: RunnerSettings
    tasks: tuple[TaskSettings, ...]
    config_file: str | None = None
    warnings: tuple[str, ...] = ()


def default_of(cls: type, name: str) -> Any:
    """The default of field ``name`` of the settings class ``cls`` (KeyError: no such field)."""
    for item in fields(cls):
        if item.name == name:
            return item.default_factory() if callable(item.default_factory) else item.default
    raise KeyError(name)
