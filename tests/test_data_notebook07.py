"""notebooks/07-data-loading.ipynb runs headless through papermill on a small dataset."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
def test_data_loading_notebook_runs(tmp_path: Path) -> None:
    executed = execute("07-data-loading.ipynb", tmp_path, samples=400, epochs=2, latency_ms=0.5)
    text = executed.text
    assert "400 samples" in text and "shard-00000.lmdb" in text
    assert "identical parameters: True" in text
    assert "plan (samples per tier): {'ram': 100, 'disk': 0, 'storage': 300}" in text, [
        line for line in text.splitlines() if "plan" in line
    ]
    figures = executed.figures
    assert len(figures) == 2
    assert executed.html_figures() == 2  # also drawn outside JupyterLab (nbconvert's HTML), not only plotly's MIME type
    hits = figures[0]["data"]["application/vnd.plotly.v1+json"]["data"]
    assert {trace["name"] for trace in hits} == {"ram", "disk", "storage"}
