"""rd.batch / rapydli batch over small fixture notebooks, through real papermill."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import psutil
import pytest
from click.testing import CliRunner

import rapydli as rd
from rapydli.cli import cli, main
from rapydli.errors import ConfigError
from rapydli.experiments.batch import spec as batchspec
from rapydli.experiments.store import runstore as store_mod
from rapydli.experiments.store.record import read_records

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"
PARAMS_NB = NOTEBOOKS / "params.ipynb"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


# -- grid expansion and validation (nothing runs) ----------------------------------
def test_parse_grid_values_and_expansion() -> None:
    grid = batchspec.parse_grid(["lr=0.1,1e-2", "name=adam,sgd", "flag=true,false", "shape=[1,2],[3]", "n=1"])
    assert grid == {"lr": [0.1, 0.01], "name": ["adam", "sgd"], "flag": [True, False], "shape": [[1, 2], [3]], "n": [1]}
    points = batchspec.expand({"a": [1, 2], "b": ["x", "y"]})
    assert points == [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert batchspec.expand({}) == [{}]
    for bad, message in (("lr", "key=v1,v2"), ("lr=", "no values"), ("1x=2", "key=v1,v2")):
        with pytest.raises(ConfigError, match=message):
            batchspec.parse_grid([bad])
    with pytest.raises(ConfigError, match="twice"):
        batchspec.parse_grid(["a=1", "a=2"])


def test_params_file_mapping_and_list(tmp_path: Path) -> None:
    mapping = tmp_path / "grid.yaml"
    mapping.write_text("x: [1, 2]\nlabel: b\n")
    assert batchspec.load_params_file(mapping) == [{"x": 1, "label": "b"}, {"x": 2, "label": "b"}]
    points = tmp_path / "points.yaml"
    points.write_text("- {x: 3}\n- {x: 4, factor: 0.5}\n")
    assert batchspec.load_params_file(points) == [{"x": 3}, {"x": 4, "factor": 0.5}]
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="params-file"):
        batchspec.load_params_file(bad)


def test_notebook_parameters_via_papermill() -> None:
    params = batchspec.notebook_parameters(PARAMS_NB)
    assert {k: v["type"] for k, v in params.items()} == {
        "x": "int",
        "factor": "float",
        "label": "str",
        "sleep": "float",
    }
    assert params["factor"]["default"] == 2.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grid": {"lr": [0.1]}}, "'lr' is not a parameter of .*its parameters are: factor, label, sleep, x"),
        ({"grid": {"x": ["big"]}}, "parameter 'x' of .* expects int \\(default 1\\); got 'big'"),
        ({"grid": {"x": [True]}}, "expects int"),
        ({"grid": {"label": [3]}}, "expects str"),
        ({"grid": ["x=1", "label=a", "x=2"]}, "twice"),
        ({"grid": {"x": [1]}, "parallel": 0}, "parallel must be an integer >= 1"),
        ({"grid": {"x": [1]}, "timeout": -1}, "timeout must be"),
        ({"grid": {"x": [1]}, "retry": -1}, "retry must be"),
        ({"grid": {"x": [1]}, "kernel": "no-such-kernel"}, "kernel 'no-such-kernel' is not installed"),
        ({"grid": {"x": [1]}, "params_file": "missing.yaml"}, "cannot read it"),
    ],
)
def test_validation_refuses_before_running_anything(home: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        rd.batch(PARAMS_NB, out="out", **kwargs)
    assert not Path("out").exists()
    assert store_mod.open_store().list_runs()[1] == 0


def test_float_parameter_accepts_ints_and_bad_notebooks_are_refused(home: Path, tmp_path: Path) -> None:
    checked = batchspec.validate([{"factor": 3, "x": 2}], batchspec.notebook_parameters(PARAMS_NB), "nb")
    assert checked == [{"factor": 3.0, "x": 2}] and isinstance(checked[0]["factor"], float)
    # no parameters cell: nothing to check against (papermill injects the values at the top)
    assert batchspec.notebook_parameters(NOTEBOOKS / "no_parameters.ipynb") is None
    assert batchspec.validate([{"anything": "goes"}], None, "nb") == [{"anything": "goes"}]
    with pytest.raises(ConfigError, match="does not exist"):
        rd.batch(tmp_path / "nope.ipynb", {"x": [1]})
    broken = tmp_path / "broken.ipynb"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        rd.batch(broken, {"x": [1]})


def test_cli_refusal_is_one_line_exit_2(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["batch", str(PARAMS_NB), "--grid", "lr=0.1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rapydli: error: 'lr' is not a parameter") and err.count("\n") == 1
    assert not Path("batch-results").exists()


def test_cli_dry_run_lists_items(home: Path) -> None:
    result = CliRunner().invoke(cli, ["batch", str(PARAMS_NB), "--grid", "x=1,2", "label=a,b", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "4 items; nothing run" in result.output
    assert result.output.count("params/") == 4 and not Path("batch-results").exists()


# -- real executions ---------------------------------------------------------------
@pytest.mark.notebook
def test_a_batch_whose_items_all_fail_still_reports(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["batch", str(PARAMS_NB), "--grid", "x=-1,-2", "--out", "out", "--parallel", "2"]) == 1
    assert "2 of 2 items failed" in capsys.readouterr().err
    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert sorted(summary["x"]) == [-2, -1] and (summary["status"] == "failed").all()
    assert "ValueError: x must be positive" in (tmp_path / "out" / "report.html").read_text()


def test_batch_end_to_end_failing_item_and_resume(
    home: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["batch", str(PARAMS_NB), "--grid", "x=2,-1", "--out", "out", "--parallel", "2"]
    assert main(argv) == 1  # one item failed: non-zero exit, the other went on
    captured = capsys.readouterr()
    # nb.cells[3] raises, as Jupyter shows it: the third code cell, In [4] after papermill's injected parameters, line 5
    where = 'code cell 3 (In [4]), line 5: raise ValueError("x must be positive")'
    assert "1 of 2 items failed" in captured.err and f"in {where}\n  ValueError: x must be positive" in captured.err, (
        captured.err
    )
    assert "duration" in captured.out and not re.search(r"\d\.\d{5}", captured.out)  # the table's floats are rounded

    summary = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert list(summary.columns[:3]) == ["item", "x", "status"]
    rows = summary.set_index("x")
    assert rows.loc[2, "status"] == "finished" and rows.loc[2, "y"] == 4.0
    assert rows.loc[-1, "status"] == "failed" and rows.loc[-1, "failing_cell"] == where
    assert "ValueError: x must be positive" in rows.loc[-1, "error"]
    assert (summary["duration"] > 0).all()

    # files: DIR/<stem>/<hash>.ipynb, and each item ran in its own working directory
    good = rows.loc[2, "item"]
    out_nb = tmp_path / "out" / "params" / f"{good}.ipynb"
    assert good == batchspec.param_hash({"x": 2}) and out_nb.exists()
    records = read_records(out_nb)
    assert records["y"] == 4.0 and records["cwd"] == str(tmp_path / "out" / "params" / good)
    assert (tmp_path / "out" / "params" / good / "written-here.txt").read_text() == "a"
    assert (tmp_path / "out" / "params" / rows.loc[-1, "item"] / "written-here.txt").exists()

    # report: the recorded metric against the varied parameter, each figure a PNG (shown anywhere) and an interactive
    # figure drawn with the plotly.js beside it; small enough to mail
    report = (tmp_path / "out" / "report.html").read_text()
    assert "y vs x" in report and "duration vs x" in report
    assert report.count('src="data:image/png;base64,') == report.count("Plotly.newPlot") >= 2
    assert '<script src="plotly.min.js">' in report and (tmp_path / "out" / "plotly.min.js").exists()
    assert len(report) < 1_000_000

    # store: a batch run with one item run per point, records under the items
    store = store_mod.open_store()
    batches = [r for r in store.list_runs(kind="batch")[0] if r["parent"] is None]
    assert len(batches) == 1 and batches[0]["status"] == "failed"
    items, total = store.list_runs(parent=batches[0]["id"])
    assert total == 2
    by_x = {r["params"]["parameters"]["x"]: r for r in items}
    assert by_x[2]["status"] == "finished" and store.records(by_x[2]["id"])["y"]["value"] == 4.0
    assert by_x[-1]["status"] == "failed" and by_x[-1]["error"] == f"{where}\nValueError: x must be positive"
    assert store.artifacts(by_x[2]["id"])[0]["path"] == str(out_nb)

    # resume: the finished item is skipped, the failed one runs again
    summary2 = rd.batch(PARAMS_NB, ["x=2,-1"], out="out", parallel=2, progress=False)
    rows2 = summary2.set_index("x")
    assert bool(rows2.loc[2, "resumed"]) and rows2.loc[2, "run_id"] == by_x[2]["id"]
    assert not rows2.loc[-1, "resumed"] and rows2.loc[-1, "run_id"] != by_x[-1]["id"]
    assert summary2.attrs["failed"] == 1
    assert len(store.list_runs(kind="batch")[0]) == 2 + 3  # two batches, three items in all


@pytest.mark.notebook
def test_changed_notebook_is_not_resumed_and_retry_timeout(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nbformat

    monkeypatch.setenv("RAPYDLI_STORE", "off")  # batches (and resuming) work without the store

    nb = nbformat.read(PARAMS_NB, 4)
    copy = tmp_path / "params.ipynb"
    nbformat.write(nb, copy)
    first = rd.batch(copy, {"x": [1]}, out="out", progress=False)
    assert first.loc[0, "status"] == "finished"
    nb.cells.append(nbformat.v4.new_code_cell("rd.record('extra', 1)"))
    nbformat.write(nb, copy)
    second = rd.batch(copy, {"x": [1]}, out="out", progress=False)
    assert not second.loc[0, "resumed"] and second.loc[0, "extra"] == 1

    # an item that outlives --timeout is killed with its kernel, retried, then failed
    slow = rd.batch(copy, {"sleep": [120.0]}, out="out", timeout=6, retry=1, progress=False)
    assert slow.loc[0, "status"] == "failed" and slow.loc[0, "attempts"] == 2
    assert slow.loc[0, "error"].startswith("timed out after 6 s")
    pid_file = tmp_path / "out" / "params" / slow.loc[0, "item"] / "kernel.pid"
    if pid_file.exists():  # the kernel got far enough to start: it must be gone now
        assert (
            not psutil.pid_exists(int(pid_file.read_text()))
            or psutil.Process(int(pid_file.read_text())).status() == psutil.STATUS_ZOMBIE
        )
    record = json.loads((tmp_path / "out" / "params" / f"{slow.loc[0, 'item']}.json").read_text())
    assert record["status"] == "failed" and record["parameters"] == {"sleep": 120.0}
    assert slow["run_id"].isna().all() and not (home / "runs.db").exists()


def _bare_notebook(path: Path, *cells: str, parameters: str | None = None) -> Path:
    """A notebook as nbformat, jupytext or an editor writes it: no kernelspec, no language_info."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    if parameters is not None:
        nb.cells.append(nbformat.v4.new_code_cell(parameters, metadata={"tags": ["parameters"]}))
    nb.cells.extend(nbformat.v4.new_code_cell(source) for source in cells)
    assert "kernelspec" not in nb.metadata and "language_info" not in nb.metadata
    nbformat.write(nb, path)
    return path


def test_kernel_for_a_notebook_without_kernel_metadata(tmp_path: Path) -> None:
    import nbformat
    from jupyter_client.kernelspec import NATIVE_KERNEL_NAME

    bare = nbformat.read(_bare_notebook(tmp_path / "bare.ipynb", "x = 1"), 4)
    assert batchspec.kernel_for(bare) == (NATIVE_KERNEL_NAME, "python")
    assert batchspec.kernel_for(nbformat.read(PARAMS_NB, 4)) == ("python3", "python")
    params = batchspec.notebook_parameters(_bare_notebook(tmp_path / "p.ipynb", "y = x", parameters="x = 1\nlr = 0.1"))
    assert {k: v["type"] for k, v in params.items()} == {"x": "int", "lr": "float"}


@pytest.mark.notebook
def test_a_bare_notebook_without_kernel_metadata_or_parameters_cell_runs(home: Path, tmp_path: Path) -> None:
    import nbformat

    path = _bare_notebook(
        tmp_path / "bare.ipynb",
        "import sys\nimport rapydli as rd\nrd.record('y', x * 3)\nrd.record('python', sys.executable)",
    )
    summary = rd.batch(path, {"x": [1, 2]}, out="out", progress=False)
    assert list(summary["status"]) == ["finished", "finished"], summary["error"].tolist()
    rows = summary.set_index("x")
    assert rows.loc[1, "y"] == 3 and rows.loc[2, "y"] == 6
    import sys

    assert rows.loc[1, "python"] == sys.executable  # this environment's Python kernel
    executed = nbformat.read(rows.loc[2, "output"], 4)
    assert "injected-parameters" in executed.cells[0].metadata.tags and "x = 2" in executed.cells[0].source


@pytest.mark.notebook
def test_an_executed_notebook_carries_its_figures_as_pngs(home: Path, tmp_path: Path) -> None:
    """A batch item's saved notebook shows its plots in any viewer: a plotly figure left as a
    cell's value (plain plotly, no rapydli import) carries its PNG beside plotly's JSON; no
    plotly.js (4.9 MB) in each item's notebook."""
    import nbformat

    figure = "import plotly.graph_objects as go\ngo.Figure(go.Scatter(x=[1, 2], y=[x, 2 * x]))"
    path = _bare_notebook(tmp_path / "figure.ipynb", figure, parameters="x = 1")
    summary = rd.batch(path, {"x": [3]}, out="out", progress=False)
    assert list(summary["status"]) == ["finished"], summary["error"].tolist()
    executed = nbformat.read(summary["output"].iloc[0], 4)
    outputs = [o for cell in executed.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    shown = [o for o in outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(shown) == 1, outputs
    assert shown[0]["data"]["application/vnd.plotly.v1+json"]["data"][0]["y"] in (
        [3, 6],
        {"dtype": "i1", "bdata": "AwY="},
    )
    assert shown[0]["data"]["image/png"] and "text/html" not in shown[0]["data"]
    assert Path(summary["output"].iloc[0]).stat().st_size < 100_000


@pytest.mark.notebook
def test_report_axes_and_a_skipped_rerun_adds_no_batch_record(home: Path, tmp_path: Path) -> None:
    from rapydli.experiments.batch import report as batchreport
    from rapydli.experiments.batch.batch import plan_batch

    grid = {"factor": [0.01, 0.1], "x": [1, 2]}
    first = rd.batch(PARAMS_NB, grid, out="out", parallel=2, progress=False)
    assert (first["status"] == "finished").all(), first[["status", "error"]].to_string()
    store = store_mod.open_store()
    before = store.list_runs(kind="batch")[1]
    assert before == 1 + 4

    again = rd.batch(PARAMS_NB, grid, out="out", parallel=2, progress=False)  # every item skipped
    assert again["resumed"].all() and list(again["run_id"]) == list(first["run_id"])
    assert store.list_runs(kind="batch")[1] == before and again.attrs["batch_id"] is None

    figs = {fig.layout.title.text: fig for fig in batchreport.figures(again, plan_batch(PARAMS_NB, grid, out="out"))}
    assert figs["y vs factor"].layout.xaxis.type == "log"  # a log-spaced grid (0.01, 0.1)
    assert list(figs["y vs x"].layout.xaxis.tickvals) == [1, 2] and figs["y vs x"].layout.xaxis.type != "log"


def test_axis_style_log_spaced_and_integer_grids() -> None:
    from rapydli.experiments.batch.report import axis_style

    assert axis_style([0.1, 0.01]) == {"type": "log"}
    assert axis_style([1e-3, 1e-2, 1e-1])["type"] == "log"
    workers = axis_style([1, 2, 4, 8, 16])
    assert workers["type"] == "log" and workers["tickvals"] == [1, 2, 4, 8, 16]
    assert axis_style([2, 1]) == {"tickmode": "array", "tickvals": [1, 2], "ticktext": ["1", "2"]}
    assert axis_style([0.05, 0.1]) == {} and axis_style(["adam", "sgd"]) == {}
    assert "type" not in axis_style(list(range(1, 12)))  # evenly spaced: linear


def test_summary_survives_a_partial_notebook_of_a_killed_item(tmp_path: Path) -> None:
    from rapydli.experiments.batch import batch as batch_mod
    from rapydli.experiments.batch.report import summary_table

    plan = batch_mod.plan_batch(PARAMS_NB, ["x=1"], out=tmp_path / "out")
    item = plan.items[0]
    item.output.parent.mkdir(parents=True, exist_ok=True)
    item.output.write_text("")  # killed while papermill rewrote it
    item.outcome = {"status": "failed", "error": "timed out after 5 s"}
    assert summary_table(plan)["status"].tolist() == ["failed"]
    item.outcome = {"status": "finished"}
    with pytest.raises(ConfigError, match="cannot read notebook"):
        summary_table(plan)
