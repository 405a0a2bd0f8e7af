"""The pure merge: file, environment and flags into one ``ResolvedConfig``, a source on every value.

Owns: the precedence (:data:`PRECEDENCE`, as data: the one place that says which layer wins), the
layers that answer "value and source of key K" (:func:`_layers`), the environment's spellings, and
the checks that need several values at once (key and secret together, command or shell, an exit code
that means two things). Highest first::

    command-line flag > task-specific env > global env > file [[task]] > file [worker] > default

Task-specific env spellings, first match wins (the conductor-python order)::
    conductor.worker.<task>.<prop>  conductor_worker_<task>_<prop>
    CONDUCTOR_WORKER_<TASK>_<PROP>  CONDUCTOR_WORKER_<task as written>_<PROP>
Global env spellings, first match wins::
    conductor.worker.all.<prop>  conductor_worker_all_<prop>  CONDUCTOR_WORKER_ALL_<PROP>
An empty environment variable counts as unset.

Must not: touch the file system or the process (``config.loader`` does; the file's text, the
environment and the flags are all passed in). Threads: none; pure functions.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from leasecore.config.checks import check_value, invalid_value
from leasecore.config.keys import KEYS, KeySpec, keys_of
from leasecore.config.settings import (
    DEFAULT,
    ResolvedConfig,
    RunnerSettings,
    ServerSettings,
    Source,
    TaskSettings,
    default_of,
)
from leasecore.errors import ConfigError

if TYPE_CHECKING:  # the TOML side loads with a config file (start-up CPU)
    from leasecore.config.tomlfile import FileView, LoadedFile

__all__ = ["OVERRIDE_KEYS", "PRECEDENCE", "no_command", "resolve"]

# CLI overrides: override name -> the setting it sets (a key's ``dest``: ``--server`` sets url).
# None (or an empty list) means "flag not given"; ``config`` names the file, no setting.
OVERRIDE_KEYS: dict[str, str] = {
    "config": "",
    **{spec.override: spec.name for spec in KEYS.values() if spec.flag},
}

# The layers of each scope, highest first; a key none of them gives keeps its default (the settings
# dataclass's). ``env``: the key's fixed variables (``KeySpec.env``); ``task env`` / ``global env``:
# the SDK spellings of its ``worker_prop``, for this task type / for all.
PRECEDENCE: Mapping[str, tuple[str, ...]] = {
    "server": ("flag", "env", "file [server]"),
    "runner": ("flag", "env", "file [worker]"),
    "task": ("flag", "task env", "global env", "file [[task]]", "file [worker]"),
}

Hit = tuple[Any, Source]  # a value and where it came from


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
    file: FileView | None = None
    if loaded:
        from leasecore.config.tomlfile import FileView

        file = FileView(loaded)
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


def _fixed_env(spec: KeySpec, environ: Mapping[str, str]) -> Hit | None:
    for name in spec.env:
        text = environ.get(name)
        if text:
            source = Source("env", f"env {name}")
            return _from_env(spec, text, source), source
    return None


def _flag(spec: KeySpec, flags: Mapping[str, Any]) -> Hit | None:
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
    layers = _layers("server", file, None, "", environ, flags)
    for spec in keys_of("server"):
        found = _first_hit(layers, spec)
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
    _absolute_paths("server", values, sources, file, environ, cwd)
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
    layers = _layers("runner", file, None, "", environ, flags)
    for spec in keys_of("runner"):
        found = _first_hit(layers, spec)
        if found:
            values[spec.name], sources[spec.name] = found
        else:
            sources[spec.name] = DEFAULT
    _absolute_paths("runner", values, sources, file, environ, cwd)
    return RunnerSettings(**values, sources=sources)


def _absolute_paths(
    scope: str, values: dict[str, Any], sources: Mapping[str, Source], file: FileView | None,
    environ: Mapping[str, str], cwd: str,
) -> None:
    """The keys of ``scope`` declared ``path``, made absolute (:func:`_absolute_dir`) where set."""
    for spec in keys_of(scope):
        if spec.path and spec.name in values:
            values[spec.name] = _absolute_dir(values[spec.name], sources[spec.name], file, environ, cwd)


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
    layers = _layers("task", file, index, task_type, environ, flags)
    for spec in keys_of("task"):
        if spec.name in ("type", "command", "shell") or spec.combined:
            continue
        found = _first_hit(layers, spec)
        values[spec.name], sources[spec.name] = found or (default_of(TaskSettings, spec.name), DEFAULT)
    _resolve_command(file, index, task_type, flags, values, sources, required=require_command)
    _resolve_tables(file, index, values, sources)
    _resolve_paths(file, environ, cwd, hostname, values, sources)
    _cross_check(values, sources)
    return TaskSettings(**values, sources=sources)


_Layer = Callable[[KeySpec], Hit | None]


def _layers(
    scope: str,
    file: FileView | None,
    index: int | None,
    task_type: str,
    environ: Mapping[str, str],
    flags: Mapping[str, Any],
) -> list[_Layer]:
    """The layers of ``scope`` in :data:`PRECEDENCE`'s order, highest first (``index``, ``task_type``:
    the ``[[task]]`` for the task scope)."""
    by_name: dict[str, _Layer] = {
        "flag": lambda spec: _flag(spec, flags),
        "env": lambda spec: _fixed_env(spec, environ),
        "task env": lambda spec: _worker_env(
            spec, environ, _task_spellings(task_type, spec.worker_prop), "task-specific"
        ),
        "global env": lambda spec: _worker_env(spec, environ, _all_spellings(spec.worker_prop), "global"),
        "file [server]": lambda spec: _from_file(file, "server", -1, spec.name),
        "file [worker]": lambda spec: _from_file(file, "worker", -1, spec.name),
        "file [[task]]": lambda spec: _from_file(file, "task", index, spec.name),
    }
    return [by_name[name] for name in PRECEDENCE[scope]]


def _first_hit(layers: Sequence[_Layer], spec: KeySpec) -> Hit | None:
    """The highest layer's value of ``spec`` and its source; None: no layer gives it (the default)."""
    return next((hit for hit in (layer(spec) for layer in layers) if hit), None)


def _from_file(file: FileView | None, section: str, index: int | None, key: str) -> Hit | None:
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
) -> Hit | None:
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
        no_command(task_type),
        key="command",
        source=str(file.source("task", index, "type")) if file and index is not None else "flag --task-type",
    )


def _resolve_tables(
    file: FileView | None, index: int | None, values: dict[str, Any], sources: dict[str, Source]
) -> None:
    """The keys declared ``combined`` (env, secrets) take [worker]'s and [[task]]'s values together: a
    table's entries, [[task]]'s winning a name both set; a list's items, each once (a secret declared
    for all tasks stays secret)."""
    for spec in keys_of("task"):
        if not spec.combined:
            continue
        low = _from_file(file, "worker", -1, spec.name)
        high = _from_file(file, "task", index, spec.name)
        if isinstance(spec.default, dict):
            values[spec.name] = {**(low[0] if low else {}), **(high[0] if high else {})}
        else:
            values[spec.name] = tuple(dict.fromkeys([*(low[0] if low else ()), *(high[0] if high else ())]))
        sources[spec.name] = _combined_source(low, high)


def _combined_source(low: Hit | None, high: Hit | None) -> Source:
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
    _absolute_paths("task", values, sources, file, environ, cwd)
    if not values["worker_id"]:
        values["worker_id"] = hostname
        sources["worker_id"] = Source("default", "default (hostname)")


def _cross_check(values: dict[str, Any], sources: dict[str, Source]) -> None:
    _check_policy(values, sources)
    code = values["in_progress_exit_code"]
    if code is not None and code in values["terminal_exit_codes"]:
        raise ConfigError(
            f"in_progress_exit_code {code} (from {sources['in_progress_exit_code']}) is also in "
            f"terminal_exit_codes (from {sources['terminal_exit_codes']}): "
            "an exit code can mean only one thing",
            key="in_progress_exit_code",
            source=str(sources["in_progress_exit_code"]),
        )


def _check_policy(values: dict[str, Any], sources: dict[str, Source]) -> None:
    """``exit_codes`` and its shorthands must agree: a code each maps differently names both."""
    for code_text, rule in values["exit_codes"].items():
        code, status = int(code_text), rule.partition(":")[0]
        if code in values["terminal_exit_codes"] and status != "FAILED_WITH_TERMINAL_ERROR":
            other = "terminal_exit_codes", "FAILED_WITH_TERMINAL_ERROR"
        elif code == values["in_progress_exit_code"] and status != "IN_PROGRESS":
            other = "in_progress_exit_code", "IN_PROGRESS"
        else:
            continue
        raise ConfigError(
            f"exit_codes maps exit code {code} to {rule} (from {sources['exit_codes']}), but {other[0]} "
            f"(from {sources[other[0]]}) makes it {other[1]}: an exit code can mean only one thing",
            key="exit_codes",
            source=str(sources["exit_codes"]),
        )


def no_command(task_type: str) -> str:
    """The message for a task with neither command nor shell (the loader's too)."""
    return (f'task {task_type!r} has no command: set command = [...] or shell = "..." in its [[task]], '
            "or give one after -- or with --shell")
