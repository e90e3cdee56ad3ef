"""The README's tour ("A tour" and "Training") runs as written, as a notebook on a 2-engine local cluster."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import papermill
import pytest

import rapydli as rd

README = Path(__file__).resolve().parents[1] / "README.md"
SECTIONS = ("A tour", "Training")
PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"


def readme_blocks(readme: Path = README, sections: tuple[str, ...] = SECTIONS) -> list[str]:
    """The ```python blocks of the README's ``## <section>`` parts, in order, as written."""
    text = readme.read_text()
    blocks = []
    for title in sections:
        match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
        assert match, f"README has no '## {title}' section"
        blocks += [
            block.strip("\n") for block in re.findall(r"^```python\n(.*?)^```", match.group(1), flags=re.S | re.M)
        ]
    return blocks


def test_the_tour_has_the_blocks_a_new_user_runs() -> None:
    blocks = readme_blocks()
    assert blocks[0].startswith("%load_ext rapydli") and "%rapydli start -n 2" in blocks[0]
    assert blocks[1].startswith("%%distributed")
    assert any("rd.train(" in block for block in blocks)


@pytest.mark.notebook
@pytest.mark.engines
def test_readme_tour_runs_as_a_notebook(tmp_path: Path) -> None:
    # The README's blocks as written (its 3 epochs of resnet_digits are ~80 steps: no override
    # needed), then one cell that is not the README's: stop the cluster the tour started.
    cells = [nbformat.v4.new_code_cell(block) for block in readme_blocks()]
    cells.append(nbformat.v4.new_code_cell("%rapydli stop"))
    nbformat.write(
        nbformat.v4.new_notebook(cells=cells), tmp_path / "tour.ipynb"
    )  # no kernel metadata, as a new user's

    before = len(rd.runs(kind="train"))
    papermill.execute_notebook(
        str(tmp_path / "tour.ipynb"),
        str(tmp_path / "out.ipynb"),
        kernel_name="python3",
        language="python",
        cwd=str(tmp_path),
        progress_bar=False,
    )
    executed = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    outputs = [o for cell in executed.cells for o in cell.get("outputs", [])]
    text = "\n".join(o.get("text", "") for o in outputs)
    assert "[rank 0] rank 0 of 2" in text and "[rank 1] rank 1 of 2" in text

    # three runs, all finished: the tour's resnet_digits on its 2 engines, the restarts example on them,
    # and that run continued on 1 rank
    runs = rd.runs(kind="train").iloc[: len(rd.runs(kind="train")) - before]
    assert len(runs) == 3 and (runs["status"] == "finished").all()
    assert sorted(runs["world_size"]) == [1, 2, 2]
    tour = [rd.run(run_id).params["config"] for run_id in runs["id"] if rd.run(run_id).params["config"]["epochs"] == 3]
    assert [(c["lr"], c["allreduce"], c["bucket_mb"]) for c in tour] == [(0.05, "ring", 1.0)]

    # what the saved tour shows outside JupyterLab: rd.train's final plot and a finished progress bar
    figures = [o for o in outputs if PLOTLY in o.get("data", {})]
    assert figures and all(o["data"]["image/png"] for o in figures)  # their PNG beside plotly's JSON
    bars = [
        o["data"]["text/plain"]
        for o in outputs
        if WIDGET in o.get("data", {}) and "train" in o["data"].get("text/plain", "")
    ]
    assert bars and "100%" in bars[0], bars
