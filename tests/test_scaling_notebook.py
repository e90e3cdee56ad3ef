"""Notebook 04 (scaling study with the alpha-beta prediction) runs headless and keeps its figures."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
@pytest.mark.engines
def test_scaling_notebook(tmp_path: Path) -> None:
    executed = execute("04-scaling.ipynb", tmp_path, steps=12)
    text = executed.text
    validated = re.search(r"prediction within 20% of measurement at every measured count: (True|False)", text).group(1)
    errors = [
        abs(int(e))
        for e in re.findall(r"worker\(s\): measured step [\d.]+ ms, predicted [\d.]+ ms \(([+-]\d+)%\)", text)
    ]
    assert errors, text
    # "False" is explained: a point missed by more than 20 %, or a note says the steps were too noisy to check
    assert validated == "True" or max(errors) > 20 or "note: not validated" in text, text
    assert "ring model: α =" in text and "predicted efficiency at 1024 workers" in text
    figures = executed.figures
    assert len(figures) >= 3  # weak, strong, target network; static, so kept in the saved notebook
    names = {t.get("name", "") for f in figures for t in f["data"]["application/vnd.plotly.v1+json"]["data"]}
    assert "ideal" in names and any(n.startswith("predicted (α =") for n in names)
