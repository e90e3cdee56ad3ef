"""Notebook 08 runs headless under papermill: 2 stages x 2 replicas, its timeline and the comparison table."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
@pytest.mark.engines
def test_hybrid_parallelism_notebook(tmp_path: Path) -> None:
    executed = execute("08-hybrid-parallelism.ipynb", tmp_path)
    assert "bubble measured" in executed.text and "theory 20.0%" in executed.text  # (p - 1) / (m + p - 1), p=2, m=4
    assert len(executed.figures) == 1
    html = "\n".join(str(o.get("data", {}).get("text/html", "")) for o in executed.outputs)
    assert "pipeline 2 stages x 2 replicas" in html and "data parallel, 4 ranks" in html
