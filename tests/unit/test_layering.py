"""The import layering ARCHITECTURE.md promises, read from the source with ``ast`` (nothing imported).

- The pure core (``PURE``) imports no I/O, threads, processes or CLI libraries, and no adapter of its
  own package: only the standard library's data modules and other pure modules.
- Nothing outside ``cli/`` imports typer or rich (the CLI edge is the only place that prints).
- No import cycle among the project's own modules (imports under ``if TYPE_CHECKING:`` are left out:
  they never run).
Each rule is also checked against a planted violation, so a walker that finds nothing cannot pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("leasecore", "cli")

# The pure core: decisions and values, clock injected. config.tomlfile parses text it is handed; the
# config's settings, checkers, key table and merge are pure too (only config.loader reads files).
PURE = frozenset({
    "leasecore", "leasecore.errors", "leasecore.models", "leasecore.clock", "leasecore.backoff",
    "leasecore.fleet.view", "leasecore.handover", "leasecore.lease", "leasecore.limits", "leasecore.snapshot",
    "leasecore.config.settings", "leasecore.config.checks", "leasecore.config.keys",
    "leasecore.config.tomlfile", "leasecore.config.merge", "leasecore.config.live",
    "leasecore.http_framing", "leasecore.checkbudget", "leasecore.state.redelivery",
    "leasecore.runner.upstream.pollpolicy", "leasecore.runner.ports", "leasecore.runner.chain",
    "leasecore.runner.leasing.leasebook", "leasecore.runner.leasing.core",
    "leasecore.runner.leasing.schedule", "leasecore.masking", "leasecore.process.secretenv",
    "leasecore.process.forkserver.deadman",
    "leasecore.lease.actions", "leasecore.lease.machine", "leasecore.lease.ownership",
    "leasecore.lease.policy", "leasecore.lease.finalcheck", "leasecore.lease.finalfailure",
    # the packages' own __init__ modules are docstrings only
    "leasecore.conductor", "leasecore.config", "leasecore.demo", "leasecore.fleet", "leasecore.runner",
    "leasecore.state",
    # the subpackages of process/ and runner/: docstrings only (the fork server runs two of them)
    "leasecore.process.forkserver",
    "leasecore.process.linux",
    "leasecore.process.results",
    "leasecore.process.supervisor",
    "leasecore.runner.leasing",
    "leasecore.runner.loop",
    "leasecore.runner.upstream",
})
# Standard-library modules the pure core may not touch: I/O, threads, processes, sockets, signals.
IMPURE_STDLIB = frozenset({
    "os", "sys", "io", "socket", "ssl", "select", "selectors", "signal", "subprocess", "threading",
    "multiprocessing", "concurrent", "asyncio", "shutil", "tempfile", "pathlib", "http", "urllib.request",
    "logging", "fcntl", "ctypes", "pty", "termios",
})
# Only the clock may read time; everything else gets it injected.
TIME_ALLOWED = frozenset({"leasecore.clock"})
CLI_LIBRARIES = frozenset({"typer", "rich", "click"})
THIRD_PARTY_IO = frozenset({"requests", "urllib3", "prometheus_client", "psutil"})


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            yield from (n for stmt in child.orelse for n in [stmt, *_walk_runtime(stmt)])
            continue
        yield child
        yield from _walk_runtime(child)


def imports_of(
    source: str, module: str, *, is_package: bool = False, type_only_too: bool = False
) -> set[str]:
    """Absolute names of every module imported at run time (anywhere in the file, lazily too); with
    ``type_only_too``, those under ``if TYPE_CHECKING:`` as well."""
    tree = ast.parse(source)
    package = module if is_package or "." not in module else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in (ast.walk(tree) if type_only_too else _walk_runtime(tree)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join([*base_parts, node.module] if node.module else base_parts)
            else:
                base = node.module or ""
            names.add(base)
            if _top(base) in PACKAGES:  # "from leasecore import lease" imports leasecore.lease
                names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def graph(files: Mapping[str, Path], *, type_only_too: bool = False) -> dict[str, set[str]]:
    own = set(files)
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        text = path.read_text(encoding="utf-8")
        imported = imports_of(text, name, is_package=path.name == "__init__.py", type_only_too=type_only_too)
        edges[name] = {i for i in imported if i in own} - {name}
    return edges


def _top(name: str) -> str:
    return name.split(".", 1)[0]


def _matches(imported: str, forbidden: Iterable[str]) -> str | None:
    for bad in forbidden:
        if imported == bad or imported.startswith(bad + "."):
            return bad
    return None


def pure_violations(files: Mapping[str, Path]) -> list[str]:
    found = []
    for name in sorted(PURE & set(files)):
        for imported in sorted(imports_of(files[name].read_text(encoding="utf-8"), name)):
            bad = _matches(imported, IMPURE_STDLIB | CLI_LIBRARIES | THIRD_PARTY_IO)
            if bad is None and imported == "time" and name not in TIME_ALLOWED:
                bad = "time"
            if bad is None and _top(imported) in PACKAGES and imported in files and imported not in PURE:
                bad = f"adapter {imported}"
            if bad is not None:
                found.append(f"{name} imports {imported} ({bad})")
    return found


def cli_library_violations(files: Mapping[str, Path]) -> list[str]:
    found = []
    for name, path in sorted(files.items()):
        if _top(name) == "cli":
            continue
        for imported in sorted(imports_of(path.read_text(encoding="utf-8"), name)):
            if _matches(imported, CLI_LIBRARIES):
                found.append(f"{name} imports {imported}")
    return found


def find_cycle(edges: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first node repeated at the end), or None."""
    white, grey, black = 0, 1, 2
    colour = dict.fromkeys(edges, white)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = grey
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if colour.get(nxt, black) == grey:
                return [*stack[stack.index(nxt):], nxt]
            if colour.get(nxt) == white:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        colour[node] = black
        return None

    for start in sorted(edges):
        if colour[start] == white:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def _package_edges(edges: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Drop the edge from a package's ``__init__`` to its own submodules (re-exports are not cycles)."""
    return {
        name: {i for i in targets if not i.startswith(name + ".")} for name, targets in edges.items()
    }


# -- the rules on the real tree --------------------------------------------------------------------


def test_the_pure_core_imports_no_io_threads_or_cli() -> None:
    files = project_files()
    assert set(files) >= PURE, sorted(PURE - set(files))
    assert pure_violations(files) == []


def test_the_top_of_leasecore_is_the_pure_core_and_small() -> None:
    """A module directly in leasecore/ is pure (adapters live in the packages), at most 15."""
    top = {name for name, path in project_files().items()
           if path.parent == ROOT / "leasecore" and path.name != "__init__.py"}
    assert 5 < len(top) <= 15, sorted(top)
    assert top <= PURE, sorted(top - PURE)


def test_nothing_below_cli_imports_typer_or_rich() -> None:
    assert cli_library_violations(project_files()) == []


def test_no_import_cycle_among_the_projects_modules() -> None:
    edges = _package_edges(graph(project_files()))
    assert len(edges) > 40  # the walk saw the tree
    assert find_cycle(edges) is None


def test_no_cycle_even_through_type_only_imports() -> None:
    """A loop that only annotations close still ties two rooms together (a child reaching back
    into its supervisor, a codec and the spec that names it): none is left, keep it so."""
    edges = _package_edges(graph(project_files(), type_only_too=True))
    assert find_cycle(edges) is None


# -- the checks themselves find a planted violation -------------------------------------------------


def _planted(tmp_path: Path, sources: Mapping[str, str]) -> dict[str, Path]:
    files = {}
    for name, text in sources.items():
        path = tmp_path / f"{name.replace('.', '_')}.py"
        path.write_text(text, encoding="utf-8")
        files[name] = path
    return files


def test_a_pure_module_importing_threads_or_an_adapter_is_caught(tmp_path: Path) -> None:
    files = _planted(tmp_path, {
        "leasecore.lease": "import threading\nfrom leasecore.runner.loop import runner\n",
        "leasecore.models": "def f():\n    import requests\n",
        "leasecore.backoff": "import time\n",
        "leasecore.errors": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import socket\n",
        "leasecore.runner.loop.runner": "",
    })
    found = pure_violations(files)
    assert "leasecore.lease imports threading (threading)" in found
    assert ("leasecore.lease imports leasecore.runner.loop.runner (adapter leasecore.runner.loop.runner)"
            in found)
    assert "leasecore.models imports requests (requests)" in found
    assert "leasecore.backoff imports time (time)" in found
    assert not any(v.startswith("leasecore.errors") for v in found)  # TYPE_CHECKING never runs


def test_rich_below_cli_is_caught(tmp_path: Path) -> None:
    files = _planted(tmp_path, {
        "leasecore.runner.wiring": "from rich.console import Console\n",
        "cli.x": "import rich\n",
    })
    assert cli_library_violations(files) == ["leasecore.runner.wiring imports rich.console"]


def test_a_cycle_is_caught(tmp_path: Path) -> None:
    files = _planted(tmp_path, {
        "leasecore.a": "from leasecore import b\n",
        "leasecore.b": "from . import c\n",
        "leasecore.c": "import leasecore.a\n",
    })
    cycle = find_cycle(_package_edges(graph(files)))
    assert cycle == ["leasecore.a", "leasecore.b", "leasecore.c", "leasecore.a"]


def test_a_cycle_closed_by_a_type_only_import_is_caught(tmp_path: Path) -> None:
    files = _planted(tmp_path, {
        "leasecore.a": "from leasecore import b\n",
        "leasecore.b": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from leasecore import a\n",
    })
    assert find_cycle(_package_edges(graph(files))) is None  # at run time there is none
    cycle = find_cycle(_package_edges(graph(files, type_only_too=True)))
    assert cycle == ["leasecore.a", "leasecore.b", "leasecore.a"]
