"""Mistakes in the user's own notebook code, as the user reads them in the cell: one error for every rank that made it,
the notebook's cells named as IPython names them (``Cell In[3], line 3``), RaPyDLI's frames folded away, at most 20 lines.

The notebook (tests/notebooks/user_mistakes.ipynb) runs under plain papermill on 2 and 4 engines.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import papermill
import pytest

NOTEBOOK = Path(__file__).resolve().parent / "notebooks" / "user_mistakes.ipynb"


def _mistakes(text: str) -> dict[str, str]:
    found = re.findall(r"MISTAKE (.+?) START\n(.*?)MISTAKE \1 END", text, flags=re.S)
    return {name: said.strip() for name, said in found}


@pytest.mark.engines
@pytest.mark.notebook
@pytest.mark.parametrize("ranks", [2, 4])
def test_a_mistake_in_the_users_code_is_one_short_error_naming_the_cell(tmp_path: Path, ranks: int) -> None:
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOK),
        str(out),
        parameters={"ranks": ranks},
        kernel_name="python3",
        cwd=str(tmp_path),
        progress_bar=False,
    )
    cells = nbformat.read(out, as_version=4).cells
    text = "\n".join(o.get("text", "") for c in cells if c.cell_type == "code" for o in c.get("outputs", []))
    said = _mistakes(text)
    assert set(said) == {"typo in model_fn", "raise in data_fn", "wrong loss shape", "a dataset instead of a pair"}, (
        text
    )
    everyone = ", ".join(map(str, range(ranks)))
    for mistake, error in said.items():
        assert len(error.splitlines()) <= 20 and "ipykernel_" not in error and "rapydli/" not in error, (mistake, error)
        assert error.count("Traceback") == 0 and error.count("--- rank") <= 1, (mistake, error)
    assert said["typo in model_fn"].startswith(f"RankFailure: ranks {everyone} raised the same exception"), said
    count = {
        name: next(c.execution_count for c in cells if c.source.startswith(f"def {name}("))
        for name in ("model_fn", "data_fn")
    }
    assert re.search(
        rf"Cell In\[{count['model_fn']}\], line 3, in model_fn\(\)\n.*\n.*\n----> 3     return nett",
        said["typo in model_fn"],
    ), said
    assert "NameError: name 'nett' is not defined" in said["typo in model_fn"]
    assert re.search(rf"Cell In\[{count['data_fn']}\], line 2, in data_fn\(\)", said["raise in data_fn"]), said
    assert "ValueError: no data here" in said["raise in data_fn"]
    assert said["wrong loss shape"].startswith(
        "OutputError: loss_fn per_sample_loss returned a tensor of shape (8,)"
    ), said
    assert said["a dataset instead of a pair"].startswith(
        "UserCodeError: data_fn one_dataset returned a TensorDataset"
    ), said
