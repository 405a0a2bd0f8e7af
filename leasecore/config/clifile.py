"""conductor-cli's configuration, for ``conductor-run worker stdio``: its profiles, YAML files and order.

conductor-cli (``conductor config save``) keeps its settings in ``~/.conductor-cli/config.yaml`` (the
default profile) or ``~/.conductor-cli/config-<profile>.yaml``: a YAML mapping with the keys
``server``, ``server-type``, ``auth-key``, ``auth-secret`` and ``auth-token`` (it may hold others,
such as its token cache, which are ignored here). Its order, which :func:`resolve_cli` follows:

1. a flag (``--server``, ``--auth-key``, ...) beats everything;
2. below the flags exactly one source supplies the settings, never a blend: a *named file*
   (``--config FILE``, or a profile other than the default from ``--profile`` or
   ``$CONDUCTOR_PROFILE``), else the *environment* when any of its variables is set
   (``CONDUCTOR_SERVER_URL``, ``CONDUCTOR_AUTH_KEY``, ``CONDUCTOR_AUTH_SECRET``,
   ``CONDUCTOR_AUTH_TOKEN``, ``CONDUCTOR_SERVER_TYPE``), else the default ``config.yaml`` if there is one.

A named profile whose file does not exist is an error naming the file (as in conductor-cli); so is a
``--config`` file that does not exist (conductor-cli ignores it silently and starts against the
default server). A file that is not a YAML mapping of scalars is an error naming the file and the key.

Owns: reading those files (bounded, regular files only) and the order. Must not: know conductor-run's
own keys (the CLI maps these onto them, ``cli/workerstdio.py``). Threads: none.
"""

from __future__ import annotations

import os
import posixpath
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from leasecore.errors import ConfigError

DIR_NAME = ".conductor-cli"
DEFAULT_PROFILE = "default"  # an alias of config.yaml, as in conductor-cli
MAX_FILE_BYTES = 1024 * 1024
KEYS = ("server", "server-type", "auth-key", "auth-secret", "auth-token")
SECRET_KEYS = frozenset({"auth-key", "auth-secret", "auth-token"})
ENV_VARS: Mapping[str, str] = {
    "server": "CONDUCTOR_SERVER_URL",
    "server-type": "CONDUCTOR_SERVER_TYPE",
    "auth-key": "CONDUCTOR_AUTH_KEY",
    "auth-secret": "CONDUCTOR_AUTH_SECRET",
    "auth-token": "CONDUCTOR_AUTH_TOKEN",
}
PROFILE_ENV = "CONDUCTOR_PROFILE"


@dataclass(frozen=True)
class CliSettings:
    """conductor-cli's five settings as resolved, with where each came from (``sources[key]``:
    ``flag --server``, ``file /home/u/.conductor-cli/config-prod.yaml``, ``env CONDUCTOR_AUTH_KEY``).
    ``active``: ``"file"``, ``"env"`` or ``"none"``, the one source below the flags."""

    values: Mapping[str, str] = field(default_factory=dict, repr=False)
    sources: Mapping[str, str] = field(default_factory=dict)
    file: str | None = None
    active: str = "none"


def is_default(profile: str | None) -> bool:
    return not profile or profile == DEFAULT_PROFILE


def config_dir(environ: Mapping[str, str]) -> str:
    """``~/.conductor-cli`` (``$HOME`` first, as Go's ``os.UserHomeDir``)."""
    home = environ.get("HOME") or os.path.expanduser("~")
    return posixpath.join(home, DIR_NAME)


def profile_path(directory: str, profile: str | None) -> str:
    """``config.yaml`` for the default profile, ``config-<profile>.yaml`` for another, in ``directory``."""
    name = "config" if is_default(profile) else f"config-{profile}"
    return posixpath.join(directory, name + ".yaml")


def resolve_cli(
    flags: Mapping[str, str | None],
    *,
    profile: str | None,
    config_file: str | None,
    environ: Mapping[str, str],
    cwd: str,
) -> CliSettings:
    """The settings conductor-cli would use for this command line (see the module docstring).

    ``flags``: ``server``, ``auth-key``, ... as given on the command line (None: not given).
    Raises ConfigError for a missing named profile or file and for a file that cannot be used.
    """
    origin = "--profile" if profile else f"${PROFILE_ENV}"
    profile = profile or environ.get(PROFILE_ENV) or None
    if profile is not None and ("/" in profile or profile in (".", "..")):
        raise ConfigError(f"profile {profile!r} is not a profile name (it names the file "
                          "config-<profile>.yaml in ~/.conductor-cli)", key="profile")  # fmt: skip
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    path: str | None = None
    active = "none"
    if config_file:
        path = posixpath.join(cwd, config_file)
        if not os.path.exists(path):
            raise ConfigError(f"conductor-cli config file {config_file} (from --config) not found",
                              key="config", source="--config")  # fmt: skip
    elif not is_default(profile):
        path = profile_path(config_dir(environ), profile)
        if not os.path.exists(path):
            raise ConfigError(f"profile '{profile}' (from {origin}) doesn't exist (expected file: {path})",
                              key="profile", source=origin)  # fmt: skip
    elif any(environ.get(name) for name in ENV_VARS.values()):
        active = "env"
        for key, name in ENV_VARS.items():
            if environ.get(name):
                values[key], sources[key] = environ[name], f"env {name}"
    else:
        default = profile_path(config_dir(environ), None)
        path = default if os.path.exists(default) else None
    if path is not None:
        active = "file"
        for key, value in read_cli_file(path).items():
            values[key], sources[key] = value, f"file {path}"
    for key in KEYS:
        given = flags.get(key)
        if given:
            values[key], sources[key] = given, f"flag --{key}"
    return CliSettings(values=values, sources=sources, file=path, active=active)


def read_cli_file(path: str) -> dict[str, str]:
    """conductor-cli's settings in the YAML file ``path`` (the five keys, as text; others ignored)."""
    import yaml  # PyYAML: only a worker stdio with a conductor-cli file pays for it

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise ConfigError(f"conductor-cli config file {path} is not a regular file", source=path)
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"cannot read conductor-cli config file {path}: {exc.strerror}", source=path
        ) from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(
            f"conductor-cli config file {path} is larger than {MAX_FILE_BYTES} bytes", source=path
        )
    try:
        data = yaml.safe_load(raw.decode("utf-8-sig"))
    except UnicodeDecodeError:
        raise ConfigError(f"conductor-cli config file {path} is not UTF-8 text", source=path) from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"conductor-cli config file {path} is not valid YAML{where}: {problem}",
                          source=path) from None  # fmt: skip
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"conductor-cli config file {path} must hold a YAML mapping (server: ..., "
                          f"auth-key: ...), not {_kind(data)}", source=path)  # fmt: skip
    found: dict[str, str] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lower()  # viper's keys are case-insensitive
        if key not in KEYS or value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str | int | float):
            text = str(value)
        else:
            raise ConfigError(f"conductor-cli config file {path}: {key} must be a single value (text), "
                              f"not {_kind(value)}", key=key, source=path)  # fmt: skip
        if text:
            found[key] = text
    return found


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__
