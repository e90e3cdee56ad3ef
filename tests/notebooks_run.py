"""Running a notebook of ``notebooks/`` as users run it, with plain papermill, and reading its outputs.

Every executed tour notebook is checked as it would be shared (:func:`offline_html.sharing_problems`):
at most :data:`~offline_html.TOUR_NOTEBOOK_BYTES`, every figure carrying its PNG, and every figure
visible in its nbconvert HTML opened offline in Chromium."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import papermill
from offline_html import figure_outputs, sharing_problems
from processes import session_cluster_pids

from rapydli.cluster.processes import CLUSTER_MARKER, reap_marked

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"


class Executed:
    """The outputs of an executed notebook: every code cell's, their printed text, the plotly figures, and the
    last state of its text widgets (a tqdm bar's description and counts, saved in the notebook's metadata)."""

    def __init__(self, path: Path) -> None:
        nb = nbformat.read(path, as_version=4)
        self.nb = nb
        self.size = path.stat().st_size  # bytes of the saved notebook
        cells = nb.cells
        self.outputs: list[dict[str, Any]] = [o for c in cells if c.cell_type == "code" for o in c.get("outputs", [])]
        self.text = "\n".join(o.get("text", "") for o in self.outputs)
        self.figures = figure_outputs(nb)
        states = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
        self.widget_texts = [
            s["state"]["value"]
            for s in states.values()
            if s.get("model_name") == "HTMLModel" and s["state"].get("value")
        ]

    def html_figures(self) -> int:
        """How many figures nbconvert's HTML of the notebook shows as images (a viewer without JupyterLab)."""
        from nbconvert import HTMLExporter

        page, _ = HTMLExporter().from_notebook_node(self.nb)
        return page.count('src="data:image/png;base64,')


#: nbclient's wait for a cell's outputs after its reply (papermill passes it on): its 4 s default dropped
#: a print on a loaded machine; a wait that runs out fails the cell rather than losing the output.
IOPUB = {"iopub_timeout": 120, "raise_on_iopub_timeout": True}


#: The longest one cell of a tour notebook may run before the notebook fails as hung; below
#: pytest-timeout's 300 s, so a hang names its cell and the kernel's clusters are stopped.
CELL_TIMEOUT_S = 240


def execute(name: str, out_dir: Path, **parameters: Any) -> Executed:
    """Run ``notebooks/<name>`` into ``out_dir`` with ``parameters`` (working directory: ``notebooks/``) by plain
    papermill; the executed notebook is checked as it would be shared (:func:`offline_html.sharing_problems`).

    A cell that runs longer than :data:`CELL_TIMEOUT_S` fails the notebook. When it fails, the
    clusters its kernel started are ended here (a killed kernel cannot stop them), so one failing
    notebook does not fail the tests after it."""
    out = out_dir / name
    before = session_cluster_pids()
    try:
        papermill.execute_notebook(
            str(NOTEBOOKS / name),
            str(out),
            parameters=parameters,
            kernel_name="python3",
            cwd=str(NOTEBOOKS),
            progress_bar=False,
            execution_timeout=CELL_TIMEOUT_S,
            **IOPUB,
        )
    except BaseException:
        _reap_clusters_started_since(before)
        _print_last_outputs(out)
        raise
    problems = sharing_problems(out)
    assert not problems, f"{name}: {'; '.join(problems)}"
    return Executed(out)


#: Set by ``make tour`` to the folder of the notebooks it executed the user's way (``tests/tour_check.py``).
TOUR_DIR_ENV = "RAPYDLI_TOUR_DIR"


def executed_tour(name: str, out_dir: Path) -> Executed:
    """Tour notebook ``name`` executed with its default parameters: as ``make tour`` executed it (the ``make demo``
    environment, plain papermill; :data:`TOUR_DIR_ENV` names the folder), or, outside ``make tour``, executed
    here by :func:`execute` into ``out_dir``. Each tour notebook then runs once in CI, not once per check."""
    import os

    tour = os.environ.get(TOUR_DIR_ENV)
    if not tour:
        return execute(name, out_dir)
    executed = Path(tour) / name
    assert executed.is_file(), f"{name} is not in {tour}: the tour did not execute it (tests/tour_check.py)"
    return Executed(executed)


def _reap_clusters_started_since(before: set[int]) -> None:
    """End every cluster with a process that was not there in ``before`` (this session's only)."""
    import psutil

    clusters = set()
    for pid in session_cluster_pids() - before:
        try:
            clusters.add(psutil.Process(pid).environ().get(CLUSTER_MARKER, ""))
        except psutil.Error:
            continue
    for cluster_id in clusters - {""}:
        reap_marked(cluster_id, grace=1.0)


def _print_last_outputs(out: Path, cells: int = 2, chars: int = 4000) -> None:
    """Print what the last ``cells`` executed cells of a failed notebook showed (their text, truncated),
    so a failure in CI says where the notebook was."""
    try:
        nb = nbformat.read(out, as_version=4)
    except (OSError, ValueError):
        return
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    for cell in ran[-cells:]:
        texts = [o.get("text", "") or str(o.get("data", {}).get("text/plain", "")) for o in cell.get("outputs", [])]
        print(f"--- cell {cell.execution_count} of {out.name} showed:\n{''.join(texts)[-chars:]}")
