"""The one configuration loader that does I/O: find the file, read it, merge, check what is on disk.

Owns: where the config file is looked for (``--config``, ``$CONDUCTOR_RUN_CONFIG``, ./conductor.toml),
reading it (a regular file of at most :data:`MAX_CONFIG_BYTES`), and the checks that need this host
once the pure merge (``config.merge.resolve``) has answered: the key secret's file and the CA bundle
(``config.trust``), the config file's mode, a command that cannot start, a ``user`` that cannot be
switched to. ``load_config`` is what ``run`` and ``config`` call; every problem is a ``ConfigError``
naming the key, its source and what is allowed (exit 3), or a warning on the result.

The names of the whole package are re-exported here (settings, ``resolve``, ``parse_toml``), so a
caller that loads a configuration needs one import.

Must not: decide precedence or check values itself (``config.merge``, ``config.checks``), talk to the
server, start anything. Threads: the caller's (the CLI's main thread), once per run.
"""

from __future__ import annotations

import os
import posixpath
import socket
import stat
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from leasecore.config.merge import OVERRIDE_KEYS, no_command, resolve
from leasecore.config.settings import (
    DEFAULT,
    ResolvedConfig,
    RunnerSettings,
    ServerSettings,
    Source,
    TaskSettings,
)
from leasecore.errors import ConfigError

if TYPE_CHECKING:
    from leasecore.config.tomlfile import LoadedFile, parse_toml

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


def __getattr__(name: str) -> Any:
    """``LoadedFile`` and ``parse_toml``: the TOML side loads with the first config file (start-up CPU)."""
    if name in ("LoadedFile", "parse_toml"):
        from leasecore.config import tomlfile

        return getattr(tomlfile, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
MAX_CONFIG_BYTES = 1024 * 1024  # a config file is a few KiB; anything this big is a mistake



def find_config_file(config_flag: str | None, environ: Mapping[str, str], cwd: str) -> str | None:
    """--config FILE, else $CONDUCTOR_RUN_CONFIG, else ./conductor.toml when present, else None.

    The path is returned as the user wrote it (relative paths are relative to ``cwd``).
    """
    for value, origin in ((config_flag, "--config"), (environ.get(CONFIG_ENV), f"${CONFIG_ENV}")):
        if value:
            full = posixpath.join(cwd, value)
            unreachable = _unreachable(full)  # below a directory this user may not enter: not "not found"
            if unreachable is not None:
                problem = f"cannot be looked at: {unreachable}"
            elif os.path.isdir(full):
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
    from leasecore.config.tomlfile import parse_toml

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
    """The secret read from ``auth_secret_file``, and the CA bundle checked (ConfigError)."""
    from leasecore.config import trust  # ssl: only when a file is named

    if server.ca_bundle is not None:
        trust.check_ca_bundle(server.ca_bundle, server.sources["ca_bundle"])
    if server.auth_secret_file is None:
        return server
    source = server.sources["auth_secret_file"]
    secret = trust.read_secret_file(server.auth_secret_file, source)
    return replace(server, auth_secret=secret, sources={**server.sources, "auth_secret": source})


def _config_file_mode(config: ResolvedConfig, loaded: LoadedFile, cwd: str) -> ResolvedConfig:
    """A config file holding a credential must be private where children run as another user."""
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
    """Why ``task``'s children cannot run as its ``user`` / ``group`` here; [] when they can."""
    where = f"task {task.type!r}"
    if task.user is None:
        if task.group is None:
            return []
        return [f"{where}: group is set (from {task.sources.get('group', DEFAULT)}) without user: "
                "set user too (--user NAME), or drop group"]
    from leasecore.process.linux.runas import RunAsError, resolve_run_as, switch_problem  # (with a user only)

    try:
        run_as = resolve_run_as(task.user, task.group)
    except RunAsError as exc:  # "no such user 'x'" / "no such group 'x'" / "gid N is out of range ..."
        key = exc.key
        allowed = "a user name or uid" if key == "user" else "a group name or gid"
        return [f"{where}: {exc} ({key} from {task.sources.get(key, DEFAULT)}): expected {allowed} "
                "known to this host"]
    problem = switch_problem(run_as)
    if problem is None:
        return []
    key = "group" if run_as.uid == os.geteuid() else "user"  # its own user: only the group is a switch
    return [f"{where}: {problem} ({key} from {task.sources.get(key, DEFAULT)})"]


def run_as_warnings(task: TaskSettings) -> list[str]:
    """A ``user`` that its task's cwd or program keeps out, by the permission bits (a warning: ACLs
    may allow what the bits do not); [] when none, or when ``run_as_problems`` has found worse."""
    if task.user is None or os.geteuid() != 0:
        return []
    from leasecore.process.linux.runas import access_problem, resolve_run_as  # (with a user only)

    try:
        run_as = resolve_run_as(task.user, task.group)
    except ValueError:
        return []
    problem = access_problem(run_as, task.cwd, task.command[0] if task.command else None)
    return [] if problem is None else [f"task {task.type!r}: {problem}: its tasks will fail to start"]


def _unreachable(path: str) -> str | None:
    """Why ``path`` cannot be looked at (a directory on the way this user may not enter), None when it
    can or simply does not exist."""
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def command_problems(task: TaskSettings, environ: Mapping[str, str]) -> list[str]:
    """Why ``task``'s command cannot start here (none, missing cwd, program not found); [] when it can.

    Resolves the program the way the supervisor will: a name with a ``/`` relative to the task's
    cwd, else through the child's ``PATH`` (the ``env`` table's, else the runner's).
    """
    where = f"task {task.type!r}"
    if task.command is None and task.shell is None:  # only when resolved with require_task=False
        return [no_command(task.type)]
    key = "command" if task.command is not None else "shell"
    if any("\0" in arg for arg in (task.command or [task.shell or ""])):  # exec cannot carry one
        return [f"{where}: {key} holds a NUL byte, which no argument can carry "
                f"({key} from {task.sources.get('command', DEFAULT)})"]  # (command's source is shell's too)
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
    elif "/" in program and os.path.isdir(candidates[0]):
        problem = f"{candidates[0]} is a directory, not a program"
    elif "/" in program and (why := _unreachable(candidates[0])):
        problem = f"{candidates[0]} cannot be looked at: {why}"
    elif "/" in program:
        problem = f"{candidates[0]} not found"
    else:
        problem = f"{program!r} not found in the child's PATH"
    return [f"{where}: cannot run the command: {problem} (command from {source})"]
