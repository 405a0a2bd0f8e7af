"""``conductor-run init [PATH]``: write a commented starter conductor.toml.

The text is composed here from the keys' declarations (``leasecore.config.settings``, through
``leasecore.config.keys``: help, default, what unset means, an example value), so it cannot drift from
what ``resolve`` accepts; values are written by tomli-w.
``conductor.toml.example`` in the repository is exactly this text (a test keeps them equal).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import tomli_w
import typer

from cli import exitcodes
from leasecore.config.keys import KeySpec, keys_of
from leasecore.config.loader import DEFAULT_CONFIG_NAME

_HEADER = """\
# conductor-run configuration (see docs/configuration.md).
#
# Found as: --config FILE, else $CONDUCTOR_RUN_CONFIG, else ./conductor.toml.
# Precedence, highest first:
#   command-line flag > task-specific env > global env > [[task]] > [worker] > built-in default
# Keys with CONDUCTOR_WORKER_* variables read them in every spelling the Conductor SDKs use:
#   conductor.worker.<task>.<prop>  conductor_worker_<task>_<prop>  CONDUCTOR_WORKER_<TASK>_<PROP>
#   conductor.worker.all.<prop>     conductor_worker_all_<prop>     CONDUCTOR_WORKER_ALL_<PROP>
# Booleans from the environment: true/1/yes/on or false/0/no/off (anything else is an error).
# Every key is listed with its default; uncomment a line to change it. Durations are in seconds
# unless the key says ms.
"""


def starter_text() -> str:
    """The starter file: every key, commented, with its default and its environment variable(s)."""
    parts = [_HEADER, "\n[server]\n"]
    parts += [_entry(spec, active=spec.name == "url") for spec in keys_of("server")]
    parts.append("\n[worker]\n# Runner-wide settings.\n")
    parts += [_entry(spec) for spec in keys_of("runner") if spec.in_file]
    parts.append("\n# Defaults for every [[task]] below (a [[task]] can set each of these too).\n")
    parts += [_entry(spec) for spec in keys_of("task") if spec.in_worker]
    parts.append(
        "\n# One [[task]] per task type; one `conductor-run run` serves them all.\n[[task]]\n"
        "# The Conductor task type to poll.\n"
        'type = "my_task"\n'
        "# The argv to run, no shell: task input arrives on stdin and in CONDUCTOR_INPUT_* variables.\n"
        '# Or instead: shell = "..." (run with /bin/sh -c; task input never becomes part of it).\n'
        'command = ["./my_task.sh"]\n'
    )
    return "".join(parts)


def _entry(spec: KeySpec, *, active: bool = False) -> str:
    default = spec.default
    unset = default in (None, "", (), {})
    shown = spec.example if unset and spec.example is not None else default
    default_text = f"unset ({spec.unset})" if unset and spec.unset else _toml_value(default)
    where = [f"default {default_text}", *(f"env {name}" for name in spec.env)]
    if spec.worker_prop:
        prop = spec.worker_prop.upper()
        where.append(f"env CONDUCTOR_WORKER_<TASK>_{prop}, CONDUCTOR_WORKER_ALL_{prop} (+ other spellings)")
    if spec.flag:
        where.append(f"flag {spec.flag}")
    line = f"{spec.name} = {_toml_value(shown)}\n"
    return f"# {spec.name}: {spec.help}.\n#   {'; '.join(where)}\n{'' if active else '# '}{line}"


def _toml_value(value: Any) -> str:
    if isinstance(value, dict):  # tomli-w writes tables as sections; an inline table reads better here
        pairs = ", ".join(f"{name} = {_toml_value(text)}" for name, text in value.items())
        return "{ " + pairs + " }" if pairs else "{}"
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = ") :].strip()


def init_command(
    path: Path = typer.Argument(Path(DEFAULT_CONFIG_NAME), metavar="PATH", hidden=True),
    force: bool = typer.Option(False, "--force", help="Overwrite the file if it exists."),
) -> None:
    """Write a commented starter conductor.toml (every key, with its default and env variables)."""
    try:
        is_dir = path.is_dir()
    except OSError as exc:  # a parent this user may not enter: is_dir() raises there
        typer.echo(f"conductor-run: cannot write {path}: {exc.strerror}", err=True)
        raise typer.Exit(exitcodes.USAGE) from None
    if is_dir:
        example = path / DEFAULT_CONFIG_NAME
        typer.echo(f"conductor-run: {path} is a directory; give a file path such as {example}", err=True)
        raise typer.Exit(exitcodes.USAGE)
    # A symlink is followed: the file it names is written (the link stays), even when it does not
    # exist yet. Anything but a regular file there (FIFO, device, socket) is refused, never replaced.
    target = Path(os.path.realpath(path))
    try:
        kind = _not_regular(target)
        if kind:
            shown = f"{path} (-> {target})" if path.is_symlink() else str(path)
            typer.echo(f"conductor-run: {shown} is {kind}; init writes only regular files", err=True)
            raise typer.Exit(exitcodes.USAGE)
        _write_new(target, starter_text(), overwrite=force)
    except FileExistsError:
        typer.echo(f"conductor-run: {path} already exists; use --force to overwrite it", err=True)
        raise typer.Exit(exitcodes.USAGE) from None
    except OSError as exc:
        typer.echo(f"conductor-run: cannot write {path}: {exc.strerror}", err=True)
        raise typer.Exit(exitcodes.USAGE) from None
    typer.echo(f"Wrote {path}. Check it with: conductor-run config --config {path}")


def _not_regular(path: Path) -> str:
    """What is at ``path`` when it exists and is not a regular file ("a FIFO", ...), else "".
    ``stat`` only: a FIFO is never opened (opening one would block until a writer came)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return ""
    if stat.S_ISREG(mode):
        return ""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def _write_new(path: Path, text: str, *, overwrite: bool) -> None:
    """Write ``text`` to ``path`` (symlinks already resolved) all or nothing: a failure (disk full)
    leaves no partial file and, with ``overwrite``, the old file as it was (a temp file in the same
    directory, then a rename). The old file's mode is kept; its owner is not (the file is new)."""
    if not overwrite:
        with open(path, "x", encoding="utf-8") as handle:  # "x": never clobber, even in a race
            try:
                handle.write(text)
                handle.flush()
            except OSError:
                path.unlink(missing_ok=True)
                raise
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        try:
            mode = stat.S_IMODE(path.stat().st_mode)  # keep the old file's permissions
        except FileNotFoundError:
            mode = 0o644
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def register(app: typer.Typer) -> None:
    app.command(
        "init",
        help="Write a commented starter conductor.toml (every key, with its default and env variables).\n\n"
        f"PATH: where to write it (default: ./{DEFAULT_CONFIG_NAME}).",
    )(init_command)
