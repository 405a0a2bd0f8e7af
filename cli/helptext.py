"""``--help`` text for the options that set a configuration key: unit, default, and where else to set it.

Composed from the key table (``leasecore.config.keys``: help, environment variables, file section)
and the defaults on the settings dataclasses (``leasecore.config.loader``), so ``--help`` says what the
merge does. The flags themselves default to None ("not given"): the merge owns the defaults.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from leasecore.config.keys import KEYS
from leasecore.config.loader import (
    CONFIG_ENV,
    DEFAULT_CONFIG_NAME,
    RunnerSettings,
    ServerSettings,
    TaskSettings,
)

_SETTINGS: dict[str, type] = {"server": ServerSettings, "runner": RunnerSettings, "task": TaskSettings}
_SECTIONS = {"server": "[server]", "runner": "[worker]", "task": "[[task]]/[worker]"}
_UNITS = {"s": " s", "ms": " ms", "": ""}
# leasecore.state.statefile.default_state_dir when CONDUCTOR_RUN_STATE_DIR is unset
STATE_DIR_DEFAULT = "$XDG_RUNTIME_DIR/conductor-run, else ~/.local/state/conductor-run"


def default_of(name: str) -> Any:
    """The built-in default of configuration key ``name`` (from its settings dataclass)."""
    for item in fields(_SETTINGS[KEYS[name].scope]):
        if item.name == name:
            if item.default is not MISSING:
                return item.default
            if item.default_factory is not MISSING:
                return item.default_factory()
    raise KeyError(name)


def show_default(name: str, unit: str = "", *, unset: str = "none", zero: str | None = None) -> str:
    """The default as help text: ``10 s``, ``1000 ms``, ``on``; ``unset`` when it is None."""
    value = default_of(name)
    if value is None:
        return unset
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"{value}{_UNITS[unit]}"
    return f"{text} ({zero})" if zero is not None and value == 0 else text


def key_help(name: str, unit: str = "", *, what: str | None = None, default: str | None = None,
             zero: str | None = None) -> str:
    """``<what it does>. Default: <default>; env <VAR>...; file <section> <key>.`` for key ``name``.

    ``unit``: "s" or "ms", shown after the default; ``default`` replaces the dataclass default's text
    (for a default that means something, such as "the hostname"; "" leaves it out); ``zero``: what 0
    means.
    """
    spec = KEYS[name]
    text = what or spec.help
    shown = default if default is not None else show_default(name, unit, zero=zero)
    parts = [f"default: {shown}"] if shown else []  # default="": no default to speak of
    envs = list(spec.env)
    if spec.worker_prop:  # the SDK spellings: per task type, or for all (docs/configuration.md)
        envs.append(f"CONDUCTOR_WORKER_<TASK|ALL>_{spec.worker_prop.upper()}")
    if envs:
        parts.append("env " + ", ".join(envs))
    section = _SECTIONS[spec.scope] if spec.in_worker else "[[task]]"
    parts.append(f"file {section} {name}" if spec.in_file else "command line only")
    where = "; ".join(parts)
    return f"{text[:1].upper()}{text[1:]}. {where[:1].upper()}{where[1:]}."


def config_file_help() -> str:
    """``--config``: where the file is found when the flag is not given."""
    return f"Config file. Default: ./{DEFAULT_CONFIG_NAME} when present; env {CONFIG_ENV}."
