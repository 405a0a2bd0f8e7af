"""The configuration reference of docs/configuration.md, generated from the keys' declarations.

The page holds two generated regions between marker comments: the SDK property names the
``CONDUCTOR_WORKER_*`` variables take (``props``), and the tables of every key (``keys``), one per
section, each row made from one declaration (``leasecore.config.settings``): default, environment,
flag, what it does, and what a reload does with it. ``python -m cli.reference`` rewrites the page;
a test keeps the checked-in page equal to :func:`render` of it, so the page in the repository (read
on GitHub, and diffed in review when an option changes) is what the site shows, and the docs build
needs no hook that imports the package.

Must not: be imported by a command (it is for the docs and their test). Pure, but for ``main``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from leasecore.config.keys import KEYS, KeySpec, keys_of

PAGE = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
_REGION = re.compile(r"(<!-- generated: (\w+)[^>]*-->\n)(.*?)(<!-- end generated: \2 -->)", re.DOTALL)
_TABLES = (
    ("server", "`[server]`: how to reach the server"),
    ("runner", "`[worker]`: the runner as a whole"),
    ("task", "Per task type: `[[task]]`, most with a default for every task in `[worker]`"),
)


def render(page: str) -> str:
    """``page`` with each generated region replaced by what the declarations say now."""
    makers = {"props": _props, "keys": _keys}

    def region(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in makers:
            raise ValueError(f"unknown generated region {name!r} in {PAGE.name}")
        return match.group(1) + makers[name]() + match.group(4)

    return _REGION.sub(region, page)


def _props() -> str:
    names = []
    for spec in KEYS.values():
        if spec.worker_prop:
            alias = f" (= `{spec.name}`)" if spec.worker_prop != spec.name else ""
            names.append(f"`{spec.worker_prop}`{alias}")
    return "`<prop>` is one of " + ", ".join(names) + ".\n"


def _keys() -> str:
    parts = []
    for scope, title in _TABLES:
        parts.append(f"\n### {title}\n\n")
        if scope == "task":
            parts.append("| key | default | where | environment (SDK `<prop>`) | flag | what | on reload |\n"
                         "|---|---|---|---|---|---|---|\n")
        else:
            parts.append("| key | default | environment (first set wins) | flag | what | on reload |\n"
                         "|---|---|---|---|---|---|\n")
        parts += [_row(spec) for spec in keys_of(scope)]
    return "".join(parts)[1:]


def _row(spec: KeySpec) -> str:
    key = f"`{spec.name}`" + "".join(f" (alias `{alias}`)" for alias in spec.aliases)
    if spec.scope == "task":
        where = "`[[task]]`, `[worker]`" if spec.in_worker else "`[[task]]`"
        if spec.combined:
            where = "`[worker]` + `[[task]]`, combined"
        env = f"`{spec.worker_prop}`" if spec.worker_prop else ""
        cells = [key, _default(spec), where, env]
    else:
        env = ", ".join(f"`{name}`" for name in spec.env)
        cells = [key, _default(spec) + ("" if spec.in_file else " (command line only)"), env]
    cells += [_flag(spec), _what(spec), _reload(spec)]
    return "| " + " | ".join(cells) + " |\n"


def _reload(spec: KeySpec) -> str:
    if spec.restart:
        return f"restart: {spec.restart}"
    if spec.name == "type":  # a [[task]]'s identity: a reload compares the list of types (config.live)
        return "restart: the task types served can only change with a restart"
    return "live"


def _default(spec: KeySpec) -> str:
    value = spec.default
    if value is None or value == "" or (isinstance(value, tuple | dict) and not value):
        if spec.unset == "":
            return "—"
        if spec.unset is None and isinstance(value, tuple | dict):
            return "`[]`" if isinstance(value, tuple) else "`{}`"
        return _escape(spec.unset or "none")
    unit = f" {spec.unit}" if spec.unit else ""
    return f"`{_show(value)}`{unit}" + (f" ({spec.zero})" if spec.zero and value == 0 else "")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _flag(spec: KeySpec) -> str:
    if spec.flag is None:
        return ""
    if spec.flag == "--":
        return "`-- CMD ARGS`"
    flags = ", ".join(f"`{flag}`" for flag in spec.flag.split("/"))
    return flags + (" (repeatable)" if spec.flag_kind in ("ints", "strs") else "")


def _what(spec: KeySpec) -> str:
    text = _escape(spec.help)
    text = f"{text[:1].upper()}{text[1:]}."
    if spec.path:
        text += (" Relative: to the config file that gives it (given by a flag or the environment: to the "
                 "current directory); `~/` is the home directory.")
    return f"{text} {spec.doc}" if spec.doc else text


def _escape(text: str) -> str:
    """Plain words in a Markdown table cell: no emphasis, no HTML, no column break."""
    return text.replace("*", r"\*").replace("<", "&lt;").replace("|", r"\|")


def main() -> int:
    """Rewrite docs/configuration.md's generated regions (``--check``: exit 1 when they are stale)."""
    page = PAGE.read_text(encoding="utf-8")
    fresh = render(page)
    if "--check" in sys.argv[1:]:
        return 0 if fresh == page else 1
    if fresh != page:
        PAGE.write_text(fresh, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
