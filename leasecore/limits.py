"""Per-task resource limits: their values, their parsing, and the rlimits that stand in for a cgroup.

Pure (no processes, no files). ``Limits`` is what a ``[[task]]`` asks for (``memory_max``,
``pids_max``, ``cpu_max``, ``nofile``); ``cgroups.py`` enforces it per task *tree* where the runner
may create cgroups. Where it may not, ``rlimits_for`` gives the per-*process* rlimits the fork server
sets in the child before its exec:

- ``memory_max`` -> RLIMIT_DATA (the data segment and every private anonymous mapping since Linux
  4.7: what a runaway allocation grows; shared libraries and code do not count, as they would under
  RLIMIT_AS). Each process of the tree gets the whole budget.
- ``pids_max`` -> RLIMIT_NPROC: the processes of the child's *user*, not of the tree, and the kernel
  ignores it for root (CAP_SYS_RESOURCE / CAP_SYS_ADMIN).
- ``cpu_max`` has no rlimit (RLIMIT_CPU bounds total seconds, not a rate): unenforced, with a warning.
- ``nofile`` -> RLIMIT_NOFILE, always (no cgroup controller bounds open files).

Threads: any (pure); the rlimits are applied in the fork server's child before exec.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# The rlimits by name (``resource.RLIMIT_<name>`` in the child: the numbers differ between systems).
RLIMIT_NPROC = "NPROC"
RLIMIT_NOFILE = "NOFILE"
RLIMIT_DATA = "DATA"

MAX_MEMORY_BYTES = 1 << 50  # 1 PiB: anything larger is a typo
MAX_PIDS = 4_194_304  # the kernel's pid_max ceiling
MAX_CPUS = 4096
MAX_NOFILE = 1 << 30

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
SIZE_ALLOWED = "a size such as 64M, 512K, 2G or 1.5G (K/M/G/T are powers of 1024), or bytes, > 0"


def parse_size(value: Any) -> int:
    """``64M`` / ``2G`` / ``1.5G`` / ``512KiB`` / ``1048576`` -> bytes. ValueError saying what is allowed
    for anything else (zero, negative, a fraction of a byte, above 1 PiB)."""
    if isinstance(value, bool):
        raise ValueError(SIZE_ALLOWED)
    if isinstance(value, int):
        number, scale = float(value), 1
    elif isinstance(value, str):
        match = _SIZE.fullmatch(value.strip())
        if match is None:
            raise ValueError(SIZE_ALLOWED)
        number, scale = float(match.group(1)), _UNITS[match.group(2).lower()]
    else:
        raise ValueError(SIZE_ALLOWED)
    size = number * scale
    if not math.isfinite(size) or size < 1 or size > MAX_MEMORY_BYTES or size != int(size):
        raise ValueError(SIZE_ALLOWED)
    return int(size)


def parse_cpus(value: Any) -> float:
    """``0.5`` / ``2`` (cores, as a number or a string) -> float; ValueError otherwise."""
    allowed = f"a number of CPU cores > 0 and <= {MAX_CPUS}, such as 0.5 or 2"
    if isinstance(value, bool):
        raise ValueError(allowed)
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(allowed) from None
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0 < value <= MAX_CPUS:
        raise ValueError(allowed)
    if value * 100_000 < 1000:  # the kernel's minimum quota is 1 ms per 100 ms period
        raise ValueError(allowed + " (at least 0.01)")
    return float(value)


def format_size(size: int) -> str:
    """67108864 -> ``64 MiB``; 1536 MiB -> ``1.5 GiB``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.4g} {unit}"
    return f"{size} bytes"


@dataclass(frozen=True, eq=False)
class Limits:
    """What one task type may use; None: no limit."""

    memory_max: int | None = None  # bytes
    pids_max: int | None = None
    cpu_max: float | None = None  # cores
    nofile: int | None = None

    @property
    def any(self) -> bool:
        return any(v is not None for v in (self.memory_max, self.pids_max, self.cpu_max, self.nofile))

    def describe(self) -> str:
        parts = []
        if self.memory_max is not None:
            parts.append(f"memory {format_size(self.memory_max)}")
        if self.pids_max is not None:
            parts.append(f"pids {self.pids_max}")
        if self.cpu_max is not None:
            parts.append(f"cpu {self.cpu_max:g} cores")
        if self.nofile is not None:
            parts.append(f"nofile {self.nofile}")
        return ", ".join(parts) or "none"


def rlimits_for(limits: Limits, by_group: frozenset[str]) -> list[tuple[str, int]]:
    """``(resource, value)`` pairs to set (soft = hard) in the child: the limits that ``by_group`` (the
    controllers enforcing them per tree: ``memory``, ``pids``) does not cover, plus ``nofile``."""
    pairs = []
    if limits.memory_max is not None and "memory" not in by_group:
        pairs.append((RLIMIT_DATA, limits.memory_max))
    if limits.pids_max is not None and "pids" not in by_group:
        pairs.append((RLIMIT_NPROC, limits.pids_max))
    if limits.nofile is not None:
        pairs.append((RLIMIT_NOFILE, limits.nofile))
    return pairs


def memory_reason(limit: int | None) -> str:
    """The ``reasonForIncompletion`` of a tree the kernel's OOM killer hit inside its group."""
    shown = format_size(limit) if limit is not None else "the group's"
    return f"memory limit {shown} exceeded: killed by the kernel's OOM killer"
