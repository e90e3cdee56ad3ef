"""Every tour notebook as a newcomer runs it (``make tour``): the ``make demo`` environment, plain papermill, its defaults.

Each notebook of ``notebooks/`` is executed by the papermill of ``--python``'s environment
(a venv ``make demo`` made: the runtime alone, none of the test extras) with its default
parameters, then checked as it would be shared: no cell error, at most
:data:`~offline_html.TOUR_NOTEBOOK_BYTES` bytes, every figure carrying its PNG, and
every figure visible in its nbconvert HTML opened in Chromium with the network off
(:func:`offline_html.sharing_problems`). ``09-on-a-cluster.ipynb`` needs a running Slurm: it
runs only where ``sinfo`` answers (``tests/test_cluster_notebook09.py`` runs it on the
suite's own Slurm). One line per notebook; the exit status is the number that failed.

Usage: ``python tests/tour_check.py --python build/demo-venv/bin/python --out build/tour``
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import nbformat  # noqa: E402 - after the tests folder is importable
from notebooks_run import NOTEBOOKS  # noqa: E402
from offline_html import figure_outputs, sharing_problems  # noqa: E402

#: Notebooks that need something a bare machine lacks, and how to tell it is there.
NEEDS = {"09-on-a-cluster.ipynb": ("a running Slurm", ["sinfo", "--noheader"])}
#: The longest one notebook may run (its default parameters on a 2-core machine take a few minutes).
NOTEBOOK_TIMEOUT_S = 1200


def check(notebook: Path, python: Path, out: Path) -> str | None:
    """Run ``notebook`` with ``python``'s papermill into ``out``; what is wrong with it (None: nothing)."""
    executed = out / notebook.name
    papermill = python.parent / "papermill"
    try:
        run = subprocess.run([str(papermill), "--cwd", str(NOTEBOOKS), str(notebook), str(executed), "-k", "python3"],
                             capture_output=True, text=True, timeout=NOTEBOOK_TIMEOUT_S)  # fmt: skip
    except subprocess.TimeoutExpired:
        return f"did not end within {NOTEBOOK_TIMEOUT_S} s"
    if run.returncode != 0:
        lines = [line for line in (run.stderr or run.stdout).splitlines() if line.strip()]
        return "papermill failed:\n    " + "\n    ".join(lines[-15:])
    problems = sharing_problems(executed)
    if problems:
        return "; ".join(problems)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", type=Path, required=True, help="the python of a `make demo` environment")
    parser.add_argument("--out", type=Path, default=Path("build/tour"))
    parser.add_argument("notebooks", nargs="*", help="names in notebooks/ (default: all)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.notebooks or sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    failed = 0
    for name in names:
        need = NEEDS.get(name)
        if need and (
            shutil.which(need[1][0]) is None or subprocess.run(need[1], capture_output=True, timeout=30).returncode != 0
        ):
            print(f"{name}: skipped, it needs {need[0]}", flush=True)
            continue
        started = time.monotonic()
        problem = check(NOTEBOOKS / name, args.python, args.out)
        took = time.monotonic() - started
        if problem:
            failed += 1
            print(f"{name}: FAILED after {took:.0f} s: {problem}", flush=True)
        else:
            size = (args.out / name).stat().st_size
            figures = len(figure_outputs(nbformat.read(args.out / name, as_version=4)))
            print(f"{name}: ok in {took:.0f} s, {size / 2**10:.0f} KiB, {figures} figures visible offline", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
