"""The options of ``run``, derived from the keys' declarations and shared with ``config``.

``config`` takes any ``run`` command line and shows what that run would use, so both must take the
same options; ``worker stdio`` takes most of them too. Every option is made from one key's
declaration (``leasecore.config.settings``: flag, metavar, kind, help; :data:`CLI_KEYS` in
``leasecore.config.keys`` says which and in what order), sets that key in the merge (its name is the
key's ``override``, in ``leasecore.config.loader.OVERRIDE_KEYS``) and defaults to None, "not given":
the merge owns the defaults, and ``--help`` says them (``cli.helptext``). The lean start path reads
the same declarations (``cli.fastrun``).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import typer

from cli.helptext import config_file_help, flag_help
from leasecore.config.keys import CLI_KEYS, KEYS, KeySpec

# A key's kind -> the type typer converts its flag's value to.
_TYPER_TYPES: dict[str, Any] = {
    "str": str | None, "int": int | None, "float": float | None, "bool": bool | None,
    "ints": list[int] | None, "strs": list[str] | None,
}  # fmt: skip


def typer_option(spec: KeySpec) -> Any:
    """The typer option of key ``spec``'s flag: its spelling(s), metavar and help."""
    assert spec.flag is not None, spec.name  # only keys with a flag (CLI_KEYS) get an option
    if spec.flag_kind == "bool":
        return typer.Option(None, spec.flag, help=flag_help(spec))
    return typer.Option(None, spec.flag, metavar=spec.metavar, help=flag_help(spec))


def _run_options() -> tuple[tuple[str, Any, Any], ...]:
    command = KEYS["command"]
    return (
        (command.name, list[str] | None, typer.Argument(None, metavar=command.metavar, hidden=True)),
        ("config", str | None, typer.Option(None, "--config", metavar="FILE", help=config_file_help())),
        *((spec.override, _TYPER_TYPES[spec.flag_kind], typer_option(spec)) for spec in CLI_KEYS),
    )


# (override name, the type typer converts the value to, the argument or option), in --help order.
RUN_OPTIONS: tuple[tuple[str, Any, Any], ...] = _run_options()


def with_run_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command(overrides, **own)`` as a typer command: every run option, then ``command``'s own.

    typer reads a command's options from its signature, so the returned function's signature lists
    them; it hands them to ``command`` as one overrides dict (``leasecore.config.loader.load_config``).
    """
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]  # after overrides
    keyword = inspect.Parameter.KEYWORD_ONLY
    parameters = [
        *(inspect.Parameter(name, keyword, default=option, annotation=kind)
          for name, kind, option in RUN_OPTIONS),
        *(parameter.replace(kind=keyword) for parameter in own),
    ]

    @functools.wraps(command)
    def with_options(**given: Any) -> None:
        command({name: given.pop(name) for name, _, _ in RUN_OPTIONS}, **given)

    signature = inspect.Signature(parameters, return_annotation=None)
    with_options.__signature__ = signature  # type: ignore[attr-defined]
    with_options.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return with_options
