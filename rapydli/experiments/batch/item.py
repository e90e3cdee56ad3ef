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
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from rapydli.experiments.batch.headless import skip_unused_imports

if __name__ == "__main__":  # this process only executes one notebook: 3-5 s of CPU less (see headless)
    skip_unused_imports()

from rapydli.experiments.batch.spec import kernel_for, read_notebook
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def failing_cell(notebook: str | Path, executed: str | Path, exc: Any) -> dict[str, Any]:
    """Where a notebook failed (``exc``: papermill's ``PapermillExecutionError``), as Jupyter shows the cell.

    ``index`` (in the source notebook's ``cells``, from 0, markdown counted:
    :func:`source_cell_index`), ``executed_index``, ``execution_count`` (the ``In [n]`` of
    the executed notebook), ``code_cell`` (its position among the notebook's code cells,
    from 1), ``line`` (the cell's line that raised, read from IPython's ``Cell In[n], line
    m`` in the traceback; ``None`` when the traceback names none) and ``text`` (that line).
    """
    index = source_cell_index(executed, exc.cell_index)
    try:
        cells = read_notebook(notebook).cells
        code_cell: int | None = sum(1 for cell in cells[: index + 1] if cell.get("cell_type") == "code")
    except Exception:  # noqa: BLE001 - the source notebook moved meanwhile: no position among code cells
        code_cell = None
    found = re.search(rf"Cell In\[{exc.exec_count}\], line (\d+)", _ANSI.sub("", "\n".join(exc.traceback or [])))
    line = int(found.group(1)) if found else None
    lines = (exc.source or "").splitlines()
    text = lines[line - 1].strip() if line is not None and 0 < line <= len(lines) else None
    return {
        "index": index,
        "executed_index": exc.cell_index,
        "execution_count": exc.exec_count,
        "source": exc.source,
        "code_cell": code_cell,
        "line": line,
        "text": text,
    }


def cell_words(cell: dict[str, Any] | None) -> str | None:
    """A failing cell as a user finds it in Jupyter: ``code cell 3 (In [4]), line 5: raise ValueError("x")``."""
    if not cell:
        return None
    where = f"code cell {cell['code_cell']}" if cell.get("code_cell") else f"cell {cell['index']} (counted from 0)"
    if cell.get("execution_count"):
        where += f" (In [{cell['execution_count']}])"
    if cell.get("line"):
        where += f", line {cell['line']}"
    return f"{where}: {cell['text']}" if cell.get("text") else where


def run_item(spec: dict[str, Any]) -> dict[str, Any]:
    """Execute the notebook of ``spec``; return ``{status, error, failing_cell, duration}``.

    ``failing_cell`` says where it failed (:func:`failing_cell`); the run store's error
    begins with it in words (:func:`cell_words`).
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
            failing_cell=failing_cell(spec["notebook"], spec["output"], exc),
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
                error = f"{cell_words(result['failing_cell'])}\n{error}"
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
