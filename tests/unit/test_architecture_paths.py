"""Every file or folder of the repository that docs/ARCHITECTURE.md names exists, and its one claim
about imports that tests/unit/test_layering.py does not check holds: nothing in leasecore/ imports cli/.

The page is a map for a new engineer; a path that moved or was renamed makes it lie where it matters
most. A path is any run of text starting with one of the repository's top folders and a slash
(``leasecore/runner/loop/``, ``tests/unit/test_layering.py``, ``./scripts/sim``), in code spans and
prose alike; a bare module name in a code span (``engine.py``) must name a file somewhere in the
product. The check also runs on a planted page, so a reader that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "ARCHITECTURE.md"
TOP_FOLDERS = ("leasecore", "cli", "tests", "bench", "scripts", "sample_tasks", "deploy", "docs")
# A top folder and a slash, not preceded by a character that would make it the tail of another path
# (``.venv/bin/...``, ``shared/...``) or a word (``subtests/``); the path runs while it has path
# characters. A trailing dot or comma ends a sentence, not the path.
PATH = re.compile(r"(?<![\w./-])(?:\./)?((?:" + "|".join(TOP_FOLDERS) + r")/[\w./<>-]*)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
BARE_MODULE = re.compile(r"^[a-z_][a-z0-9_]*\.py$")


def named_paths(text: str) -> set[str]:
    """The repository paths ``text`` names, without trailing punctuation."""
    found = set()
    for match in PATH.finditer(text):
        path = match.group(1).rstrip(".,")
        if "<" not in path:  # a pattern such as runner-<pid>.json is no path
            found.add(path)
    return found


def bare_modules(text: str) -> set[str]:
    """Module file names given alone in a code span (``engine.py``)."""
    return {span for span in CODE_SPAN.findall(text) if BARE_MODULE.match(span)}


def missing(text: str, root: Path) -> list[str]:
    """What ``text`` names that does not exist under ``root``."""
    gone = [path for path in sorted(named_paths(text)) if not (root / path).exists()]
    product = [path.name for folder in ("leasecore", "cli") for path in (root / folder).rglob("*.py")]
    gone += [name for name in sorted(bare_modules(text)) if name not in product]
    return gone


def test_every_path_named_in_architecture_exists() -> None:
    text = PAGE.read_text(encoding="utf-8")
    paths = named_paths(text)
    assert len(paths) > 40, paths  # the reader saw the page's paths
    assert {"leasecore/lease/machine.py", "leasecore/runner/loop/", "scripts/sim"} <= paths
    assert missing(text, ROOT) == []


def test_a_missing_path_is_caught(tmp_path: Path) -> None:
    (tmp_path / "leasecore" / "runner").mkdir(parents=True)
    (tmp_path / "leasecore" / "runner" / "engine.py").write_text("x = 1\n")
    (tmp_path / "cli").mkdir()
    page = (
        "The engine is `leasecore/runner/engine.py`, beside leasecore/runner/gone.py. and `poller.py`;\n"
        "see ./scripts/sim, `engine.py`, `.venv/bin/python`, shared/DESIGN.md and runner-<pid>.json.\n"
    )
    assert named_paths(page) == {"leasecore/runner/engine.py", "leasecore/runner/gone.py", "scripts/sim"}
    assert missing(page, tmp_path) == ["leasecore/runner/gone.py", "scripts/sim", "poller.py"]


def imports_of_cli(root: Path) -> list[str]:
    """Modules under ``root/leasecore`` that import ``cli`` or a module of it (type-only imports too)."""
    found = []
    for path in sorted((root / "leasecore").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if any(name == "cli" or name.startswith("cli.") for name in names):
                found.append(str(path.relative_to(root)))
    return found


def test_nothing_in_leasecore_imports_cli() -> None:
    assert len(list((ROOT / "leasecore").rglob("*.py"))) > 100  # the walk saw the package
    assert imports_of_cli(ROOT) == []


def test_an_import_of_cli_below_leasecore_is_caught(tmp_path: Path) -> None:
    (tmp_path / "leasecore" / "runner").mkdir(parents=True)
    (tmp_path / "leasecore" / "runner" / "a.py").write_text("from cli import exitcodes\n")
    (tmp_path / "leasecore" / "runner" / "b.py").write_text("import cli.main as m\n")
    (tmp_path / "leasecore" / "runner" / "c.py").write_text("import client\nfrom .cli import x\n")
    assert imports_of_cli(tmp_path) == ["leasecore/runner/a.py", "leasecore/runner/b.py"]
