"""The README's conformance table, made from the matrix's results (build/conformance/*.json, written by tests/test_conformance.py).

``python tests/conformance_table.py`` rewrites the table between the README's two markers;
:func:`readme_is_current` tells whether it is what the results give. A cell reads ✓ (trains
what one process trains, float64, within 1e-9), "refused: <why>" (a ConfigError before any
rank starts, shortened to its first clause), or ✗ (a difference or a crash: the test fails).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from library_models import ARCHITECTURES  # noqa: E402
from test_conformance import LAYOUT_NAMES, RESULTS, TOLERANCE  # noqa: E402

README = TESTS.parent / "README.md"
BEGIN, END = "<!-- conformance-matrix:begin -->", "<!-- conformance-matrix:end -->"


def _cell(row: dict) -> str:
    if "refused" in row:
        reason = re.split(r"[:;(]", row["refused"], maxsplit=1)[0].strip()
        return f"refused: {reason[:70]}"
    if "crashed" in row or row.get("untied") or row.get("worst", 1.0) > TOLERANCE:
        return "✗"
    return "✓"


def table() -> str:
    """The markdown table of every architecture's row, from the results on disk."""
    lines = [
        "| model | library | what it is | " + " | ".join(LAYOUT_NAMES) + " |",
        "|" + "---|" * (len(LAYOUT_NAMES) + 3),
    ]
    for architecture in ARCHITECTURES:
        path = RESULTS / f"{architecture.name}.json"
        rows = {row["cell"]: row for row in json.loads(path.read_text())} if path.exists() else {}
        cells = [_cell(rows[layout]) if layout in rows else "not run" for layout in LAYOUT_NAMES]
        lines.append(
            f"| {architecture.name} | {architecture.library} | {architecture.kind} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _current() -> tuple[str, str]:
    text = README.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].strip(), text


def readme_is_current() -> bool:
    return _current()[0] == table()


def main() -> None:
    old, text = _current()
    README.write_text(text.replace(old, table()) if old else text.replace(BEGIN, BEGIN + "\n" + table() + "\n"))
    print(f"wrote the conformance table into {README}")


if __name__ == "__main__":
    main()
