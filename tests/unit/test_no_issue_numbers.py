"""No issue numbers of this project in code, tests or docs: the reason stands where a number stood.

A number says nothing to a reader without the tracker at hand, and what it pointed at drifts; so a
comment, docstring, help text, test name or doc page gives the reason in words instead. Citations of
other projects keep their form ``owner/repo#N`` (for example a Conductor server's issue), which this
allows: the number is then preceded by the repository's name, not by a space or a bracket.

What counts as one of ours: a ``#`` and 1-4 digits at the start of a line or after a space, an opening
bracket, a comma or a semicolon (so neither ``owner/repo#N`` nor a colour such as ``"#333"`` nor an
HTML entity), or the word issue (any case, plural too) followed by a number, with a space, an underscore
(a test's name) or a hash between or nothing. One legitimate use is let through by its shape: the
source label of a config file's array table, ``[[task]]`` followed by its position, as the product
prints it. The walker is also run on planted files, so a walker that reads nothing fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Everything the project writes: code, tests, the bench, scripts, deployment files and the docs site.
SCANNED = ("leasecore", "cli", "tests", "bench", "scripts", "deploy", "docs", "sample_tasks", ".ci",
           "README.md", "mkdocs.yml", "pyproject.toml", "conductor.toml.example")
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache", "site",
                "node_modules", "build", "dist"}
MAX_BYTES = 2_000_000  # no file of ours is near this; a bigger one would be a generated artefact

HASH_NUMBER = re.compile(r"#\d{1,4}\b")
BEFORE_OURS = " \t\n\r([,;"  # what may stand before one of ours (nothing too: a line's start)
ISSUE_WORD = re.compile(r"(?<![a-z])issues?[ _]?#?\d+", re.IGNORECASE)
# ``[[task]] #2``: which of a file's ``[[task]]`` tables a message is about (the product's own label).
TABLE_LABEL = re.compile(r"\]\] $")


def _files(root: Path, entries: tuple[str, ...]) -> list[Path]:
    found = []
    for entry in entries:
        top = root / entry
        if top.is_file():
            found.append(top)
        elif top.is_dir():
            for path in sorted(top.rglob("*")):
                rel_parts = path.relative_to(root).parts
                if path.is_file() and not SKIPPED_DIRS.intersection(rel_parts) and not any(
                        part.endswith(".egg-info") for part in rel_parts):
                    found.append(path)
    return found


def _ours(text: str, match: re.Match[str]) -> bool:
    return match.start() == 0 or text[match.start() - 1] in BEFORE_OURS


def issue_numbers(root: Path, entries: tuple[str, ...] = SCANNED) -> tuple[int, list[str]]:
    """(files read, ``path:line: text`` of each issue number found)."""
    read, hits = 0, []
    for path in _files(root, entries):
        if path.stat().st_size > MAX_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file (an image): no prose in it
        read += 1
        if not any(_ours(text, m) for m in HASH_NUMBER.finditer(text)) and not ISSUE_WORD.search(text):
            continue  # the common case, without splitting the file into lines
        for number, line in enumerate(text.splitlines(), 1):
            bad = [m for m in HASH_NUMBER.finditer(line)
                   if _ours(line, m) and not TABLE_LABEL.search(line[:m.start()])]
            bad += list(ISSUE_WORD.finditer(line))
            if bad:
                hits.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return read, hits


def test_no_issue_number_in_code_tests_or_docs() -> None:
    read, hits = issue_numbers(ROOT)
    assert read > 300, read  # the walk saw the tree (code, tests and docs together are several hundred)
    assert hits == [], "write the reason instead of the issue number:\n" + "\n".join(hits)


HASH = "#"  # the planted texts are put together here, so that this file holds no number of its own


@pytest.mark.parametrize("line", [
    f"# the lease core ({HASH}17)",
    f"{HASH}23: each final update claims the next task",
    f"a lean start, {HASH}23",
    f"see [{HASH}9]",
    "the wiring of issue " + "19",
    "Issue " + HASH + "2's case",
    "def test_issue_" + "19_limits():",
])
def test_a_planted_issue_number_is_found(tmp_path: Path, line: str) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(f"Some text.\n{line}\n", encoding="utf-8")
    assert issue_numbers(tmp_path, ("docs",)) == (1, [f"docs/page.md:2: {line.strip()}"])


@pytest.mark.parametrize("line", [
    "fixed upstream in Netflix/conductor" + HASH + "1860",
    "(conductor-oss/conductor" + HASH + "1562)",
    'color: "' + HASH + '333"',
    "it&" + HASH + "39;s",
    "config.toml: [[task]] " + HASH + "2: the key command is missing",
    "a 1000-task run, 2 issues with it",
])
def test_citations_colours_and_table_labels_are_not_issue_numbers(tmp_path: Path, line: str) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text(f"{line}\n", encoding="utf-8")
    (tmp_path / "docs" / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")  # skipped, not a crash
    assert issue_numbers(tmp_path, ("docs",)) == (1, [])
