"""``rd.scaling_study`` and the alpha-beta model: table, figure, prediction check."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.planning.perfmodel import RingModel, fit_ring, predict_step_time
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
    with pytest.raises(ConfigError, match=r"pipeline_stages=\[3\] divide none of workers=\[1, 2\]"):
        rd.scaling_study(models.mlp, datasets.digits, rd.TrainConfig(), workers=[1, 2], pipeline_stages=[1, 3])
    # a replica of a tensor-parallel config is its stages x tensor_parallel ranks
    with pytest.raises(
        ConfigError, match=r"pipeline_stages=\[2\] divide none of workers=\[2, 3\]: .* a multiple of 2 x it"
    ):
        rd.scaling_study(
            models.mlp,
            datasets.digits,
            rd.TrainConfig(tensor_parallel=2, workers=2),
            workers=[2, 3],
            pipeline_stages=[1, 2],
        )
    with pytest.raises(ConfigError, match="pipeline_stages=\\[0\\] is invalid: a list of integers >= 1"):
        rd.scaling_study(models.mlp, datasets.digits, rd.TrainConfig(), pipeline_stages=[0])
    with pytest.raises(ConfigError, match="predict and network model data parallelism: add 1 to pipeline_stages"):
        rd.scaling_study(models.mlp, datasets.digits, rd.TrainConfig(), workers=[2], pipeline_stages=[2], predict=[4])
    # every point's config is checked before anything starts: 4 microbatches cannot cut a strong point's batch of 2
    with pytest.raises(ConfigError, match="microbatches=4 is larger than batch_size=2"):
        rd.scaling_study(
            models.mlp,
            datasets.digits,
            rd.TrainConfig(batch_size=4, microbatches=4),
            workers=[1, 2, 4],
            pipeline_stages=[1, 2],
            mode="strong",
        )


@pytest.mark.engines
def test_scaling_table_figure_and_prediction() -> None:
    with rd.Cluster(n=2) as cluster:
        result = rd.scaling_study(
            models.mlp,
            datasets.digits,
            rd.TrainConfig(batch_size=64, allreduce="mpi"),
            workers=[1, 2],
            steps=12,
            predict=[4, 16],
            cluster=cluster,
            live=False,
        )
    table = result.table
    assert list(table["workers"]) == [1, 2] and list(table["global_batch"]) == [64, 128]
    assert list(table["repeats"]) == [3, 3]  # interleaved rounds: the median ratio of each round's, and the range
    low, speedup, high = table[["speedup_low", "speedup", "speedup_high"]].iloc[1]
    assert low <= speedup <= high and table["speedup"].iloc[0] == 1.0
    if table["flag"].iloc[1]:  # more than ideal: an artefact of the load, not a result
        assert math.isnan(table["efficiency"].iloc[1]) and "load" in table["flag"].iloc[1]
    else:
        assert table["efficiency"].iloc[1] == pytest.approx(speedup / 2) and speedup / 2 <= 1.0
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
    widths = (table["step_time_high_s"] - table["step_time_low_s"]) / table["step_time_s"]
    assert result.validated == bool((errors <= 0.20).all() and (widths <= 0.20).all())
    assert result.validated or any(note.startswith("not validated") for note in result.notes) or (errors > 0.20).any()
    # past the measured counts the prediction says it is an extrapolation, in the table and the figure's title, and of
    # which model: one validated here or not
    word = "validated" if result.validated else "NOT validated"
    assert (
        list(result.prediction["basis"]) == ["measured count (checked)"] * 2 + [f"extrapolated, model {word} here"] * 2
    )
    assert "beyond 2 workers the dashed line is an extrapolation" in result.figure.layout.title.text


@pytest.mark.engines
def test_loss_optimizer_and_metrics_reach_every_point(tmp_path, monkeypatch) -> None:
    from trackers_files import tensorboard_texts
    from train_cases import PASSED, RegressionMLP, passed_through, regression

    from rapydli.experiments.store.runstore import open_store
    from rapydli.experiments.trackers.sync import links

    monkeypatch.setenv("RAPYDLI_TENSORBOARD_DIR", str(tmp_path))
    config = rd.TrainConfig(batch_size=4, lr=0.02, allreduce="mpi", trackers="tensorboard")
    with rd.Cluster(n=2) as cluster:
        result = rd.scaling_study(
            RegressionMLP, regression, config, workers=[1, 2], steps=4, cluster=cluster, live=False, repeats=1, **PASSED
        )
    points, _ = open_store().list_runs(parent=result.run_id)
    assert sorted(p["name"] for p in points) == ["scaling-1", "scaling-2"]
    for point in points:
        passed_through(open_store().final_metrics(point["id"]), 0.02)
    study = Path(
        links(open_store(), result.run_id)["tensorboard"]["logdir"]
    )  # the study's tracker run, its points inside it
    assert sorted(Path(links(open_store(), p["id"])["tensorboard"]["logdir"]).parent for p in points) == [study, study]
    assert "* rapydli.status: finished" in tensorboard_texts(study, "tags")[-1]


@pytest.mark.engines
def test_scaling_varies_pipeline_stages_and_records_them() -> None:
    from rapydli.experiments.store.runstore import open_store

    config = rd.TrainConfig(batch_size=32, microbatches=2, allreduce="mpi")
    with rd.Cluster(n=2) as cluster:
        result = rd.scaling_study(
            models.mlp,
            datasets.digits,
            config,
            workers=[1, 2],
            pipeline_stages=[1, 2],
            steps=6,
            cluster=cluster,
            live=False,
            repeats=1,
        )
    table = result.table
    assert list(zip(table["workers"], table["pipeline_stages"], table["data_parallel"])) == [
        (1, 1, 1),
        (2, 1, 2),
        (2, 2, 1),
    ]
    assert list(table["global_batch"]) == [32, 64, 32]  # weak: the batch per replica is kept
    assert table["speedup"].iloc[2] == pytest.approx(
        table["samples_per_s"].iloc[2] / table["samples_per_s"].iloc[0]
    )  # one round
    assert table["ideal_speedup"].tolist() == [1, 2, 2]
    assert result.notes[0] == "pipeline_stages=2 skipped at workers=1: 1 ranks do not divide into 2-stage pipelines"
    assert all("artefact" in note for note in result.notes[1:])
    measured = {t.name: list(t.x) for t in result.figure.data if t.name and t.name.startswith("measured")}
    assert measured == {"measured, p=1": [1, 2], "measured, p=2": [2]}
    store = open_store()
    run = store.get_run(result.run_id)
    assert run["status"] == "finished" and run["params"]["pipeline_stages"] == [1, 2]
    recorded = store.records(result.run_id)["table"]["value"]
    assert [(r["workers"], r["pipeline_stages"]) for r in recorded] == [(1, 1), (2, 1), (2, 2)]
    names = {row["name"] for row in store.metrics(result.run_id)}
    assert {"speedup", "speedup@stages2"} <= names
    children, _ = store.list_runs(parent=result.run_id)
    assert sorted(c["name"] for c in children) == ["scaling-1", "scaling-2", "scaling-2-stages2"]
    assert all(c["status"] == "finished" for c in children)


def test_points_carry_the_spread_of_their_rounds_and_an_efficiency_above_1_is_flagged_not_reported() -> None:
    from rapydli.experiments.scaling import _table, summarise

    quiet, loaded = {"load_1m": 0.5, "cores": 2.0}, {"load_1m": 4.2, "cores": 2.0}

    def point(k: int, step: float, load: dict) -> dict:
        return {
            "workers": k,
            "pipeline_stages": 1,
            "data_parallel": k,
            "global_batch": 32 * k,
            "samples_per_s": 32 * k / step,
            "step_time_s": step,
            "compute_time_s": step,
            "comm_time_s": 0.0,
            "comm_wait_s": 0.0,
            "comm_fraction": 0.0,
            "hosts": "h",
            "load": load,
        }

    # the one-worker point was slowed by other work in every round: the 2-worker point looks 3x faster
    rounds = {
        (1, 1): [point(1, 0.30, loaded), point(1, 0.33, loaded), point(1, 0.27, quiet)],
        (2, 1): [point(2, 0.20, loaded), point(2, 0.21, quiet), point(2, 0.19, quiet)],
    }
    table = _table(summarise(rounds), None, 0.0)
    row = table.iloc[1]
    assert (
        row["repeats"] == 3
        and row["step_time_s"] == 0.20
        and (row["step_time_low_s"], row["step_time_high_s"]) == (0.19, 0.21)
    )
    assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"] and row["speedup"] == pytest.approx(
        2 * 0.30 / 0.20
    )
    assert math.isnan(row["efficiency"])  # never printed as a result
    assert "efficiency 1.50 > 1 is a measurement artefact" in row["flag"] and "load 4.2 on 2 cores" in row["flag"]
    assert row["speedup_verdict"] == "above 1"
    # rounds that disagree about which is faster: no conclusion
    rounds = {
        (1, 1): [point(1, 0.30, quiet), point(1, 0.30, quiet)],
        (2, 1): [point(2, 0.25, quiet), point(2, 0.70, quiet)],
    }
    row = _table(summarise(rounds), None, 0.0).iloc[1]
    assert (
        row["speedup_verdict"].startswith("not distinguishable from 1") and not row["flag"] and row["efficiency"] <= 1
    )


@pytest.mark.engines
def test_a_study_beside_a_cpu_hog_reports_its_spread_and_flags_what_the_load_made_impossible() -> None:
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with rd.Cluster(n=2) as cluster:
            result = rd.scaling_study(
                models.mlp,
                datasets.digits,
                rd.TrainConfig(batch_size=32, allreduce="mpi"),
                workers=[1, 2],
                steps=6,
                predict=[4],
                cluster=cluster,
                live=False,
                repeats=3,
            )
    finally:
        hog.kill()
        hog.wait()
    table = result.table
    assert list(table["repeats"]) == [3, 3] and (table["load"].str.contains("cores")).all()
    assert (
        (table["step_time_low_s"] <= table["step_time_s"]) & (table["step_time_s"] <= table["step_time_high_s"])
    ).all()
    assert not (table["efficiency"] > 1).any()  # an impossible value is never a result ...
    for row in table.itertuples():
        if row.flag:  # ... but flagged, with the load, in the table and the notes
            assert math.isnan(row.efficiency) and "load" in row.flag and any(row.flag in note for note in result.notes)
        if row.speedup_verdict.startswith("above"):
            assert row.speedup_low > 1
    if not result.validated:  # why not is said: the prediction's error or the rounds' disagreement
        errors = table["prediction_error"].abs()
        assert (errors > 0.20).any() or any(note.startswith("not validated") for note in result.notes)
