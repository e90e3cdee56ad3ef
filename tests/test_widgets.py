"""Widgets driven from Python (no browser): controls from the config spec, errors in the panel, Train and Stop."""

from __future__ import annotations

import pytest

import rapydli as rd
from rapydli.widgets import HyperparameterPanel, SweepPanel
from rapydli.zoo import datasets, models


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def test_controls_follow_the_field_spec_and_errors_stay_in_the_panel() -> None:
    panel = HyperparameterPanel(models.mlp, datasets.digits, rd.TrainConfig(lr=0.01, workers=2))
    controls = panel.controls
    assert type(controls["lr"]).__name__ == "FloatLogSlider" and controls["lr"].value == pytest.approx(0.01)
    assert type(controls["optimizer"]).__name__ == "Dropdown" and list(controls["optimizer"].options) == [
        "sgd",
        "adamw",
    ]
    assert type(controls["overlap"]).__name__ == "Checkbox"
    assert controls["workers"].max == 2
    controls["lr"].value = 0.05
    controls["optimizer"].value = "sgd"
    controls["max_steps"].value = 0  # optional: 0 means None
    config = panel.current_config()
    assert config.lr == pytest.approx(0.05) and config.optimizer == "sgd" and config.max_steps is None
    controls["momentum"].value = 1.0  # invalid: momentum must be < 1
    panel.train_button.click()
    assert "TrainConfig.momentum=1.0 is invalid" in panel.message.value
    assert panel.job is None and not panel.running and panel.cluster is None  # nothing started


@pytest.mark.engines
def test_train_then_stop_ends_every_rank_and_the_cluster_stays_usable(cluster) -> None:
    if True:
        panel = HyperparameterPanel(
            models.mlp, datasets.digits, rd.TrainConfig(max_steps=10, eval_every=5, batch_size=32), cluster=cluster
        )
        panel.controls["lr"].value = 0.02
        panel.train_button.click()
        assert panel.stop_button.disabled is False
        panel.wait(120)
        assert (
            panel.runs[0]["state"] == "finished"
            and panel.runs[0]["steps"] == 10
            and panel.runs[0]["lr"] == pytest.approx(0.02)
        )
        assert "val_loss" in panel.table.value and len(panel.plot.figure.data[0].x) == 10

        panel.controls["max_steps"].value = 0
        panel.controls["epochs"].value = 500  # far longer than the test: only Stop ends it
        panel.train_button.click()
        while len(panel.job.rows) < 5:
            panel.wait(0.05)
        panel.stop_button.click()
        panel.wait(60)
        assert not panel.running
        last = panel.runs[-1]
        assert last["state"] == "stopped" and 5 <= last["steps"] < 1000
        assert all(r["stopped_early"] for r in panel.job.results)  # every rank ended its loop, after the same step
        assert cluster.run(lambda: 3) == [3, 3]


@pytest.mark.engines
def test_the_panel_passes_loss_optimizer_and_metrics_to_its_runs(cluster) -> None:
    from train_cases import PASSED, RegressionMLP, passed_through, regression

    from rapydli.experiments.store.runstore import open_store

    panel = HyperparameterPanel(
        RegressionMLP, regression, rd.TrainConfig(max_steps=4, batch_size=4, allreduce="mpi"), cluster=cluster, **PASSED
    )
    panel.controls["lr"].value = 0.03
    panel.train_button.click()
    panel.wait(120)
    (run,) = panel.runs
    assert run["state"] == "finished" and run["val_accuracy"] is None, run  # regression: no accuracy
    passed_through(open_store().final_metrics(run["run_id"]), panel.current_config().lr)


@pytest.mark.engines
def test_sweep_panel_runs_a_sweep_in_the_background_and_stops(cluster) -> None:
    config = rd.TrainConfig(max_steps=10, eval_every=5, batch_size=32, allreduce="mpi")
    panel = SweepPanel(
        models.mlp, datasets.digits, config, {"lr": rd.loguniform(1e-3, 1e-1)}, cluster, trials=2, pruner="none"
    )
    assert panel.parallel.value == 2
    pairs = SweepPanel(
        models.mlp, datasets.digits, config, {"lr": rd.loguniform(1e-3, 1e-1)}, cluster, trials=2, workers_per_trial=2
    )
    pairs.parallel.value = 2  # two 2-rank groups do not fit in 2 engines: shown, nothing starts
    pairs.run_button.click()
    assert not pairs.running and pairs.result is None and "parallel=2 is invalid" in pairs.message.value
    panel.run_button.click()
    assert panel.running and panel.stop_button.disabled is False
    result = panel.wait(120)
    assert result is not None, f"the sweep did not end in 120 s: {panel.message.value}"
    assert list(result.table["state"]) == ["COMPLETE", "COMPLETE"] and "done" in panel.message.value
    assert len(panel.view.table) == 2 and panel.view.redraws >= 2  # the live view followed the trials
    assert panel.run_button.disabled is False

    long = rd.TrainConfig(epochs=500, eval_every=5, batch_size=32, allreduce="mpi")
    # no pruner: a trial pruned before Stop would free its engine for a third trial
    stopper = SweepPanel(
        models.mlp, datasets.digits, long, {"lr": rd.loguniform(1e-3, 1e-1)}, cluster, trials=4, pruner="none"
    )
    stopper.run_button.click()
    while not len(stopper.view.table) or not (stopper.view.table["steps"] > 0).any():
        stopper.wait(0.1)
    stopper.stop_button.click()
    result = stopper.wait(60)
    assert not stopper.running and len(result.table) == 2  # no trial started after Stop
    assert cluster.run(lambda: 4) == [4, 4]
