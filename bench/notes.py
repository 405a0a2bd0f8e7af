"""``python -m bench.notes [--out DIR] NOTE...``: add notes to results/latest.json, re-render latest.md.

For what a run's numbers cannot say by themselves (what limits a missed target, the load on the
machine while it ran). The figures are never edited: the Markdown is rendered from the JSON again.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import report

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.notes", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS, help="where latest.json / latest.md are")
    parser.add_argument("notes", nargs="+", help="one note per argument, appended in order")
    args = parser.parse_args(argv)
    path = args.out / "latest.json"
    results = json.loads(path.read_text())
    results.setdefault("notes", []).extend(args.notes)
    path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (args.out / "latest.md").write_text(report.render(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
