"""``conductor-run run ...`` without typer: the runner's start path loads no CLI framework.

typer (with its vendored click) and the pydantic it builds every parameter's converter with are
about 12 MB of an idle runner's RSS, and a runner lives for weeks. So :func:`main` reads a ``run``
command line itself when it is plain: only the options of ``run`` (``FLAGS``), each spelled in
full, values that convert without doubt, then ``--`` and the command. It hands ``cli.run.run``
exactly the overrides typer would: both read their flags off the keys' declarations
(``leasecore.config.keys.CLI_KEYS``), and ``tests/cli/test_fastrun.py`` compares the two on many
command lines.

Anything else goes to typer, which gives its usual answer: ``-h``/``--help``, completion, an unknown
or misspelled option, a missing value, a value that needs converting (``--concurrency 0x10``,
``--kill-grace 1e3``), a value that starts with ``-``, a word before ``--``. The fast path never
says no: it only says "plain" or "ask typer", so every usage error still reads as typer words it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from leasecore.config.keys import CLI_KEYS  # run loads it anyway: the merge reads the same table

# override name -> (flag, kind), in RUN_OPTIONS' order, from the keys' declarations (as typer's options
# are, ``cli.runoptions``); kind: str, int, float, ints / strs (repeatable), flag, pair (--x/--no-x).
FLAGS: dict[str, tuple[str, str]] = {
    "config": ("--config", "str"),
    **{
        spec.override: (
            spec.flag.split("/")[0],
            ("pair" if "/" in spec.flag else "flag") if spec.flag_kind == "bool" else spec.flag_kind,
        )
        for spec in CLI_KEYS
        if spec.flag
    },
}

_INT = re.compile(r"[0-9]{1,18}")
_FLOAT = re.compile(r"[0-9]{1,15}(\.[0-9]{1,15})?")
_BY_FLAG: dict[str, tuple[str, str, Any]] = {}
for _key, (_flag, _kind) in FLAGS.items():
    if _kind == "pair":
        _BY_FLAG[_flag] = (_key, "bool", True)
        _BY_FLAG["--no-" + _flag[2:]] = (_key, "bool", False)
    elif _kind == "flag":
        _BY_FLAG[_flag] = (_key, "bool", True)
    else:
        _BY_FLAG[_flag] = (_key, _kind, None)


class NotPlain(Exception):
    """This command line is for typer to read."""


def parse(args: list[str]) -> dict[str, Any]:
    """The overrides of ``run ARGS`` (the words after ``run``), as typer would pass them.

    Raises :class:`NotPlain` for anything outside the plain form (see the module docstring).
    """
    overrides: dict[str, Any] = {key: None for key in ("command", *FLAGS)}
    position = 0
    while position < len(args):
        word = args[position]
        position += 1
        if word == "--":
            command = args[position:]
            overrides["command"] = command or None
            return overrides
        name, has_value, inline = word.partition("=")
        spec = _BY_FLAG.get(name)
        if spec is None:
            raise NotPlain(word)
        key, kind, constant = spec
        if kind == "bool":
            if has_value:
                raise NotPlain(word)
            overrides[key] = constant
            continue
        if has_value:
            value = inline
        elif position < len(args):
            value = args[position]
            position += 1
        else:
            raise NotPlain(word)  # a missing value: typer says so
        if value.startswith("-"):
            raise NotPlain(value)
        if kind == "str":
            overrides[key] = value
        elif kind == "strs":
            overrides[key] = [*(overrides[key] or []), value]
        elif kind == "float":
            if not _FLOAT.fullmatch(value):
                raise NotPlain(value)
            overrides[key] = float(value)
        elif _INT.fullmatch(value):
            number = int(value)
            if kind == "ints":
                overrides[key] = [*(overrides[key] or []), number]
            else:
                overrides[key] = number
        else:
            raise NotPlain(value)
    return overrides


def plain_run(argv: list[str], environ: dict[str, str] | os._Environ[str]) -> dict[str, Any] | None:
    """The overrides when ``argv`` (after the program name) is a plain ``run``; None: ask typer."""
    if not argv or argv[0] != "run" or any(name.endswith("_COMPLETE") for name in environ):
        return None
    try:
        return parse(argv[1:])
    except NotPlain:
        return None
