"""notebooks/06-autotune.ipynb runs headless through papermill with a small space; as committed it tunes for 60 s."""

from __future__ import annotations

import ast
import html
import re
from pathlib import Path

import nbformat
import pytest
from notebooks_run import NOTEBOOKS, execute

NOTEBOOK = "06-autotune.ipynb"


@pytest.mark.notebook
def test_autotune_notebook_runs(tmp_path: Path) -> None:
    # a small budget and model keep the suite fast (the committed 60 s on the 64-wide model would add about
    # 1.5 minutes to a suite near 21 of its 25); the test below checks that 60 s is what a user runs
    executed = execute(
        NOTEBOOK, tmp_path, preset="tiny", model_preset="tiny", batch=4, repetitions=2, budget_s=10.0, width=8
    )
    text = executed.text
    assert "space counts:" in text
    # the best of each tuning: claimed only where its timed runs all beat the runner-up's, else said to overlap
    verdicts = re.findall(r"^(?:best|fastest median): .*$", text, re.M)
    assert len(verdicts) == 2, text[:3000]
    assert all(v.startswith("best: ") == ("no difference measurable" not in v) for v in verdicts), verdicts
    # the second tuning measures only what other work disturbed the first time (the notebook asserts that count);
    # on a quiet machine nothing, beside a busy test suite some
    still = re.search(r"still disturbed: (.*)", text).group(1)  # type: ignore[union-attr]
    again = int(re.search(r"measured on the second tuning: (\d+)", text).group(1))  # type: ignore[union-attr]
    assert (again == 0) == (still == "none"), (again, still)
    assert "outputs and input gradients match" in text
    assert "speedup" in text and "skipped by the budget:" in text and "(budget 10 s): profile" in text
    assert "autotune: " in text  # the tuning's one-line summary
    # the step speedup with its rounds, and a conclusion those rounds support (no "faster" inside a spread over 1)
    low, high = map(float, re.search(r"speedup \d+\.\d+x \((\S+) to (\S+) over 7 rounds, load", text).groups())
    conclusion = (
        "the tuned model is faster in every round"
        if low > 1
        else "the tuned model is slower in every round"
        if high < 1
        else "no difference shown: the speedup is not distinguishable from 1"
    )
    assert conclusion in text, text[-2000:]
    figures = executed.figures
    assert len(figures) == 4  # time vs parameters, best per candidate, where the tuning time went, training step
    assert executed.html_figures() == 4  # also drawn outside JupyterLab (nbconvert's HTML)
    # the progress bar as the notebook saved it: the model's 20 layers done, configurations timed, best speedup
    bar = [html.unescape(t).replace("\u2007", " ") for t in executed.widget_texts]  # tqdm pads with figure spaces
    counts = [m for t in bar if (m := re.search(r"(\d+)/(\d+) \[.*timed (\d+), best (\d+\.\d+x|-)\]", t))]
    assert counts, bar
    done, total, timed, best = counts[-1].groups()
    assert done == total == "20"
    # a best speedup once anything was timed (on a machine too busy for the budget's check, nothing is: "timed 0")
    assert (int(timed) > 0) == (best != "-"), bar
    assert any(t.startswith("autotune: ") for t in bar)  # its description: the phase it ended in


def test_the_committed_notebook_tunes_resnet18_shaped_within_60_s() -> None:
    cell = next(
        c for c in nbformat.read(NOTEBOOKS / NOTEBOOK, as_version=4).cells if "parameters" in c.metadata.get("tags", [])
    )
    values = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in ast.parse(cell.source).body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
    }
    assert values["budget_s"] == 60.0 and values["width"] == 64 and values["batch"] == 8
