"""A model, loss and data defined in a notebook train on real engines under papermill, match torch
DDP and one process, are recorded with their source, and a failure in them shows the notebook cell's line."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOK = Path(__file__).resolve().parent / "notebooks" / "own_model.ipynb"


@pytest.mark.timeout(600)
@pytest.mark.notebook
@pytest.mark.engines
def test_notebook_defined_model_trains_and_its_error_shows_the_cell(tmp_path: Path) -> None:
    out = tmp_path / NOTEBOOK.name
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(out),
        kernel_name="python3",
        cwd=str(tmp_path),
        progress_bar=False,
        parameters={"tests_dir": str(NOTEBOOK.parents[1])},
    )
    cells = nbformat.read(out, as_version=4).cells
    text = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "notebook model on 2 ranks vs one process: max difference" in text
    # the same class under torch DDP (gloo, find_unused_parameters=True) on the same 2 mpiexec ranks
    assert float(text.split("notebook model on 2 ranks vs torch DDP: max difference ")[1].split()[0]) < 2e-5
    assert (
        float(text.split("unused head moved by ")[1].split()[0]) == 0.0
    )  # no gradient: weight decay leaves it alone too
    recorded = text.split("recorded sources: ")[1].splitlines()[0].split(", ")
    assert {"Net", "Sizes", "make_activation", "data_fn", "scaled_cross_entropy.<locals>.loss"} <= set(recorded), (
        recorded
    )
    failure = text.split("FAILURE TEXT START")[1].split("FAILURE TEXT END")[0]
    # once for both ranks, the notebook's cell named as IPython names it, RaPyDLI's and torch's frames folded away
    assert failure.strip().startswith(
        "ranks 0, 1 raised the same exception\n--- ranks 0, 1 (error) ---\nin your code"
    ), failure
    assert re.search(r"Cell In\[\d+\], line \d+, in Broken.forward", failure) and "ipykernel_" not in failure, failure
    assert 'raise RuntimeError("broken in the notebook")' in failure and "failure.details()" in failure, failure
    assert failure.index("hidden = self.conv(x)") < failure.index("RuntimeError: broken in the notebook"), failure
    assert "rapydli/trainer" not in failure and len(failure.strip().splitlines()) <= 20, failure
