"""The README's batch, end to end: notebook 05 over lr x workers, two items at a time."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from processes import engine_pids

from rapydli.cli import main
from rapydli.experiments.store import runstore as store_mod
from rapydli.experiments.store.compare import run_summary
from rapydli.experiments.store.record import read_records

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "05-batch-experiments.ipynb"


@pytest.mark.notebook
@pytest.mark.timeout(900)
def test_readme_batch_over_notebook_05(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    argv = ["batch", str(NOTEBOOK), "--grid", "lr=0.1,0.01", "workers=1,2", "--parallel", "2"]
    assert main(argv) == 0

    out = tmp_path / "batch-results"
    summary = pd.read_csv(out / "summary.csv")
    assert len(summary) == 4 and (summary["status"] == "finished").all()
    assert sorted(zip(summary["lr"], summary["workers"])) == [(0.01, 1), (0.01, 2), (0.1, 1), (0.1, 2)]
    assert summary["accuracy"].between(0.0, 1.0).all() and (summary["throughput"] > 0).all()
    # lr=0.1 SGD learns digits well in two epochs; lr=0.01 lags behind it
    assert summary[summary["lr"] == 0.1]["accuracy"].min() > 0.8

    report = (out / "report.html").read_text()
    for title in (
        "accuracy vs lr",
        "accuracy vs workers",
        "throughput vs workers",
        "speedup from throughput vs workers",
    ):
        assert title in report

    # every item is a batch run with its train run beneath it, repeatable by module:qualname
    store = store_mod.open_store()
    for row in summary.itertuples():
        item = store.get_run(row.run_id)
        assert item["params"]["parameters"] == {"lr": row.lr, "workers": row.workers}
        assert store.records(row.run_id)["accuracy"]["value"] == pytest.approx(row.accuracy)
        (train,), _ = store.list_runs(kind="train", parent=row.run_id)
        assert train["status"] == "finished" and train["world_size"] == row.workers
        assert train["params"]["model_fn"] == "rapydli.zoo.models:mlp"
        assert train["params"]["config"]["lr"] == row.lr
        assert read_records(row.output)["throughput"] == pytest.approx(row.throughput)
        assert run_summary(store, train["id"])[0]["samples_per_s"] == pytest.approx(
            row.throughput
        )  # the store's number
        assert Path(row.output).stat().st_size < 1_000_000  # an item's executed notebook travels too

    # re-running the same command runs nothing again
    assert main(argv) == 0
    assert pd.read_csv(out / "summary.csv")["resumed"].all()
    assert not engine_pids()  # every item stopped its own cluster
