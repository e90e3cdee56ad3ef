"""notebooks/06-autotune.ipynb runs headless through papermill with a small space."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
def test_autotune_notebook_runs(tmp_path: Path) -> None:
    executed = execute("06-autotune.ipynb", tmp_path, preset="tiny", batch=4, repetitions=2)
    text = executed.text
    assert "space counts:" in text and "best:" in text
    assert "measured on the second tuning: 0" in text
    assert "outputs and input gradients match" in text
    assert "speedup" in text
    figures = executed.figures
    assert len(figures) == 3  # time vs parameters, best per candidate, training step
