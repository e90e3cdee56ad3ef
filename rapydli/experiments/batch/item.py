"""One batch item, in its own process: ``python -m rapydli.experiments.batch.item SPEC.json``.

The spec (written by :mod:`rapydli.experiments.batch.batch`) names the notebook, its output,
the parameters, the kernel (``None``: the notebook's, else this environment's Python
kernel, see :func:`~rapydli.experiments.batch.spec.kernel_for`), the working directory and
the item's run id. The notebook runs
through papermill with that working directory; the kernel finds the item's run id in
``RAPYDLI_BATCH_ITEM`` (for ``rd.record``) and ``RAPYDLI_PARENT_RUN`` (so ``rd.train``
runs inside it hang under the item). The outcome goes to the run store and to the
spec's ``result`` JSON file, which the batch reads.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rapydli.experiments.batch.headless import skip_unused_imports

if __name__ == "__main__":  # this process only executes one notebook: 3-5 s of CPU less (see headless)
    skip_unused_imports()

from rapydli.experiments.batch.spec import kernel_for, read_notebook
from rapydli.experiments.figures import STATIC_RENDERERS
from rapydli.experiments.store import runstore as store_mod
from rapydli.settings import BATCH_ITEM, NOTEBOOK_DIR, PARENT_RUN


def source_cell_index(executed: str | Path, index: int) -> int:
    """Where the executed notebook's cell ``index`` is in the source notebook (``nb.cells[i]``, from 0).

    Papermill's injected parameters cell is not in the source notebook, so it is not counted;
    an executed notebook that cannot be read leaves ``index``.
    """
    try:
        cells = read_notebook(executed).cells[:index]
    except Exception:  # noqa: BLE001 - papermill could not save it: the best index there is
        return index
    return index - sum("injected-parameters" in cell.get("metadata", {}).get("tags", []) for cell in cells)


def run_item(spec: dict[str, Any]) -> dict[str, Any]:
    """Execute the notebook of ``spec``; return ``{status, error, failing_cell, duration}``.

    ``failing_cell`` has ``index`` (the cell's index in the source notebook, from 0, markdown
    cells counted; see :func:`source_cell_index`) and ``executed_index`` (in the executed
    notebook, which also has papermill's injected parameters cell).
    """
    import papermill
    from papermill.exceptions import PapermillExecutionError

    run_id = spec.get("run_id")
    if run_id:
        os.environ[BATCH_ITEM] = run_id
        os.environ[PARENT_RUN] = run_id
    extra_path = spec["notebook_dir"]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, os.environ.get("PYTHONPATH")) if p)
    os.environ[NOTEBOOK_DIR] = extra_path
    # figures in the executed notebook also carry HTML (plotly.js from its CDN), so it reads
    # outside JupyterLab; a renderer the user set is kept
    os.environ.setdefault("PLOTLY_RENDERER", STATIC_RENDERERS)
    Path(spec["cwd"]).mkdir(parents=True, exist_ok=True)
    started = time.time()
    result: dict[str, Any] = {"status": "finished", "error": None, "failing_cell": None}
    try:
        kernel, language = kernel_for(read_notebook(spec["notebook"]), spec.get("kernel"))
        papermill.execute_notebook(
            spec["notebook"],
            spec["output"],
            parameters=spec["parameters"],
            kernel_name=kernel,
            language=language,
            cwd=spec["cwd"],
            progress_bar=False,
            log_output=False,
            engine_name="rapydli",  # encrypted kernels; the saved notebook keeps only the widgets it shows
        )
    except PapermillExecutionError as exc:
        result.update(
            status="failed",
            error=f"{exc.ename}: {exc.evalue}",
            failing_cell={"index": source_cell_index(spec["output"], exc.cell_index), "executed_index": exc.cell_index,
                          "execution_count": exc.exec_count, "source": exc.source},  # fmt: skip
        )
    except Exception as exc:  # kernel died, could not start, bad output path...: the item failed
        result.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    result["duration"] = time.time() - started
    if run_id:
        store = store_mod.open_store()
        if store is not None:
            if Path(spec["output"]).exists():
                store.add_artifact(run_id, spec["output"], "notebook")
            error = result["error"]
            if result["failing_cell"]:
                error = f"cell {result['failing_cell']['index']}: {error}"
            store.finish_run(run_id, result["status"], error=error)
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    result = run_item(spec)
    tmp = Path(spec["result"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(spec["result"])
    return 0 if result["status"] == "finished" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
