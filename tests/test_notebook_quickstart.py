"""notebooks/01-quickstart.ipynb runs headless through papermill, as `make demo` runs it."""

import pytest
from notebooks_run import execute

import rapydli as rd


@pytest.mark.notebook
@pytest.mark.engines
def test_quickstart_runs(tmp_path, capfd):
    executed = execute("01-quickstart.ipynb", tmp_path, workers=2, epochs=12)
    text = executed.text
    printed = capfd.readouterr()
    # as `make demo` shows. Plain papermill's kernel says two things itself, not ours: "without encryption", and on a
    # loaded machine "KeyboardInterrupt caught in kernel" (jupyter_client interrupts a kernel it shuts down)
    shown = "\n".join(
        line for line in (printed.out + printed.err).splitlines() if "KeyboardInterrupt caught in kernel" not in line
    )
    for noise in ("Monitor message without topic", "KeyboardInterrupt"):
        assert noise not in shown + text, noise
    assert "[rank 0] hello from rank 0 of 2" in text
    assert "[rank 1] hello from rank 1 of 2" in text
    assert "final test accuracy" in text
    assert "validation accuracy" in text  # the closing rd.train cell, on the notebook's own cluster
    runs = rd.runs(kind="train")
    assert len(runs) >= 1 and runs.iloc[0]["status"] == "finished" and runs.iloc[0]["world_size"] == 2
    figures = executed.figures
    assert len(figures) == 2  # the hand-written loop's curves, then rd.train's loss
    # readable outside JupyterLab (as make demo's outputs/01-quickstart.ipynb): a PNG beside plotly's JSON,
    # shown by nbconvert's HTML (execute() opened it offline in Chromium too); no plotly.js in the notebook
    assert executed.html_figures() == len(figures)
    assert not any("text/html" in figure["data"] for figure in figures)
    # small enough for GitHub and a paper's attachment: no live widget's state (~5 MB of JavaScript each)
    assert executed.size < 1_000_000, executed.size
