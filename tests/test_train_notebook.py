"""Notebook 02 runs headless under papermill and reaches its stated accuracy."""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "02-distributed-training.ipynb"


@pytest.mark.notebook
@pytest.mark.engines
def test_distributed_training_notebook(tmp_path: Path) -> None:
    out = tmp_path / "02-out.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), cwd=str(NOTEBOOK.parent), kernel_name="python3", progress_bar=False)
    executed = nbformat.read(out, as_version=4)
    text = "\n".join(
        output.get("text", "") for cell in executed.cells if cell.cell_type == "code" for output in cell.get("outputs", [])
    )
    assert "final validation accuracy on 2 ranks" in text
    accuracy = float(text.split("final validation accuracy on 2 ranks: ")[1].split()[0])
    assert accuracy >= 0.95
    figures = [
        output
        for cell in executed.cells
        for output in cell.get("outputs", [])
        if "application/vnd.plotly.v1+json" in output.get("data", {})
    ]
    assert figures, "the loss curve was not saved in the executed notebook"
