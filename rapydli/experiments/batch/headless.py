"""What the processes that only execute notebooks (batch items, their kernels, ``rapydli batch``) go without.

nbformat imports jsonschema, and jsonschema imports ``rfc3987_syntax`` (installed with
jupyter-events) for its IRI format checks, which compiles a grammar at import: 3-5 s of
CPU. nbformat's notebook validation checks no formats, yet every process that reads or
writes a notebook pays it, and so does every kernel the first time it shows a plotly
figure (plotly's renderer imports nbformat to check its version). The processes RaPyDLI
starts only to execute notebooks mark the module as not importable
(:func:`skip_unused_imports`, and :data:`SKIP_LINE` for the kernels they start), so
jsonschema leaves those format checks out there. A user's own kernel and process are
left as they are.
"""

from __future__ import annotations

import sys

#: Imported by jsonschema for IRI formats only; never used by notebook execution.
SKIPPED = "rfc3987_syntax"

#: The line (a kernel's ``IPKernelApp.exec_lines``) that skips it in a kernel RaPyDLI starts headless;
#: it leaves no name in the notebook's namespace and prints nothing.
SKIP_LINE = f"__import__('sys').modules.setdefault({SKIPPED!r}, None)"


def skip_unused_imports() -> None:
    """Mark :data:`SKIPPED` as not importable in this process (a module imported already stays)."""
    sys.modules.setdefault(SKIPPED, None)  # type: ignore[arg-type]  # None: "not importable"
