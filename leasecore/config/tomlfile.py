"""The config file: parse TOML text, remember each key's line, validate the file as a whole.

Owns: :func:`parse_toml` (a syntax error is a ``ConfigError`` naming file and line), the line map
(``tomllib`` does not report positions, so a small scanner walks the accepted text once more and
remembers, for every key of ``[server]``, ``[worker]`` and each ``[[task]]``, the line it was first
written on; it only runs on text ``tomllib`` accepted, so it can be lenient) and :class:`FileView`,
which checks every section, key and value (unknown keys with a hint, a key given twice under two
spellings, a task type declared twice) and answers "value and source of key K in [[task]] i".

Must not: read the file (``config.loader.load_file`` does), merge layers (``config.merge``). Pure.
Threads: none; the caller's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from leasecore.config.checks import check_value
from leasecore.config.keys import ALIASES, KEYS, keys_of
from leasecore.config.settings import Source
from leasecore.errors import ConfigError

# (section, task index or -1, key) -> 1-based line. Section "" is the top level; key "" is the header.
LineMap = dict[tuple[str, int, str], int]

_KEY = re.compile(r"""\s*(?:"((?:[^"\\]|\\.)*)"|'([^']*)'|([A-Za-z0-9_-]+))\s*[.=]""")


@dataclass(frozen=True)
class LoadedFile:
    """A parsed config file: its path, its data and where each key was written."""

    path: str
    data: dict[str, Any]
    lines: LineMap = field(default_factory=dict)

    def line_of(self, section: str, index: int, key: str) -> int | None:
        """The line ``key`` was written on, else the section's header line, else None."""
        return self.lines.get((section, index, key), self.lines.get((section, index, "")))


def parse_toml(text: str, path: str) -> LoadedFile:
    """Parse TOML text; a syntax error becomes a ConfigError naming the file and line."""
    import tomllib  # here: a runner started without a config file never loads the parser

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}", source=path) from None
    return LoadedFile(path=path, data=data, lines=_scan(text))


def _scan(text: str) -> LineMap:
    lines: LineMap = {}
    section: tuple[str, int] | None = ("", -1)  # None: inside a sub-table whose keys we don't track
    task_count = 0
    open_string: str | None = None
    depth = 0
    for lineno, line in enumerate(text.splitlines(), 1):
        if open_string or depth:
            open_string, depth = _skip_value(line, open_string, depth)
            continue
        stripped = line.strip()
        if stripped.startswith("[["):
            name = stripped[2:].split("]]", 1)[0].strip()
            if name == "task":
                section = ("task", task_count)
                task_count += 1
            else:
                section = (name, -1)
            lines.setdefault((*section, ""), lineno)
        elif stripped.startswith("["):
            parts = [part.strip().strip("\"'") for part in stripped[1:].split("]", 1)[0].split(".")]
            index = task_count - 1 if parts[0] == "task" else -1
            if len(parts) > 1:  # [worker.env] / [task.env]: the key is "env"; its own keys are not ours
                lines.setdefault((parts[0], index, parts[1]), lineno)
                section = None
            else:
                section = (parts[0], index)
                lines.setdefault((*section, ""), lineno)
                lines.setdefault(("", -1, parts[0]), lineno)
        elif stripped and not stripped.startswith("#"):
            match = _KEY.match(line)
            if match is None:
                continue
            key = next(group for group in match.groups() if group is not None)
            if section is not None:
                lines.setdefault((*section, key), lineno)
            open_string, depth = _skip_value(line[line.find("=", match.start()) + 1 :], None, 0)
    return lines


def _skip_value(text: str, open_string: str | None, depth: int) -> tuple[str | None, int]:
    """Walk one line of a value; return what is still open at its end (multi-line string, brackets)."""
    i = 0
    while i < len(text):
        if open_string:
            end = text.find(open_string, i)
            if end < 0:
                return open_string, depth
            i = end + len(open_string)
            open_string = None
            continue
        char = text[i]
        if text.startswith('"""', i) or text.startswith("'''", i):
            open_string = text[i : i + 3]
            i += 3
            continue
        if char == '"':
            i = _end_of_basic_string(text, i + 1)
        elif char == "'":
            end = text.find("'", i + 1)
            i = len(text) if end < 0 else end + 1
        elif char in "[{":
            depth += 1
            i += 1
        elif char in "]}":
            depth = max(0, depth - 1)
            i += 1
        elif char == "#":
            break
        else:
            i += 1
    return open_string, depth


def _end_of_basic_string(text: str, i: int) -> int:
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return i


class FileView:
    """A loaded file validated as a whole (a broken file is an error even where a flag overrides it)."""

    def __init__(self, loaded: LoadedFile) -> None:
        self.path = loaded.path
        self._loaded = loaded
        self._values: dict[tuple[str, int, str], tuple[Any, Source]] = {}
        self._types: dict[str, int] = {}
        self._validate(loaded.data)

    def get(self, section: str, index: int | None, key: str) -> tuple[Any, Source] | None:
        return self._values.get((section, -1 if index is None else index, key))

    def task_types(self) -> dict[str, int]:
        return dict(self._types)

    def task_type(self, index: int) -> str:
        return next(name for name, position in self._types.items() if position == index)

    def source(self, section: str, index: int, key: str) -> Source:
        line = self._loaded.line_of(section, index, key)
        where = f"{self.path}:{line}" if line else self.path
        if section == "task":
            task_type = next((name for name, pos in self._types.items() if pos == index), None)
            label = f"[[task]] {task_type!r}" if task_type else f"[[task]] #{index + 1}"
        else:
            label = f"[{section}]"
        return Source("file", f"{where} {label}")

    def _validate(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            if name not in ("server", "worker", "task"):
                self._unknown("", -1, name, ["server", "worker", "task"])
            elif name == "task":
                self._validate_tasks(value)
            else:
                if not isinstance(value, dict):
                    raise self._error("", -1, name, f"[{name}] must be a table")
                self._validate_table(name, -1, value)

    def _validate_tasks(self, value: Any) -> None:
        if not isinstance(value, list) or not all(isinstance(entry, dict) for entry in value):
            raise self._error("", -1, "task", "tasks are declared as [[task]] tables (double brackets)")
        for index, entry in enumerate(value):
            if "type" not in entry:
                message = 'this [[task]] has no type = "..." (the task type to poll)'
                raise self._error("task", index, "", message)
            task_type = check_value(KEYS["type"], entry["type"], self.source("task", index, "type"))
            if task_type in self._types:
                first = self.source("task", self._types[task_type], "type")
                raise self._error(
                    "task", index, "type", f"task type {task_type!r} is declared twice (first at {first})"
                )
            self._types[task_type] = index
            self._validate_table("task", index, entry)

    def _validate_table(self, section: str, index: int, table: Mapping[str, Any]) -> None:
        allowed = _allowed_keys(section)
        for raw_key, value in table.items():
            key = ALIASES.get(raw_key, raw_key)
            if key not in allowed:
                self._unknown(section, index, raw_key, sorted(allowed | set(ALIASES)))
            if (section, index, key) in self._values:
                other = next(k for k in table if k != raw_key and ALIASES.get(k, k) == key)
                raise self._error(
                    section, index, raw_key, f"{other} and {raw_key} are the same setting: give one"
                )
            source = self.source(section, index, raw_key)
            self._values[(section, index, key)] = (check_value(KEYS[key], value, source), source)

    def _unknown(self, section: str, index: int, key: str, candidates: list[str]) -> None:
        spec = KEYS.get(ALIASES.get(key, key))
        home = {"server": "[server]", "runner": "[worker]", "task": "[[task]]"}
        if spec and spec.in_file:
            hint = f"{key} belongs in {home[spec.scope]}"
            if spec.scope == "task" and spec.in_worker:
                hint += " (or [worker], as a default for every task)"
        elif spec:
            hint = f"{key} is a command-line flag only ({spec.flag})"
        else:
            import difflib  # here: only a misspelled key needs it

            close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"known keys: {', '.join(candidates)}"
        where = "" if section else " at the top level"  # the source already names the section
        raise self._error(section, index, key, f"unknown key {key!r}{where}: {hint}")

    def _error(self, section: str, index: int, key: str, message: str) -> ConfigError:
        source = self.source(section, index, key) if section else self._top_source(key)
        return ConfigError(f"{source}: {message}", key=key or None, source=str(source))

    def _top_source(self, key: str) -> Source:
        line = self._loaded.lines.get(("", -1, key))
        return Source("file", f"{self.path}:{line}" if line else self.path)


def _allowed_keys(section: str) -> set[str]:
    if section == "server":
        return {spec.name for spec in keys_of("server")}
    if section == "worker":
        runner = {spec.name for spec in keys_of("runner") if spec.in_file}
        return runner | {spec.name for spec in keys_of("task") if spec.in_worker}
    return {spec.name for spec in keys_of("task")}
