"""Notebook 11 runs headless under papermill: a model whose parameters are more than a rank may hold is refused where it
cannot fit, planned to fit, trained, and measured on every rank never built whole against built whole."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notebooks_run import executed_tour


@pytest.mark.tour
@pytest.mark.notebook
@pytest.mark.engines
def test_bigger_than_a_rank_notebook(tmp_path: Path) -> None:
    executed = executed_tour("11-bigger-than-a-rank.ipynb", tmp_path)
    text = executed.text
    model, limit = map(
        float, re.search(r"the model: ([\d.]+) MiB of fp32 parameters; a rank may hold ([\d.]+) MiB", text).groups()
    )  # type: ignore[union-attr]
    assert limit < model
    for zero in (0, 2):  # each refused before anything started, naming what would fit
        assert re.search(rf"zero={zero}: refused: memory_per_rank=[\d.]+ MiB is too small for 4 ranks", text), text
    best = re.search(r"best: (dp\d pp\d tp\d .*?zero\d)", text).group(1)  # type: ignore[union-attr]
    assert re.search(rf"{re.escape(best)}: 4 steps, loss [\d.]+ -> [\d.]+", text), text
    never = re.search(
        r"never built whole: peak growth per rank [\d.]+-([\d.]+) MiB, under the limit on every rank: (True|False)",
        text,
    )
    whole = re.search(r"built whole first: ([\d.]+)-[\d.]+ MiB, under the limit on every rank: (True|False)", text)
    assert never and whole, text
    assert never.group(2) == "True" and whole.group(2) == "False", (
        text
    )  # the model fits only because no rank ever builds it whole
    assert "trained a model bigger than one rank's memory on 4 engines" in text
