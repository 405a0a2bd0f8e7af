"""The copies' own records (``stall_child.py``): what each copy of a task did, by its pid."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STALL_CHILD = str(ROOT / "tests" / "integration" / "stall_child.py")


@dataclass
class Copy:
    """One copy of a task: when it started and last lived (monotonic and wall seconds), its TERMs."""

    pid: int
    task_id: str = "-"
    start: float = 0.0
    start_wall: float = 0.0
    last: float = 0.0  # its last tick: when it died, within 10 ms, once it is gone
    last_wall: float = 0.0
    terms: list[float] = field(default_factory=list)

    @property
    def term_rounds(self) -> int:
        """How many times it was sent TERM: one round signals its group and each member (the leader
        may get two within a millisecond), so TERMs under 50 ms apart count as one."""
        return sum(1 for i, t in enumerate(self.terms) if i == 0 or t - self.terms[i - 1] > 0.05)


def copies(path: Path) -> list[Copy]:
    """Every copy recorded in ``path``, in start order (none if the file does not exist yet)."""
    found: dict[int, Copy] = {}
    text = path.read_text() if path.exists() else ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue  # (a line being written)
        kind, mono, wall, pid = parts[0], float(parts[1]), float(parts[2]), int(parts[3])
        copy = found.setdefault(pid, Copy(pid))
        if kind == "start":
            copy.start, copy.start_wall = mono, wall
            copy.task_id = parts[4] if len(parts) > 4 else "-"
        elif kind == "term":
            copy.terms.append(mono)
        copy.last, copy.last_wall = max(copy.last, mono), max(copy.last_wall, wall)
    return sorted(found.values(), key=lambda c: c.start)
