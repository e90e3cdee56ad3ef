"""notebooks/06-autotune.ipynb runs headless through papermill with a small space."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
def test_autotune_notebook_runs(tmp_path: Path) -> None:
    # a small budget and model keep the suite fast; the notebook's defaults tune the 64-wide model for 60 s
    executed = execute("06-autotune.ipynb", tmp_path, preset="tiny", batch=4, repetitions=2, budget_s=10.0, width=8)
    text = executed.text
    assert "space counts:" in text and "best:" in text
    assert "measured on the second tuning: 0" in text
    assert "outputs and input gradients match" in text
    assert "speedup" in text and "skipped by the budget:" in text and "(budget 10 s): profile" in text
    assert "autotune: " in text  # the tuning's one-line summary
    figures = executed.figures
    assert len(figures) == 4  # time vs parameters, best per candidate, where the tuning time went, training step
