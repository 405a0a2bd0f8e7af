"""Every package below leasecore/ keeps at most 12 modules at its top, so that a folder still says
what it holds: past that, its modules are grouped into subpackages by where the code runs and what
it is for (as process/ and runner/ are), not piled up. leasecore/ itself, the pure core, has its own
bound (tests/unit/test_layering.py). Checked on a planted tree too.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULES = 12


def crowded(root: Path) -> dict[str, int]:
    """Packages below ``root/leasecore`` with more than ``MAX_MODULES`` modules at their top."""
    found = {}
    for init in sorted((root / "leasecore").rglob("__init__.py")):
        package = init.parent
        if package == root / "leasecore":
            continue
        count = sum(1 for path in package.glob("*.py") if path.name != "__init__.py")
        if count > MAX_MODULES:
            found[str(package.relative_to(root))] = count
    return found


def test_no_package_holds_more_than_12_modules_at_its_top() -> None:
    assert len(list((ROOT / "leasecore").rglob("__init__.py"))) > 10  # the walk saw the packages
    assert crowded(ROOT) == {}


def test_a_crowded_package_is_caught(tmp_path: Path) -> None:
    for package, modules in (("leasecore", 20), ("leasecore/big", MAX_MODULES + 1),
                             ("leasecore/big/room", MAX_MODULES), ("leasecore/fine", MAX_MODULES)):
        (tmp_path / package).mkdir(parents=True)
        (tmp_path / package / "__init__.py").write_text('"""A package."""\n')
        for n in range(modules):
            (tmp_path / package / f"m{n}.py").write_text("x = 1\n")
    assert crowded(tmp_path) == {"leasecore/big": MAX_MODULES + 1}
