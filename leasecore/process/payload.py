"""How big a result may be: what the server keeps without external storage, and the words for "too big".

Conductor measures a task's ``outputData`` as the JSON it serialises (compact, UTF-8, non-ASCII as is)
and moves anything over ``conductor.app.taskOutputPayloadSizeThreshold`` (3072 KB by default) to
external payload storage, which a plain worker setup does not have (CONDUCTOR_PROTOCOL.md §9). So the
runner keeps the whole ``outputData`` of an update within :data:`OUTPUT_DATA_LIMIT_BYTES`, measured
the same way (:func:`json_size`), and fails a task past it with a reason that says the size and the
limit (:func:`too_large`).

Pure. Threads: any.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

OUTPUT_DATA_LIMIT_BYTES = 3 * 1024 * 1024  # the server's default threshold: 3072 KB
_MIB = 1024 * 1024


def json_size(value: Mapping[str, Any]) -> int:
    """Bytes of ``value`` as the server serialises it: compact JSON, UTF-8, non-ASCII unescaped."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return len(text.encode("utf-8", "surrogatepass"))  # a lone surrogate: counted, never an error


def limit_text(limit: int = OUTPUT_DATA_LIMIT_BYTES) -> str:
    shown = f"{limit / _MIB:g} MiB" if limit >= _MIB else f"{limit} bytes"
    return f"the {limit}-byte ({shown}) limit the server keeps without external storage"


def too_large(
    what: str,
    size: int,
    limit: int = OUTPUT_DATA_LIMIT_BYTES,
    *,
    at_least: bool = False,
    advice: str = "write big results elsewhere",
) -> str:
    """``"<what> is too large: 3565158 bytes, over the 3145728-byte (3 MiB) limit ...; <advice>"``."""
    amount = f"{'at least ' if at_least else ''}{size} bytes"
    return f"{what} is too large: {amount}, over {limit_text(limit)}; {advice}"


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests lists/objects more than ``limit`` deep (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False
