"""Every configuration key conductor-run knows, as data, read off the settings' declarations.

Owns: :data:`KEYS`, the table of keys, a row being a :class:`KeySpec` (defined in ``config.checks``)
made from one field of ``ServerSettings`` / ``RunnerSettings`` / ``TaskSettings`` (declared there
with ``settings.option``: add a key there, nowhere else), the file's other spellings
(:data:`ALIASES`), :func:`keys_of`, :data:`CLI_KEYS` (the keys ``run`` takes a flag for, in
``--help`` order) and :data:`RESTART_ONLY` (the keys only a restart may change, with why). The
merge (``config.merge``) reads the table, and so do the TOML view (``config.tomlfile``), a reload
(``config.live``), the CLI's options and help (``cli/runoptions.py``, ``cli/fastrun.py``),
``init``'s file and the configuration reference (``cli/reference.py``).

Must not: hold checking code (``config.checks``), declarations (``config.settings``) or I/O. Pure.
Threads: none; the table is built once at import and never changed.
"""

from __future__ import annotations

from dataclasses import MISSING, Field, fields
from typing import Any

from leasecore.config.checks import (
    KeySpec,
    as_text,
    bool_from_text,
    check_value,
    float_from_text,
    int_from_text,
    invalid_value,
)
from leasecore.config.settings import OPTION, RunnerSettings, ServerSettings, Source, TaskSettings

# Re-exported: the checkers' messages and the provenance type were this module's before the split.
__all__ = [
    "ALIASES",
    "CLI_KEYS",
    "KEYS",
    "RESTART_ONLY",
    "SCOPES",
    "KeySpec",
    "Source",
    "check_value",
    "invalid_value",
    "keys_of",
]

# scope -> the settings class whose fields declare its keys
SCOPES: dict[str, type] = {"server": ServerSettings, "runner": RunnerSettings, "task": TaskSettings}

# A value's kind, from the field's annotation (a declaration's ``kind`` overrides it): what a flag's
# value is converted to, and how an environment variable's text is read.
_KIND_OF_TYPE = {"bool": "bool", "int": "int", "float": "float", "str": "str", "tuple[int, ...]": "ints"}
_FROM_TEXT = {"bool": bool_from_text, "int": int_from_text, "float": float_from_text}


def _spec(scope: str, item: Field[Any]) -> KeySpec:
    declared = dict(item.metadata[OPTION])
    annotation = str(item.type).removesuffix(" | None")
    kind = declared.pop("kind", None) or _KIND_OF_TYPE.get(annotation, "str")
    if item.default is not MISSING:
        default = item.default
    elif item.default_factory is not MISSING:
        default = item.default_factory()
    else:
        default = None  # required (the task type)
    return KeySpec(
        name=item.name,
        scope=scope,
        default=default,
        flag_kind=kind,
        from_text=_FROM_TEXT.get(kind, as_text),
        in_file=declared.pop("file", True),
        in_worker=declared.pop("worker", True),
        **declared,
    )


KEYS: dict[str, KeySpec] = {
    item.name: _spec(scope, item)
    for scope, cls in SCOPES.items()
    for item in fields(cls)
    if OPTION in item.metadata
}

# Other spellings accepted in the file.
ALIASES: dict[str, str] = {alias: spec.name for spec in KEYS.values() for alias in spec.aliases}

# The keys ``run`` (and ``config``, ``worker stdio``) take a flag for, in --help order: the server, then
# what a task runs and how, then the runner's own. The command (``-- CMD ARGS``) is an argument.
CLI_KEYS: tuple[KeySpec, ...] = tuple(
    spec
    for scope in ("server", "task", "runner")
    for spec in KEYS.values()
    if spec.scope == scope and spec.flag and spec.flag != "--"
)

# scope -> key -> why a running runner cannot change it (``config.live``); every other key is live.
RESTART_ONLY: dict[str, dict[str, str]] = {
    scope: {spec.name: spec.restart for spec in KEYS.values() if spec.scope == scope and spec.restart}
    for scope in SCOPES
}


def keys_of(scope: str) -> list[KeySpec]:
    """The keys of ``scope`` (server | runner | task), in the declarations' order."""
    return [spec for spec in KEYS.values() if spec.scope == scope]
