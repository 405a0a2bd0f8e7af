"""docs/cli.md's table of exit codes names exactly the codes of cli/exitcodes.py: a code added to one
and not the other is a reader told nothing (or told of a code that never comes)."""

from __future__ import annotations

import re
from pathlib import Path

from cli import exitcodes

ROOT = Path(__file__).resolve().parents[2]


def documented_codes(page: str) -> set[int]:
    section = page.split("\n## Exit codes\n", 1)[1].split("\n## ", 1)[0]
    codes: set[int] = set()
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("|") and re.fullmatch(r"\d+( / \d+)*", cells[0]):
            codes.update(int(code) for code in cells[0].split(" / "))
    return codes


def test_the_exit_code_table_of_the_docs_matches_the_module() -> None:
    defined = {value for name, value in vars(exitcodes).items() if name.isupper() and isinstance(value, int)}
    assert len(defined) >= 10  # the module was read
    assert documented_codes((ROOT / "docs" / "cli.md").read_text()) == defined


def test_a_row_missing_from_the_table_is_seen() -> None:
    page = (ROOT / "docs" / "cli.md").read_text()
    without_seven = "\n".join(line for line in page.splitlines() if not line.startswith("| 7 |"))
    assert 7 in documented_codes(page)
    assert 7 not in documented_codes(without_seven)
