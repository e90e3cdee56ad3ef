"""Notebook 03 (live training, the hyperparameter panel, a pruned 2-rank sweep, the sweep panel) runs headless."""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03-hyperparameters-and-sweeps.ipynb"


@pytest.mark.notebook
@pytest.mark.engines
def test_hyperparameters_and_sweeps_notebook(tmp_path: Path) -> None:
    out = tmp_path / "03-out.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), cwd=str(NOTEBOOK.parent), kernel_name="python3", progress_bar=False)
    cells = nbformat.read(out, as_version=4).cells
    outputs = [o for c in cells if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "run 1 finished after" in text
    assert "TrainConfig.momentum=1.0 is invalid" in text  # shown by the panel, not raised
    assert "stopped after" in text and "every rank stopped early: True" in text
    assert "'PRUNED'" in text and "best parameters: {'lr': 0.01" in text
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) >= 4  # live training plot (as a static figure), panel plot, sweep, sweep panel
