"""notebooks/07-data-loading.ipynb runs headless through papermill on a small dataset."""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.notebook
def test_data_loading_notebook_runs(tmp_path: Path) -> None:
    out = tmp_path / "07-data-loading.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "07-data-loading.ipynb"),
        str(out),
        parameters={"samples": 400, "epochs": 2, "latency_ms": 0.5},
        kernel_name="python3",
        cwd=str(NOTEBOOKS),
        progress_bar=False,
    )
    nb = nbformat.read(out, as_version=4)
    outputs = [output for cell in nb.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    text = "\n".join(output.get("text", "") for output in outputs)
    assert "400 samples" in text and "shard-00000.lmdb" in text
    assert "identical parameters: True" in text
    assert "plan (samples per tier): {'ram': 100, 'disk': 0, 'storage': 300}" in text
    figures = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(figures) == 2
    hits = figures[0]["data"]["application/vnd.plotly.v1+json"]["data"]
    assert {trace["name"] for trace in hits} == {"ram", "disk", "storage"}
