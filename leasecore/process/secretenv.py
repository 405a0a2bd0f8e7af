"""A task's runtime metadata (the secrets and values its task definition declares) for its child.

Owns the rules of DESIGN.md §3 for ``Task.runtime_metadata``: which names also become environment
variables (``metadata_env``: a valid name, not one of the child's interface names, not one the
runner already passes, a value exec can carry), the ``CONDUCTOR_SECRETS_FILE`` variable naming the
private file that holds all of them (written by ``taskfiles``), and the fail-closed check
(``missing_metadata``: declared or required names the server did not resolve).

Must not touch: files, processes. Pure. Threads: any.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping

SECRETS_FILE_ENV = "CONDUCTOR_SECRETS_FILE"
SECRETS_FILE_NAME = "secrets.json"

# as every reason's (process.results.reasons, which this pure module does not import)
REASON_LIMIT_CHARS = 500
_VALID_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# A value bigger than this stays in the file only: Linux refuses one environment string over
# 128 KiB, and the input variables share the rest of exec's budget.
METADATA_ENV_VALUE_LIMIT_BYTES = 64 * 1024
# Never set from the server, whatever a task definition declares: the child's interface
# (CONDUCTOR_*) and the dynamic loader's variables (a name the server could use to run its own code
# in every child of this host).
_RESERVED_PREFIXES = ("CONDUCTOR_", "LD_")


def env_name_allowed(name: str) -> bool:
    """Whether ``name`` may become an environment variable of the child (its value is always in the
    file): a valid shell variable name outside the reserved prefixes."""
    return bool(_VALID_NAME.match(name)) and not name.upper().startswith(_RESERVED_PREFIXES)


def metadata_env(
    metadata: Mapping[str, str], taken: Collection[str],
    is_kept_from_child: Callable[[str], bool] | None = None,
) -> dict[str, str]:
    """The variables ``metadata`` adds to a child whose environment already holds ``taken``.

    A name is left out (it is still in the file) when it is not a valid variable name, starts with
    ``CONDUCTOR_`` or ``LD_``, is already set (the runner's environment, the ``env`` table, the
    stdio protocol's names: the operator's setting wins), is one the configuration keeps from
    children (``is_kept_from_child(name)``: ``secrets`` and the credential patterns), or when exec
    could not carry its value (NUL byte, not UTF-8, over ``METADATA_ENV_VALUE_LIMIT_BYTES``)."""
    kept_from_child = is_kept_from_child
    env: dict[str, str] = {}
    for name, value in metadata.items():
        if not env_name_allowed(name) or name in taken:
            continue
        if kept_from_child is not None and kept_from_child(name):
            continue
        if "\0" in value:
            continue
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            continue
        if size <= METADATA_ENV_VALUE_LIMIT_BYTES:
            env[name] = value
    return env


def missing_metadata(
    declared: Iterable[str], required: Iterable[str], resolved: Mapping[str, str]
) -> list[str]:
    """The names the task definition declares (``declared``) or this runner requires (``required``)
    that the server did not resolve (absent from ``resolved``), in order, once each."""
    return [name for name in dict.fromkeys((*declared, *required)) if name not in resolved]


def missing_reason(missing: list[str], declared: Iterable[str]) -> str:
    """The reasonForIncompletion of a task not run for ``missing`` names (never a value)."""
    declared_set = set(declared)
    by_def = [name for name in missing if name in declared_set]
    by_us = [name for name in missing if name not in declared_set]
    parts = []
    if by_def:
        parts.append("declared by the task definition: " + ", ".join(by_def))
    if by_us:
        parts.append("required by this worker's configuration (required_secrets): " + ", ".join(by_us))
    reason = ("runtime metadata not resolved by the server, so the command was not run ("
              + "; ".join(parts) + "); give the server the value (Conductor OSS: CONDUCTOR_SECRET_<NAME> "
              "or CONDUCTOR_ENV_<NAME> in its environment)")
    # Bounded like every reason (a definition may declare any number of names of any length).
    return reason if len(reason) <= REASON_LIMIT_CHARS else reason[: REASON_LIMIT_CHARS - 3] + "..."
