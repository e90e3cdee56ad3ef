"""notebooks/06-autotune.ipynb runs headless through papermill with a small space."""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.notebook
def test_autotune_notebook_runs(tmp_path: Path) -> None:
    out = tmp_path / "06-autotune.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "06-autotune.ipynb"), str(out),
        parameters={"preset": "tiny", "batch": 4, "repetitions": 2},
        kernel_name="python3", cwd=str(NOTEBOOKS), progress_bar=False,
    )
    nb = nbformat.read(out, as_version=4)
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "space counts:" in text and "best:" in text
    assert "measured on the second tuning: 0" in text
    assert "outputs and input gradients match" in text
    assert "speedup" in text
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 3  # time vs parameters, best per candidate, training step
