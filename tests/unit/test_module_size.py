"""No module of the product over 500 lines, so that each one's room stays readable in one sitting.

A module that grows past the bound is split by responsibility (see docs/ARCHITECTURE.md's map), not
allowed here: the bound has no exceptions list on purpose. The check also runs on a planted file.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_LINES = 500


def oversized(root: Path, packages: tuple[str, ...] = ("leasecore", "cli")) -> dict[str, int]:
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > LIMIT_LINES:
                found[str(path.relative_to(root))] = lines
    return found


def test_no_module_is_over_500_lines() -> None:
    assert len(list((ROOT / "leasecore").rglob("*.py"))) > 50  # the walk saw the tree
    assert oversized(ROOT) == {}


def test_an_oversized_module_is_caught(tmp_path: Path) -> None:
    (tmp_path / "leasecore").mkdir()
    (tmp_path / "leasecore" / "big.py").write_text("x = 1\n" * (LIMIT_LINES + 1))
    (tmp_path / "leasecore" / "fine.py").write_text("x = 1\n" * LIMIT_LINES)
    assert oversized(tmp_path, ("leasecore",)) == {"leasecore/big.py": LIMIT_LINES + 1}
