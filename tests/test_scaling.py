"""``rd.scaling_study`` and the alpha-beta model: table, figure, prediction check."""

from __future__ import annotations

import pytest

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.perfmodel import RingModel, fit_ring, predict_step_time
from rapydli.zoo import datasets, models


def test_ring_model_formula_and_fit() -> None:
    model = RingModel(alpha=1e-5, beta=2e-9)
    assert model.allreduce_time(1, 1e6) == 0.0
    assert model.allreduce_time(4, 1e6) == pytest.approx(2 * 3 * 1e-5 + 2 * 3 / 4 * 1e6 * 2e-9)
    sizes = [1e3, 1e5, 1e6]
    fitted = fit_ring(sizes, [model.allreduce_time(2, s) for s in sizes], n=2)
    assert fitted.alpha == pytest.approx(1e-5) and fitted.beta == pytest.approx(2e-9)
    assert predict_step_time(model, 2, 0.1, 1e6) == pytest.approx(0.1 + model.allreduce_time(2, 1e6))
    with pytest.raises(ConfigError, match="alpha"):
        RingModel(alpha=-1.0, beta=0.0)


def test_bad_arguments_fail_early() -> None:
    with pytest.raises(ConfigError, match="mode="):
        rd.scaling_study(models.mlp, datasets.digits, rd.TrainConfig(), mode="diagonal")
    with pytest.raises(ConfigError, match="strong"):
        rd.scaling_study(models.mlp, datasets.digits, rd.TrainConfig(batch_size=33), workers=[1, 2], mode="strong")


@pytest.mark.engines
def test_scaling_table_figure_and_prediction() -> None:
    with rd.Cluster(n=2) as cluster:
        result = rd.scaling_study(
            models.mlp, datasets.digits, rd.TrainConfig(batch_size=64, allreduce="mpi"), workers=[1, 2], steps=12,
            predict=[4, 16], cluster=cluster, live=False,
        )  # fmt: skip
    table = result.table
    assert list(table["workers"]) == [1, 2] and list(table["global_batch"]) == [64, 128]
    ratio = table["samples_per_s"].iloc[1] / table["samples_per_s"].iloc[0]
    assert table["speedup"].iloc[1] == pytest.approx(ratio)
    assert table["efficiency"].iloc[1] == pytest.approx(ratio / 2)
    assert table["comm_fraction"].iloc[0] == 0.0 and table["comm_time_s"].iloc[1] > 0
    names = [trace.name for trace in result.figure.data]
    assert "ideal" in names and any(n.startswith("predicted (α =") for n in names)
    ideal = next(t for t in result.figure.data if t.name == "ideal")
    assert list(ideal.x) == [1, 2, 4, 16] and list(ideal.y) == [1, 2, 4, 16]
    assert result.model is not None and result.model.beta > 0
    assert list(result.prediction["workers"]) == [1, 2, 4, 16]
    # the model check: each measured count against its prediction, reported either way
    errors = table["prediction_error"].abs()
    assert errors.iloc[0] == pytest.approx(0.0)  # one worker: no communication, compute as measured
    assert result.validated == bool((errors <= 0.20).all())


@pytest.mark.engines
def test_loss_optimizer_and_metrics_reach_every_point() -> None:
    from train_cases import PASSED, RegressionMLP, passed_through, regression

    from rapydli.experiments.store import open_store

    config = rd.TrainConfig(batch_size=4, lr=0.02, allreduce="mpi")
    with rd.Cluster(n=2) as cluster:
        result = rd.scaling_study(RegressionMLP, regression, config, workers=[1, 2], steps=4, cluster=cluster, live=False, **PASSED)
    points, _ = open_store().list_runs(parent=result.run_id)
    assert sorted(p["name"] for p in points) == ["scaling-1", "scaling-2"]
    for point in points:
        passed_through(open_store().final_metrics(point["id"]), 0.02)
