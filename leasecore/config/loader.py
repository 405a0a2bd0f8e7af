"""Configuration: the settings (defaults live here only), the pure merge with provenance, the file loader.

Precedence, highest first:
    command-line flag > task-specific env > global env > file [[task]] > file [worker] > default

``resolve`` is pure: the file's data, the environment and the flags are all passed in. Only the thin
helpers ``find_config_file`` / ``load_file`` / ``load_config`` touch the file system.

Task-specific env spellings, first match wins (the conductor-python order)::
    conductor.worker.<task>.<prop>  conductor_worker_<task>_<prop>
    CONDUCTOR_WORKER_<TASK>_<PROP>  CONDUCTOR_WORKER_<task as written>_<PROP>
Global env spellings, first match wins::
    conductor.worker.all.<prop>  conductor_worker_all_<prop>  CONDUCTOR_WORKER_ALL_<PROP>
An empty environment variable counts as unset.
"""

from __future__ import annotations

import os
import posixpath
import socket
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from leasecore.config.keys import KEYS, KeySpec, Source, check_value, invalid_value, keys_of
from leasecore.config.tomlfile import FileView, LoadedFile, parse_toml
from leasecore.errors import ConfigError

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_CONFIG_NAME",
    "OVERRIDE_KEYS",
    "LoadedFile",
    "ResolvedConfig",
    "RunnerSettings",
    "ServerSettings",
    "Source",
    "TaskSettings",
    "command_problems",
    "find_config_file",
    "load_config",
    "load_file",
    "parse_toml",
    "resolve",
]

CONFIG_ENV = "CONDUCTOR_RUN_CONFIG"
DEFAULT_CONFIG_NAME = "conductor.toml"
MAX_CONFIG_BYTES = 1024 * 1024  # a config file is a few KiB; anything this big is a mistake

# CLI overrides: key -> the setting it sets. None (or an empty list) means "flag not given".
OVERRIDE_KEYS: dict[str, str] = {
    "config": "",
    "server": "url",
    "task_type": "type",
    **{spec.name: spec.name for spec in KEYS.values() if spec.flag and spec.name not in ("url", "type")},
}


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
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class RunnerSettings:
    """Settings of the runner process as a whole (durations in seconds)."""

    state_dir: str | None = None  # None: statefile.default_state_dir(environ)
    log_format: str = "text"
    drain: bool = False
    drain_timeout: float = 60.0
    once: bool = False
    once_wait: float = 30.0  # --once: seconds to wait for a task (a cron slot's worth of patience)
    max_tasks: int | None = None  # None: no limit
    metrics_port: int | None = None  # #20: None = no metrics endpoint; 0 = any free port
    metrics_host: str = "127.0.0.1"  # #20
    cgroup: str = "auto"  # issue 19: auto | v2 | v1 | off (leasecore.process.cgroups)
    # --- issue #23: ownership checks' budget, shared by every task (leasecore.checkbudget) ---
    ownership_check_rate: float = 20.0  # checks per second per runner at most; 0: no budget
    # --- end #23 ---
    sources: Mapping[str, Source] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class TaskSettings:
    """Everything about serving one task type. Durations in seconds unless the name says ms."""

    type: str
    command: tuple[str, ...] | None = None  # one of command / shell after resolve (or none: config only)
    shell: str | None = None
    cwd: str = "."  # absolute after resolve
    env: Mapping[str, str] = field(default_factory=dict, repr=False)  # values may be credentials
    concurrency: int = 1
    worker_id: str = ""  # the hostname after resolve
    domain: str | None = None
    lease_extend_enabled: bool = True
    heartbeat_timeout: float | None = None  # None: the task's responseTimeoutSeconds
    kill_grace: float = 10.0
    exec_timeout: float = 0.0  # 0: no limit
    terminal_exit_codes: tuple[int, ...] = ()
    in_progress_exit_code: int | None = None
    callback_after_seconds: int = 60
    poll_timeout: int = 1000  # ms, long poll, <= 5000
    poll_interval: int = 100  # ms, pause after an empty poll
    paused: bool = False
    ownership_check_interval: float = 5.0
    secrets: tuple[str, ...] = ()
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


def _default_of(cls: type, name: str) -> Any:
    for item in fields(cls):
        if item.name == name:
            return item.default_factory() if callable(item.default_factory) else item.default
    raise KeyError(name)


# ---------------------------------------------------------------------------------------------------
# The thin I/O helpers.


def find_config_file(config_flag: str | None, environ: Mapping[str, str], cwd: str) -> str | None:
    """--config FILE, else $CONDUCTOR_RUN_CONFIG, else ./conductor.toml when present, else None.

    The path is returned as the user wrote it (relative paths are relative to ``cwd``).
    """
    for value, origin in ((config_flag, "--config"), (environ.get(CONFIG_ENV), f"${CONFIG_ENV}")):
        if value:
            full = posixpath.join(cwd, value)
            if os.path.isdir(full):
                problem = "is a directory, not a file"
            elif not os.path.exists(full):
                problem = "not found"
            else:
                return value  # a file (or something open() will explain, such as a FIFO or no access)
            raise ConfigError(f"config file {value} (from {origin}) {problem}", key="config", source=origin)
    return DEFAULT_CONFIG_NAME if os.path.isfile(posixpath.join(cwd, DEFAULT_CONFIG_NAME)) else None


def load_file(path: str, *, cwd: str = ".") -> LoadedFile:
    """Read and parse one config file (``path`` relative to ``cwd``); bad files raise ConfigError.

    Only a regular file of at most :data:`MAX_CONFIG_BYTES` is read: ``--config /dev/zero`` or a
    FIFO would otherwise hang or exhaust memory.
    """
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused just below.
        fd = os.open(posixpath.join(cwd, path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ConfigError(f"config file {path} is not a regular file", source=path)
            raw = handle.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes", source=path)
        text = raw.decode("utf-8-sig")  # a byte-order mark (some Windows editors) is not TOML
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read config file {path}: {reason}", source=path) from None
    return parse_toml(text, path)


def load_config(
    overrides: Mapping[str, Any],
    environ: Mapping[str, str],
    cwd: str,
    *,
    hostname: str | None = None,
    require_task: bool = True,
) -> ResolvedConfig:
    """What ``run`` and ``config`` call: find and load the file, then ``resolve``. Raises ConfigError."""
    path = find_config_file(overrides.get("config"), environ, cwd)
    loaded = load_file(path, cwd=cwd) if path else None
    config = resolve(
        loaded,
        environ,
        overrides,
        cwd=cwd,
        hostname=hostname or socket.gethostname(),
        require_task=require_task,
    )
    config = replace(config, server=_server_files(config.server))
    if loaded is not None:
        config = _config_file_mode(config, loaded, cwd)
    problems = {task.type: command_problems(task, environ) + run_as_problems(task) for task in config.tasks}
    fatal = [problem for task in config.tasks if not task.paused for problem in problems[task.type]]
    if fatal and require_task:
        # Caught here, not per task: a missing command or cwd would fail every task it polls.
        raise ConfigError(fatal[0], key="command")
    warnings = [problem for found in problems.values() for problem in found]  # a paused task's too
    warnings += [warning for task in config.tasks for warning in run_as_warnings(task)]
    return replace(config, warnings=(*config.warnings, *warnings)) if warnings else config


def _server_files(server: ServerSettings) -> ServerSettings:
    """The secret read from ``auth_secret_file``, and the CA bundle checked (#24; ConfigError)."""
    from leasecore.config import trust  # ssl: only when a file is named

    if server.ca_bundle is not None:
        trust.check_ca_bundle(server.ca_bundle, server.sources["ca_bundle"])
    if server.auth_secret_file is None:
        return server
    source = server.sources["auth_secret_file"]
    secret = trust.read_secret_file(server.auth_secret_file, source)
    return replace(server, auth_secret=secret, sources={**server.sources, "auth_secret": source})


def _config_file_mode(config: ResolvedConfig, loaded: LoadedFile, cwd: str) -> ResolvedConfig:
    """A config file holding a credential must be private where children run as another user (#24)."""
    from leasecore.config import trust
    server = loaded.data.get("server")
    if not isinstance(server, dict):
        return config
    task = next((task for task in config.tasks if task.user is not None), None)
    run_as = None
    if task is not None:
        run_as = (f"task {task.type!r} runs its children as user {task.user!r} "
                  f"(from {task.sources.get('user', DEFAULT)})")  # fmt: skip
    warning = trust.config_file_secrets(posixpath.join(cwd, loaded.path), server, run_as)
    return replace(config, warnings=(*config.warnings, warning)) if warning else config


def run_as_problems(task: TaskSettings) -> list[str]:
    """Why ``task``'s children cannot run as its ``user`` / ``group`` here (#24); [] when they can."""
    from leasecore.process.runas import resolve_run_as, switch_problem

    where = f"task {task.type!r}"
    if task.user is None:
        if task.group is None:
            return []
        return [f"{where}: group is set (from {task.sources.get('group', DEFAULT)}) without user: "
                "set user too (--user NAME), or drop group"]
    try:
        run_as = resolve_run_as(task.user, task.group)
    except ValueError as exc:  # "no such user 'x'" / "no such group 'x'"
        key = "group" if "group" in str(exc) else "user"
        allowed = "a user name or uid" if key == "user" else "a group name or gid"
        return [f"{where}: {exc} ({key} from {task.sources.get(key, DEFAULT)}): expected {allowed} "
                "known to this host"]
    problem = switch_problem(run_as)
    return [] if problem is None else [f"{where}: {problem} (user from {task.sources.get('user', DEFAULT)})"]


def run_as_warnings(task: TaskSettings) -> list[str]:
    """A ``user`` that its task's cwd or program keeps out, by the permission bits (a warning: ACLs
    may allow what the bits do not); [] when none, or when ``run_as_problems`` has found worse."""
    from leasecore.process.runas import access_problem, resolve_run_as

    if task.user is None or os.geteuid() != 0:
        return []
    try:
        run_as = resolve_run_as(task.user, task.group)
    except ValueError:
        return []
    problem = access_problem(run_as, task.cwd, task.command[0] if task.command else None)
    return [] if problem is None else [f"task {task.type!r}: {problem}: its tasks will fail to start"]


def command_problems(task: TaskSettings, environ: Mapping[str, str]) -> list[str]:
    """Why ``task``'s command cannot start here (none, missing cwd, program not found); [] when it can.

    Resolves the program the way the supervisor will: a name with a ``/`` relative to the task's
    cwd, else through the child's ``PATH`` (the ``env`` table's, else the runner's).
    """
    where = f"task {task.type!r}"
    if task.command is None and task.shell is None:  # only when resolved with require_task=False
        return [_no_command(task.type)]
    if not os.path.isdir(task.cwd):
        what = "is not a directory" if os.path.exists(task.cwd) else "does not exist"
        return [f"{where}: working directory {task.cwd} {what} (cwd from {task.sources.get('cwd', DEFAULT)})"]
    if task.command is None:
        return []
    program, source = task.command[0], task.sources.get("command", DEFAULT)
    if "/" in program:
        candidates = [posixpath.normpath(posixpath.join(task.cwd, program))]
    else:
        path_var = task.env.get("PATH") or environ.get("PATH") or os.defpath
        candidates = [posixpath.join(task.cwd, d or ".", program) for d in path_var.split(os.pathsep)]
    if any(os.path.isfile(c) and os.access(c, os.X_OK) for c in candidates):
        return []
    if "/" in program and os.path.isfile(candidates[0]):
        problem = f"{candidates[0]} is not executable (chmod +x, or run it through an interpreter)"
    elif "/" in program:
        problem = f"{candidates[0]} not found"
    else:
        problem = f"{program!r} not found in the child's PATH"
    return [f"{where}: cannot run the command: {problem} (command from {source})"]


def _no_command(task_type: str) -> str:
    return (f'task {task_type!r} has no command: set command = [...] or shell = "..." in its [[task]], '
            "or give one after -- or with --shell")


# ---------------------------------------------------------------------------------------------------
# The pure merge.


def resolve(
    loaded: LoadedFile | None,
    environ: Mapping[str, str],
    overrides: Mapping[str, Any],
    *,
    cwd: str,
    hostname: str,
    require_task: bool = True,
) -> ResolvedConfig:
    """Merge file, environment and flags (see the module docstring for the order). Raises ConfigError."""
    flags = _flag_values(overrides)
    file = FileView(loaded) if loaded else None
    warnings: list[str] = []
    server = _resolve_server(file, environ, flags, warnings, cwd)
    runner = _resolve_runner(file, environ, flags, cwd)
    tasks = _resolve_tasks(file, environ, flags, cwd=cwd, hostname=hostname, require_task=require_task)
    return ResolvedConfig(server, runner, tasks, loaded.path if loaded else None, tuple(warnings))


def _flag_values(overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(OVERRIDE_KEYS)
    if unknown:
        raise ValueError(f"unknown override keys: {sorted(unknown)}")  # a bug in the caller, not config
    given: dict[str, Any] = {}
    for name, value in overrides.items():
        if name == "config" or value is None or (isinstance(value, list | tuple) and not value):
            continue
        given[OVERRIDE_KEYS[name]] = list(value) if isinstance(value, tuple) else value
    return given


def _from_env(spec: KeySpec, text: str, source: Source) -> Any:
    try:
        return spec.check(spec.from_text(text))
    except ValueError as exc:
        raise invalid_value(spec, text, source, str(exc)) from None


def _fixed_env(spec: KeySpec, environ: Mapping[str, str]) -> tuple[Any, Source] | None:
    for name in spec.env:
        text = environ.get(name)
        if text:
            source = Source("env", f"env {name}")
            return _from_env(spec, text, source), source
    return None


def _flag(spec: KeySpec, flags: Mapping[str, Any]) -> tuple[Any, Source] | None:
    if spec.name not in flags:
        return None
    source = Source("flag", f"flag {spec.flag}")
    return check_value(spec, flags[spec.name], source), source


def _resolve_server(
    file: FileView | None, environ: Mapping[str, str], flags: Mapping[str, Any], warnings: list[str],
    cwd: str,
) -> ServerSettings:
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for spec in keys_of("server"):
        found = _flag(spec, flags) or _fixed_env(spec, environ) or _from_file(file, "server", -1, spec.name)
        if found:
            values[spec.name], sources[spec.name] = found
            if spec.sensitive and found[1].layer == "file":
                warnings.append(f"{spec.name} is in the config file ({found[1]}); prefer ${spec.env[0]}")
            if spec.name == "url" and found[1].layer == "file" and urlsplit(found[0]).password:
                warnings.append(
                    f"url holds a password in the config file ({found[1]}); prefer ${spec.env[0]}"
                )
        else:
            sources[spec.name] = DEFAULT
    for name in ("auth_secret_file", "ca_bundle"):  # paths: relative to the file that gave them
        if name in values:
            values[name] = _absolute_dir(values[name], sources[name], file, environ, cwd)
    if values.get("auth_secret") and values.get("auth_secret_file"):  # the value itself wins
        warnings.append(f"auth_secret (from {sources['auth_secret']}) is used; auth_secret_file (from "
                        f"{sources['auth_secret_file']}) is ignored: set only one")
        del values["auth_secret_file"]
        sources["auth_secret_file"] = DEFAULT
    # With a secret file, load_config reads the secret: the file stands for it here.
    secret_name = "auth_secret_file" if values.get("auth_secret_file") else "auth_secret"
    if bool(values.get("auth_key")) != bool(values.get(secret_name)):
        have, missing = ("auth_key", "auth_secret") if values.get("auth_key") else (secret_name, "auth_key")
        raise ConfigError(
            f"{have} is set (from {sources[have]}) but {missing} is not: set both "
            "(CONDUCTOR_AUTH_KEY and CONDUCTOR_AUTH_SECRET) or neither",
            key=missing,
            source=str(sources[have]),
        )
    if values.get("auth_token") and values.get("auth_key"):  # the key refreshes its token: it wins
        del values["auth_token"]
        warnings.append(
            f"auth_token (from {sources['auth_token']}) is not used: auth_key and auth_secret "
            f"(from {sources['auth_key']}) are set too, and their token is refreshed"
        )
        sources["auth_token"] = DEFAULT
    return ServerSettings(**values, sources=sources)


def _resolve_runner(
    file: FileView | None, environ: Mapping[str, str], flags: Mapping[str, Any], cwd: str
) -> RunnerSettings:
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for spec in keys_of("runner"):
        found = _flag(spec, flags) or _fixed_env(spec, environ) or _from_file(file, "worker", -1, spec.name)
        if found:
            values[spec.name], sources[spec.name] = found
        else:
            sources[spec.name] = DEFAULT
    if "state_dir" in values:
        values["state_dir"] = _absolute_dir(values["state_dir"], sources["state_dir"], file, environ, cwd)
    return RunnerSettings(**values, sources=sources)


def _absolute_dir(
    path: str, source: Source, file: FileView | None, environ: Mapping[str, str], cwd: str
) -> str:
    """``~`` expanded (a quoted ``"~/x"`` in TOML is not expanded by any shell), and relative paths
    made absolute: relative to the config file when the file gave them, else to ``cwd``."""
    home = environ.get("HOME")
    if home and (path == "~" or path.startswith("~/")):
        path = home + path[1:]
    base = posixpath.dirname(posixpath.join(cwd, file.path)) if file and source.layer == "file" else cwd
    return posixpath.normpath(posixpath.join(cwd, base, path))


def _resolve_tasks(
    file: FileView | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
    *,
    cwd: str,
    hostname: str,
    require_task: bool,
) -> tuple[TaskSettings, ...]:
    declared = file.task_types() if file else {}
    wanted = flags.get("type")
    if wanted is not None:
        check_value(KEYS["type"], wanted, Source("flag", "flag --task-type"))
        indexes: list[int | None] = [declared.get(wanted)]
    else:
        indexes = list(declared.values())
    if not indexes:
        if not require_task:
            return ()
        in_file = f" ({file.path} declares no [[task]])" if file else ""
        raise ConfigError(
            f"no task to run{in_file}: give --task-type NAME and a command (after -- or --shell), "
            "or a config file with [[task]] entries",
            key="type",
        )
    if len(indexes) > 1 and ("command" in flags or "shell" in flags):
        raise ConfigError(
            "a command on the command line needs --task-type when the config file declares several tasks",
            key="command",
            source="flag",
        )
    return tuple(
        _resolve_task(
            file, index, wanted, environ, flags, cwd=cwd, hostname=hostname, require_command=require_task
        )
        for index in indexes
    )


def _resolve_task(
    file: FileView | None,
    index: int | None,
    wanted: str | None,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
    *,
    cwd: str,
    hostname: str,
    require_command: bool,
) -> TaskSettings:
    if file is not None and index is not None:
        task_type, type_source = file.task_type(index), file.source("task", index, "type")
    else:
        task_type, type_source = str(wanted), Source("flag", "flag --task-type")
    values: dict[str, Any] = {"type": task_type}
    sources: dict[str, Source] = {"type": type_source}
    layers = _layers(file, index, task_type, environ, flags)
    for spec in keys_of("task"):
        if spec.name in ("type", "command", "shell", "env", "secrets"):
            continue
        found = next((hit for hit in (layer(spec) for layer in layers) if hit), None)
        values[spec.name], sources[spec.name] = found or (_default_of(TaskSettings, spec.name), DEFAULT)
    _resolve_command(file, index, task_type, flags, values, sources, required=require_command)
    _resolve_tables(file, index, values, sources)
    _resolve_paths(file, environ, cwd, hostname, values, sources)
    _cross_check(values, sources)
    return TaskSettings(**values, sources=sources)


_Layer = Callable[[KeySpec], tuple[Any, Source] | None]


def _layers(
    file: FileView | None,
    index: int | None,
    task_type: str,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> list[_Layer]:
    """The per-task layers, highest first."""
    return [
        lambda spec: _flag(spec, flags),
        lambda spec: _worker_env(
            spec, environ, _task_spellings(task_type, spec.worker_prop), "task-specific"
        ),
        lambda spec: _worker_env(spec, environ, _all_spellings(spec.worker_prop), "global"),
        lambda spec: _from_file(file, "task", index, spec.name),
        lambda spec: _from_file(file, "worker", -1, spec.name),
    ]


def _from_file(file: FileView | None, section: str, index: int | None, key: str) -> tuple[Any, Source] | None:
    if file is None or index is None:
        return None
    return file.get(section, index, key)


def _task_spellings(task: str, prop: str | None) -> list[str]:
    if prop is None:
        return []
    names = [
        f"conductor.worker.{task}.{prop}",
        f"conductor_worker_{task}_{prop}",
        f"CONDUCTOR_WORKER_{task.upper()}_{prop.upper()}",
        f"CONDUCTOR_WORKER_{task}_{prop.upper()}",
    ]
    return list(dict.fromkeys(names))


def _all_spellings(prop: str | None) -> list[str]:
    if prop is None:
        return []
    return [
        f"conductor.worker.all.{prop}",
        f"conductor_worker_all_{prop}",
        f"CONDUCTOR_WORKER_ALL_{prop.upper()}",
    ]


def _worker_env(
    spec: KeySpec, environ: Mapping[str, str], names: Sequence[str], level: str
) -> tuple[Any, Source] | None:
    present = [(name, environ[name]) for name in names if environ.get(name)]
    if not present:
        return None
    name, text = present[0]
    ignored = [other for other, other_text in present[1:] if other_text.strip() != text.strip()]
    where = f"env {name} ({level})"
    if ignored:
        where += f"; won over {', '.join(ignored)}"
    source = Source("env", where)
    return _from_env(spec, text, source), source


def _resolve_command(
    file: FileView | None,
    index: int | None,
    task_type: str,
    flags: Mapping[str, Any],
    values: dict[str, Any],
    sources: dict[str, Source],
    *,
    required: bool,
) -> None:
    """command / shell are one setting: the highest layer that gives either wins, and gives only one.

    Not ``required`` (``config``), a task may have neither: ``command_problems`` names that.
    """
    candidates: list[tuple[dict[str, tuple[Any, Source]], str]] = []
    flag_hits = {name: hit for name in ("command", "shell") if (hit := _flag(KEYS[name], flags))}
    candidates.append((flag_hits, "on the command line"))
    if file and index is not None:
        file_hits = {name: hit for name in ("command", "shell") if (hit := file.get("task", index, name))}
        candidates.append((file_hits, f"in [[task]] {task_type!r}"))
    for hits, where in candidates:
        if len(hits) == 2:
            raise ConfigError(
                f"task {task_type!r}: give command or shell {where}, not both",
                key="shell",
                source=str(hits["shell"][1]),
            )
        if hits:
            name, (value, source) = next(iter(hits.items()))
            values[name], sources["command"] = value, source
            return
    if file is not None and index is None:  # --task-type names a task the file does not declare
        declared = ", ".join(repr(name) for name in file.task_types()) or "none"
        raise ConfigError(
            f"task type {task_type!r} (from flag --task-type) is not declared in {file.path} "
            f"(its [[task]] types: {declared}); fix the name, or give a command after -- or with --shell",
            key="type",
            source="flag --task-type",
        )
    if not required:
        return
    raise ConfigError(
        _no_command(task_type),
        key="command",
        source=str(file.source("task", index, "type")) if file and index is not None else "flag --task-type",
    )


def _resolve_tables(
    file: FileView | None, index: int | None, values: dict[str, Any], sources: dict[str, Source]
) -> None:
    """env and secrets combine [worker] and [[task]]: a secret declared for all tasks stays secret."""
    worker_env = _from_file(file, "worker", -1, "env")
    task_env = _from_file(file, "task", index, "env")
    env: dict[str, str] = {**(worker_env[0] if worker_env else {}), **(task_env[0] if task_env else {})}
    values["env"] = env
    sources["env"] = _combined_source(worker_env, task_env)
    worker_secrets = _from_file(file, "worker", -1, "secrets")
    task_secrets = _from_file(file, "task", index, "secrets")
    names = [*(worker_secrets[0] if worker_secrets else ()), *(task_secrets[0] if task_secrets else ())]
    values["secrets"] = tuple(dict.fromkeys(names))
    sources["secrets"] = _combined_source(worker_secrets, task_secrets)


def _combined_source(low: tuple[Any, Source] | None, high: tuple[Any, Source] | None) -> Source:
    if low and high:
        return Source("file", f"{low[1]} + {high[1]}")
    hit = high or low
    return hit[1] if hit else DEFAULT


def _resolve_paths(
    file: FileView | None,
    environ: Mapping[str, str],
    cwd: str,
    hostname: str,
    values: dict[str, Any],
    sources: dict[str, Source],
) -> None:
    # A relative cwd in the file means relative to the file, so the file works from any directory.
    values["cwd"] = _absolute_dir(values["cwd"], sources["cwd"], file, environ, cwd)
    if not values["worker_id"]:
        values["worker_id"] = hostname
        sources["worker_id"] = Source("default", "default (hostname)")


def _cross_check(values: dict[str, Any], sources: dict[str, Source]) -> None:
    code = values["in_progress_exit_code"]
    if code is not None and code in values["terminal_exit_codes"]:
        raise ConfigError(
            f"in_progress_exit_code {code} (from {sources['in_progress_exit_code']}) is also in "
            f"terminal_exit_codes (from {sources['terminal_exit_codes']}): "
            "an exit code can mean only one thing",
            key="in_progress_exit_code",
            source=str(sources["in_progress_exit_code"]),
        )
