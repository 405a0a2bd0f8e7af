"""``--help`` text for the options that set a configuration key: unit, default, and where else to set it.

Composed from the keys' declarations (``leasecore.config.settings``, read through
``leasecore.config.keys``: help, unit, default and what unset means, environment variables, file
section), so ``--help`` says what the merge does. The flags themselves default to None ("not
given"): the merge owns the defaults.
"""

from __future__ import annotations

from leasecore.config.keys import KEYS, KeySpec
from leasecore.config.loader import CONFIG_ENV, DEFAULT_CONFIG_NAME
from leasecore.config.settings import STATE_DIR_DEFAULT

__all__ = ["STATE_DIR_DEFAULT", "config_file_help", "flag_help", "key_help", "show_default", "sources_of"]

SECTIONS = {"server": "[server]", "runner": "[worker]", "task": "[[task]]/[worker]"}


def _unit(unit: str) -> str:
    return f" {unit}" if unit else ""


def show_default(name: str, unit: str | None = None, *, zero: str | None = None) -> str:
    """The default as help text: ``10 s``, ``1000 ms``, ``on``; what unset means (the declaration's
    ``unset``, else "none") when it is None, empty or an empty list; "" for no default to speak of."""
    spec = KEYS[name]
    value = spec.default
    if value is None or value == "" or (isinstance(value, tuple | dict) and not value):
        return spec.unset if spec.unset is not None else "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"{value}{_unit(spec.unit if unit is None else unit)}"
    zero = spec.zero if zero is None else zero
    return f"{text} ({zero})" if zero is not None and value == 0 else text


def sources_of(spec: KeySpec) -> list[str]:
    """Where else ``spec`` is set: ``env VAR, VAR``, ``file <section> <key>`` or "command line only"."""
    parts = []
    envs = list(spec.env)
    if spec.worker_prop:  # the SDK spellings: per task type, or for all (docs/configuration.md)
        envs.append(f"CONDUCTOR_WORKER_<TASK|ALL>_{spec.worker_prop.upper()}")
    if envs:
        parts.append("env " + ", ".join(envs))
    section = SECTIONS[spec.scope] if spec.in_worker else "[[task]]"
    parts.append(f"file {section} {spec.name}" if spec.in_file else "command line only")
    return parts


def key_help(name: str, unit: str | None = None, *, what: str | None = None, default: str | None = None,
             zero: str | None = None) -> str:
    """``<what it does>. Default: <default>; env <VAR>...; file <section> <key>.`` for key ``name``.

    Everything comes from the key's declaration; the keywords override it for a caller that means
    something else (``what``: the words; ``default``: the default's text, "" leaves it out).
    """
    spec = KEYS[name]
    text = what or spec.help
    shown = default if default is not None else show_default(name, unit, zero=zero)
    parts = [f"default: {shown}"] if shown else []  # "": no default to speak of
    where = "; ".join(parts + sources_of(spec))
    return f"{text[:1].upper()}{text[1:]}. {where[:1].upper()}{where[1:]}."


def flag_help(spec: KeySpec) -> str:
    """The ``--help`` text of ``spec``'s flag: the flag's own words when it has them, else the key's."""
    return key_help(spec.name, what=spec.flag_help)


def config_file_help() -> str:
    """``--config``: where the file is found when the flag is not given."""
    return f"Config file. Default: ./{DEFAULT_CONFIG_NAME} when present; env {CONFIG_ENV}."
