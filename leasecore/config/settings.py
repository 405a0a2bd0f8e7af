"""The settings a resolved configuration holds, their defaults, and where each value came from.

Owns: the frozen dataclasses ``ServerSettings``, ``RunnerSettings``, ``TaskSettings`` and
``ResolvedConfig`` (the defaults live here and nowhere else), and ``Source``, the provenance every
value carries (``<settings>.sources[key]``: default | file | env | flag, and exactly where).
A field is named as its configuration key (``leasecore.config.keys``): ``conductor-run config``
prints them by these names, which are the contract of DESIGN.md §6, so a unit that is not seconds
is said in the field's comment, not in its name (``poll_timeout``: ms).

Must not: read files or the environment, check values (``config.checks``), merge layers
(``config.merge``). Pure: values only.

Threads: none of its own; the values are immutable and shared freely.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "DEFAULT",
    "ResolvedConfig",
    "RunnerSettings",
    "ServerSettings",
    "Source",
    "TaskSettings",
    "default_of",
]


@dataclass(frozen=True)
class Source:
    """Where one value came from: ``layer`` is default | file | env | flag; ``where`` says exactly."""

    layer: str
    where: str = ""

    def __str__(self) -> str:
        return self.where or self.layer


DEFAULT = Source("default")


@dataclass(frozen=True)
class ServerSettings:
    """How to reach the Conductor server."""

    url: str = "http://localhost:8080/api"
    auth_key: str | None = field(default=None, repr=False)
    auth_secret: str | None = field(default=None, repr=False)
    auth_token: str | None = field(default=None, repr=False)  # conductor-cli's CONDUCTOR_AUTH_TOKEN
    auth_secret_file: str | None = None  # absolute; load_config reads it into auth_secret (#24)
    ca_bundle: str | None = None  # absolute; None: the system's/certifi's CAs (#24)
    pass_credentials: bool = False  # hand the credentials to children (leasecore.runner.childenv)
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class RunnerSettings:
    """Settings of the runner process as a whole (durations in seconds)."""

    state_dir: str | None = None  # None: state.directory.default_state_dir(environ)
    log_format: str = "text"
    drain: bool = False
    drain_timeout: float = 60.0  # seconds
    once: bool = False
    once_wait: float = 30.0  # --once: seconds to wait for a task (a cron slot's worth of patience)
    max_tasks: int | None = None  # None: no limit
    metrics_port: int | None = None  # #20: None = no metrics endpoint; 0 = any free port
    metrics_host: str = "127.0.0.1"  # #20
    # --- #20: the metrics' task type label: "taskType" (the SDKs') or "task_type" (promtool-clean) ---
    metrics_task_type_label: str = "taskType"
    # --- end #20 label ---
    cgroup: str = "auto"  # issue 19: auto | v2 | v1 | off (leasecore.process.cgroups)
    # --- issue #23: ownership checks' budget, shared by every task (leasecore.checkbudget) ---
    ownership_check_rate: float = 20.0  # checks per second per runner at most; 0: no budget
    update_v2: bool = True  # final updates may claim the next task (leasecore.runner.chain)
    # --- end #23 ---
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class TaskSettings:
    """Everything about serving one task type. Durations in seconds, except the two polling ones in
    milliseconds (``poll_timeout``, ``poll_interval``: the SDKs' units, kept by their key names)."""

    type: str
    command: tuple[str, ...] | None = None  # one of command / shell after resolve (or none: config only)
    shell: str | None = None
    cwd: str = "."  # absolute after resolve
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # values may be credentials
    concurrency: int = 1
    worker_id: str = ""  # the hostname after resolve
    domain: str | None = None
    lease_extend_enabled: bool = True
    heartbeat_timeout: float | None = None  # seconds; None: the task's responseTimeoutSeconds
    kill_grace: float = 10.0  # seconds
    exec_timeout: float = 0.0  # seconds; 0: no limit
    terminal_exit_codes: tuple[int, ...] = ()
    in_progress_exit_code: int | None = None
    callback_after_seconds: int = 60
    exit_codes: Mapping[str, str] = field(default_factory=dict)  # "code" -> "STATUS[:SECONDS]" (policy)
    poll_timeout: int = 1000  # ms, long poll, <= 5000
    poll_interval: int = 100  # ms, pause after an empty poll
    paused: bool = False
    ownership_check_interval: float = 5.0  # seconds
    secrets: tuple[str, ...] = ()
    required_secrets: tuple[str, ...] = ()  # runtime metadata names every task must carry (docs/secrets.md)
    protocol: str = "native"  # "stdio": conductor-cli's worker stdio contract (issue #21)
    user: str | None = None  # run the child as this user (#24; the runner must be root)
    group: str | None = None  # ... with this group instead of the user's primary one
    # issue 19: per-tree limits (None: none); bytes, processes, cores, open files
    memory_max: int | None = None
    pids_max: int | None = None
    cpu_max: float | None = None
    nofile: int | None = None
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
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
