"""rd.record: value encoding, the store under the current run, and the .ipynb round trip."""

from __future__ import annotations

from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import papermill
import plotly.graph_objects as go
import pytest
import torch

import rapydli as rd
from rapydli import settings
from rapydli.errors import ConfigError
from rapydli.experiments.store import record as record_mod
from rapydli.experiments.store import runstore as store_mod
from rapydli.experiments.store.record import encode, read_records

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(settings.BATCH_ITEM, raising=False)
    monkeypatch.setattr(store_mod, "_current", {})
    return tmp_path / "home"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (3, ("scalar", 3)),
        (0.5, ("scalar", 0.5)),
        (True, ("scalar", True)),
        ("adam", ("scalar", "adam")),
        (np.float32(0.25), ("scalar", 0.25)),
        (np.int64(7), ("scalar", 7)),
        (torch.tensor(1.5), ("scalar", 1.5)),
        (float("nan"), ("scalar", None)),
        ({"a": [1, 2]}, ("json", {"a": [1, 2]})),
    ],
)
def test_encode_scalars_and_json(value: object, expected: tuple) -> None:
    assert encode(value) == expected


def test_encode_table_and_figure_roundtrip() -> None:
    frame = pd.DataFrame({"step": [1, 2], "loss": [0.5, 0.25]})
    kind, data = encode(frame)
    assert kind == "table"
    pd.testing.assert_frame_equal(record_mod.decode(kind, data), frame)
    kind, data = encode(frame["loss"])
    assert kind == "table" and data["columns"] == ["loss"]
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]), layout={"title": {"text": "t"}})
    kind, data = encode(fig)
    assert kind == "figure"
    back = record_mod.decode(kind, data)
    assert isinstance(back, go.Figure) and list(back.data[0].y) == [3, 4] and back.layout.title.text == "t"


def test_encode_refuses_what_it_cannot_keep(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="cannot record a object"):
        encode(object())
    with pytest.raises(ConfigError, match="cannot be stored as JSON"):
        encode({"f": object()})
    monkeypatch.setattr(record_mod, "MAX_TABLE_CELLS", 10)
    with pytest.raises(ConfigError, match="limited to 10 cells"):
        encode(pd.DataFrame({"a": range(20)}))
    with pytest.raises(ConfigError, match="name must be a non-empty string"):
        rd.record("", 1)


def test_record_goes_under_the_current_run(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = store_mod.open_store()
    run_id = store.create_run("train", "m", {})
    rd.record("accuracy", 0.9)
    rd.record("curve", pd.DataFrame({"x": [1]}))
    records = store.records(run_id)
    assert records["accuracy"] == {"type": "scalar", "value": 0.9}
    assert records["curve"]["type"] == "table"
    assert store.final_metrics(run_id)["accuracy"] == 0.9
    assert capsys.readouterr().err == ""


def test_record_goes_under_the_batch_item_from_the_environment(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = store_mod.open_store()
    item = store.create_run("batch", "nb/abc", {})
    store.create_run("train", "later", {})  # the batch item wins over the process's last run
    monkeypatch.setenv(settings.BATCH_ITEM, item)
    rd.record("y", 2)
    assert store.records(item) == {"y": {"type": "scalar", "value": 2}}


def test_record_without_run_prints_a_note(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rd.record("lonely", 1)
    err = capsys.readouterr().err
    assert "'lonely' is not kept (not in a notebook)" in err and "rapydli batch" in err


def test_a_terminal_ipython_is_not_a_notebook(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from IPython.testing.globalipapp import start_ipython

    start_ipython()  # a shell without a kernel, as other tests (and terminal IPython) have
    rd.record("lonely", 1)
    assert "'lonely' is not kept (not in a notebook)" in capsys.readouterr().err


@pytest.mark.notebook
def test_roundtrip_from_the_ipynb_alone(tmp_path: Path, home: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell(
            "import pandas as pd, plotly.graph_objects as go, rapydli as rd\n"
            "rd.record('accuracy', 0.75)\n"
            "rd.record('accuracy', 0.8)  # the last value wins\n"
            "rd.record('table', pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']}))\n"
            "rd.record('fig', go.Figure(go.Bar(x=['p', 'q'], y=[1, 2])))\n"
            "rd.record('meta', {'k': [1, 2]})"
        )
    ]
    source, out = tmp_path / "rec.ipynb", tmp_path / "rec-out.ipynb"
    nbformat.write(nb, source)
    papermill.execute_notebook(str(source), str(out), kernel_name="python3", progress_bar=False, cwd=str(tmp_path))
    values = read_records(out)
    assert values["accuracy"] == 0.8
    pd.testing.assert_frame_equal(values["table"], pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}))
    assert isinstance(values["fig"], go.Figure) and list(values["fig"].data[0].x) == ["p", "q"]
    assert values["meta"] == {"k": [1, 2]}
    assert read_records(out, decoded=False)["table"]["type"] == "table"
    # outside a batch and with no run, the kernel said where the value went
    stderr = "".join(o.get("text", "") for o in nbformat.read(out, 4).cells[0].outputs if o.get("name") == "stderr")
    assert "is kept in this notebook's output only" in stderr


def test_read_records_of_a_missing_notebook(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read notebook"):
        read_records(tmp_path / "nope.ipynb")
