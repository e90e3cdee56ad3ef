"""notebooks/01-quickstart.ipynb runs headless through papermill, as `make demo` runs it."""

from pathlib import Path

import nbformat
import papermill
import pytest

import rapydli as rd

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.notebook
@pytest.mark.engines
def test_quickstart_runs(tmp_path):
    out = tmp_path / "01-quickstart.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "01-quickstart.ipynb"),
        str(out),
        parameters={"workers": 2, "epochs": 12},
        kernel_name="python3",
        cwd=str(NOTEBOOKS),
        progress_bar=False,
    )
    nb = nbformat.read(out, as_version=4)
    text = "\n".join(
        output.get("text", "") for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
    )
    assert "[rank 0] hello from rank 0 of 2" in text
    assert "[rank 1] hello from rank 1 of 2" in text
    assert "final test accuracy" in text
    assert "validation accuracy" in text  # the closing rd.train cell, on the notebook's own cluster
    runs = rd.runs(kind="train")
    assert len(runs) >= 1 and runs.iloc[0]["status"] == "finished" and runs.iloc[0]["world_size"] == 2
    figures = [
        output
        for cell in nb.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "application/vnd.plotly.v1+json" in output.get("data", {})
    ]
    assert len(figures) == 2  # the hand-written loop's curves, then rd.train's loss
