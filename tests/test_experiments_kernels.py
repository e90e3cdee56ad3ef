"""Notebooks run headless on encrypted kernels: no "without encryption" warning."""

from __future__ import annotations

from pathlib import Path

import nbformat
import papermill
import pytest
import tomllib
from notebooks_run import NOTEBOOKS
from papermill.engines import papermill_engines

from rapydli.experiments.batch.jupyter_kernels import RapydliEngine

ROOT = NOTEBOOKS.parent
# `rapydli batch`'s engine (an entry point of the installed package), also where the package metadata predates it
papermill_engines.register("rapydli", RapydliEngine)


def _tiny(path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("print(6 * 7)"))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.notebook
def test_the_rapydli_engine_runs_an_encrypted_quiet_kernel(tmp_path: Path, capfd) -> None:
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(_tiny(tmp_path / "in.ipynb")), str(out), engine_name="rapydli", progress_bar=False)
    printed = capfd.readouterr()
    assert "without encryption" not in printed.out + printed.err
    cell = nbformat.read(out, as_version=4).cells[0]
    assert cell.outputs[0]["text"] == "42\n"


def test_the_engine_is_registered_and_make_demo_runs_plain_papermill() -> None:
    """The engine is there for those who name it; `make demo` runs papermill as users do, without it."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["papermill.engine"]
    assert entry_points["rapydli"] == "rapydli.experiments.batch.jupyter_kernels:RapydliEngine"
    makefile = (ROOT / "Makefile").read_text()
    assert "bin/papermill --cwd notebooks notebooks/01-quickstart.ipynb" in makefile and "--engine" not in makefile


@pytest.mark.notebook
def test_the_rapydli_engine_waits_for_a_cells_outputs_and_fails_the_cell_rather_than_drop_them(
    tmp_path: Path, monkeypatch
) -> None:
    """nbclient goes on without a cell's late outputs after 4 s by default (a print was lost so on a loaded machine)."""
    from papermill.clientwrap import PapermillNotebookClient

    from rapydli.experiments.batch.jupyter_kernels import IOPUB_TIMEOUT_S

    made: list[PapermillNotebookClient] = []
    build = PapermillNotebookClient.__init__

    def recorded(self: PapermillNotebookClient, *args: object, **kwargs: object) -> None:
        build(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(PapermillNotebookClient, "__init__", recorded)
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(_tiny(tmp_path / "in.ipynb")), str(out), engine_name="rapydli", progress_bar=False)
    assert [(c.iopub_timeout, c.raise_on_iopub_timeout) for c in made] == [(IOPUB_TIMEOUT_S, True)]
    assert nbformat.read(out, as_version=4).cells[0].outputs[0]["text"] == "42\n"


@pytest.mark.notebook
def test_a_kernel_that_dies_before_it_answers_is_started_again(tmp_path: Path, monkeypatch) -> None:
    """Two processes starting kernels at once can draw the same free port; the loser exits before it answers.

    A real kernelspec whose first kernel exits at once (as the loser of a port race does) and whose second is ipykernel.
    The spec declares no CurveZMQ, as older ipykernels' and other languages' do not: it runs, unencrypted.
    """
    import json
    import sys

    spec_dir = tmp_path / "jupyter" / "kernels" / "dies-once"
    spec_dir.mkdir(parents=True)
    marker = tmp_path / "started-once"
    launcher = tmp_path / "dies_once.py"
    launcher.write_text(
        "import os, sys\n"
        f"marker = {str(marker)!r}\n"
        "if not os.path.exists(marker):\n"
        "    open(marker, 'w').close()\n"
        "    sys.exit('zmq.error.ZMQError: Address already in use')\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'ipykernel_launcher', *sys.argv[1:]])\n"
    )
    argv = [sys.executable, str(launcher), "-f", "{connection_file}"]
    (spec_dir / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "dies once", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(
        str(_tiny(tmp_path / "in.ipynb")), str(out), engine_name="rapydli", kernel_name="dies-once", progress_bar=False
    )
    assert marker.exists()
    assert nbformat.read(out, as_version=4).cells[0].outputs[0]["text"] == "42\n"
