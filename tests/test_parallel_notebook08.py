"""Notebook 08 runs headless under papermill: tiny_lm in 2 stages x 2 replicas, its live and final timeline, the comparison table,
and a GPT-2-shaped model in 2 stages x 2 tensor ranks verified against one process."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notebooks_run import executed_tour
from offline_html import PLOTLY


@pytest.mark.tour
@pytest.mark.notebook
@pytest.mark.engines
def test_hybrid_parallelism_notebook(tmp_path: Path) -> None:
    executed = executed_tour("08-hybrid-parallelism.ipynb", tmp_path)
    assert "bubble measured" in executed.text and "theory 20.0%" in executed.text  # (p - 1) / (m + p - 1), p=2, m=4
    # the gap between measured and theory split into the stages' imbalance and the rest, from this step's numbers
    text = executed.text
    imbalance = float(re.search(r"accounts for ([+-]\d+\.\d)%", text).group(1))
    rest = float(re.search(r"everything else between the stages: ([+-]\d+\.\d)%", text).group(1))
    measured = float(re.search(r"bubble measured (\d+\.\d)%", text).group(1))
    assert abs(20.0 + imbalance + rest - measured) <= 0.15, text  # the parts add up to what was measured (rounding)
    titles = [figure["data"][PLOTLY]["layout"].get("title", {}).get("text", "") for figure in executed.figures]
    # the live plot, the live timeline (left as a static figure: its last step), result.timeline()
    assert len(titles) == 3, titles
    timelines = [title for title in titles if "bubble measured" in title]
    assert len(timelines) == 2 and all(title.startswith("step 12, replica 0: 1f1b, p=2, m=4") for title in timelines), (
        titles
    )
    # memory measured on every engine: a row per rank of each run
    lines = executed.text.splitlines()
    assert any("peak_activation_bytes" in line for line in lines)
    rows = [line.split() for line in lines]
    assert sum(row[:1] == ["pipeline"] and row[1].isdigit() for row in rows) == 4
    assert sum(row[:2] == ["data", "parallel"] and row[2].isdigit() for row in rows) == 4
    html = "\n".join(str(o.get("data", {}).get("text/html", "")) for o in executed.outputs)
    assert "pipeline 2 stages x 2 replicas" in html and "data parallel, 4 ranks" in html
    # the GPT-2-shaped model as written (no pipeline_blocks(): traced, its own loss on the last stage; Conv1D, fused c_attn,
    # tied embedding split by vocabulary rows) in 2 stages x 2 tensor ranks
    assert "['transformer.wte', 'transformer.h.0', 'transformer.h.1', 'transformer.ln_f', 'lm_head']" in text, text
    assert re.search(
        r"trains the one-process model: all \d+ parameters within 1e-09 .* after 3 steps in float64", text
    ), text
    assert "transformer.wte.weight" in html and "transformer.h.0.attn.c_attn.weight" in html
