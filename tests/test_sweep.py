"""``rd.sweep`` on 2 real engines: trials side by side, a bad trial pruned, a failing trial recorded, the store."""

from __future__ import annotations

import os
import signal
import time

import pytest

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.store.runstore import open_store
from rapydli.experiments.sweep.space import validate_space
from rapydli.experiments.sweep.sweep import Sweep
from rapydli.zoo import datasets, models


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def test_bad_spaces_and_arguments_fail_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="not a TrainConfig field"):
        validate_space({"learning_rate": rd.loguniform(1e-4, 1e-1)})
    with pytest.raises(ConfigError, match="loguniform"):
        rd.loguniform(0.0, 1.0)
    with pytest.raises(ConfigError, match="grid sampler"):
        rd.sweep(models.mlp, datasets.digits, rd.TrainConfig(), {"lr": rd.uniform(0.1, 0.2)}, trials=2, sampler="grid")
    with pytest.raises(ConfigError, match="pruner='hyperband'"):
        rd.sweep(
            models.mlp, datasets.digits, rd.TrainConfig(), {"lr": rd.uniform(0.1, 0.2)}, trials=2, pruner="hyperband"
        )
    with pytest.raises(
        ConfigError, match="workers_per_trial=1 cannot run pipeline_stages=2: a trial's ranks are its replicas x stages"
    ):
        rd.sweep(models.mlp, datasets.digits, rd.TrainConfig(pipeline_stages=2), {"lr": rd.uniform(0.1, 0.2)}, trials=2)
    tensor = rd.TrainConfig(pipeline_stages=2, tensor_parallel=2, workers=4)
    with pytest.raises(
        ConfigError, match="workers_per_trial=2 cannot run pipeline_stages=2 x tensor_parallel=2: .* a multiple of 4"
    ):
        rd.sweep(models.mlp, datasets.digits, tensor, {"lr": rd.uniform(0.1, 0.2)}, trials=2, workers_per_trial=2)


@pytest.mark.engines
def test_a_sweep_of_pipelined_trials_runs_and_records_them(cluster) -> None:
    config = rd.TrainConfig(
        max_steps=6, eval_every=3, batch_size=16, pipeline_stages=2, microbatches=2, pipeline_schedule="gpipe"
    )
    space = {"lr": rd.loguniform(1e-3, 1e-1), "microbatches": rd.choice([2, 4])}
    result = rd.sweep(
        models.mlp,
        datasets.digits,
        config,
        space,
        trials=2,
        workers_per_trial=2,
        cluster=cluster,
        pruner="none",
        seed=3,
        live=False,
    )
    table = result.table
    assert list(table["state"]) == ["COMPLETE", "COMPLETE"], table[["state", "error"]].to_string()
    assert list(table["ranks"]) == ["0,1", "0,1"] and list(table["steps"]) == [6, 6] and table["value"].notna().all()
    store = open_store()
    for row in table.itertuples():
        run = store.get_run(row.run_id)
        assert run["kind"] == "trial" and run["status"] == "finished" and run["world_size"] == 2
        assert (
            run["params"]["config"]["pipeline_stages"] == 2
            and run["params"]["config"]["microbatches"] == row.microbatches
        )
        assert {m["name"] for m in store.metrics(row.run_id)} >= {"loss", "val_loss", "val_accuracy"}


@pytest.mark.engines
def test_sweep_runs_two_at_a_time_prunes_a_bad_trial_and_survives_a_failing_one(cluster) -> None:
    space = {"lr": rd.loguniform(1e-3, 10.0), "grad_accum": rd.choice([1, 1000])}
    first = [
        {"lr": 0.01, "grad_accum": 1},
        {"lr": 0.02, "grad_accum": 1},
        {"lr": 0.01, "grad_accum": 1000},  # raises on the ranks: more micro-steps than batches
        {"lr": 9.0, "grad_accum": 1},  # diverges: pruned at its first report
    ]
    config = rd.TrainConfig(max_steps=25, eval_every=5, batch_size=32, allreduce="mpi")
    result = rd.sweep(models.mlp, datasets.digits, config, space, trials=4, cluster=cluster, enqueue=first, live=False)
    assert cluster.run(lambda: 5) == [5, 5]
    table = result.table.set_index("trial")
    # successive halving may also prune the worse of the two good trials (they meet at the same rungs)
    assert "COMPLETE" in set(table.loc[[0, 1], "state"]) and set(table.loc[[0, 1], "state"]) <= {"COMPLETE", "PRUNED"}
    assert table.loc[2, "state"] == "FAIL" and "grad_accum" in table.loc[2, "error"]
    assert (
        "full traceback" not in table.loc[2, "error"] and len(table.loc[2, "error"].splitlines()) < 10
    )  # said once, short
    assert table.loc[3, "state"] == "PRUNED" and table.loc[3, "steps"] < 25
    complete = table[table["state"] == "COMPLETE"]
    assert result.best_params == {"lr": pytest.approx(complete.loc[complete["value"].idxmin(), "lr"]), "grad_accum": 1}
    assert sorted(table.loc[[0, 1], "ranks"]) == ["0", "1"]  # two groups of one engine

    store = open_store()
    sweep_run = store.get_run(result.run_id)
    assert sweep_run["kind"] == "sweep" and sweep_run["status"] == "finished"
    children = [store.get_run(run_id) for run_id in table["run_id"]]
    assert all(c["kind"] == "trial" and c["parent"] == result.run_id for c in children)
    a, b = children[0], children[1]
    assert a["started"] < b["ended"] and b["started"] < a["ended"]  # trials 0 and 1 ran at the same time
    assert children[3]["status"] == "pruned" and children[2]["status"] == "failed"
    assert "trial_state" not in store.records(children[3]["id"])  # the state is recorded once: the run's status
    decision = store.records(children[3]["id"])["prune"]["value"]  # why: the report it was pruned at, and the bar
    assert (
        decision["pruner"] == "SuccessiveHalvingPruner"
        and decision["metric"] == "val_loss"
        and decision["step"] == table.loc[3, "steps"]
    )
    assert decision["value"] is None or decision["value"] == pytest.approx(table.loc[3, "value"])
    assert decision["text"].startswith(f"pruned at step {decision['step']} with val_loss ") and decision["rule"]
    assert all("prune" not in store.records(c["id"]) for c, state in zip(children, table["state"]) if state != "PRUNED")
    assert store.list_runs(parent=result.run_id, status="pruned")[1] == (table["state"] == "PRUNED").sum()

    # the sweep's "best" is the best trial's value, the one Optuna was told, everywhere it is shown
    told = {t.number: t.value for t in result.study.trials}
    for number, row in table.iterrows():
        if row["state"] in ("COMPLETE", "PRUNED"):
            assert row["value"] == pytest.approx(told[number])
    assert result.best_value == pytest.approx(result.study.best_value) == pytest.approx(complete["value"].min())
    assert result.best_trial == result.study.best_trial.number
    running_best = complete["value"].cummin().reindex(table.index).ffill()
    assert list(table["best"].dropna()) == pytest.approx(list(running_best.dropna()))
    assert table["best"].iloc[-1] == pytest.approx(result.study.best_value)
    final = store.final_metrics(result.run_id)  # what the panel and `runs list` show as the sweep's value
    assert final["val_loss"] == pytest.approx(result.study.best_value) and final["best_trial"] == result.best_trial
    names = [trace.name for trace in result.figure.data]
    assert "complete" in names and "pruned" in names and any(t.type == "parcoords" for t in result.figure.data)


class _InterruptOnceTraining:
    """A sweep view that presses Ctrl-C (SIGINT to this process) once both trials are training."""

    def __init__(self) -> None:
        self.sent_at: float | None = None

    def update(self, table, force: bool = False) -> None:
        if self.sent_at is None and len(table) == 2 and (table["steps"] > 0).all():
            self.sent_at = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)


@pytest.mark.engines
def test_ctrl_c_stops_the_sweep_and_its_trials(cluster) -> None:
    view = _InterruptOnceTraining()
    config = rd.TrainConfig(epochs=500, eval_every=5, batch_size=32, allreduce="mpi")  # far longer than the test
    # no pruner: a trial pruned before both report steps would let a third one start
    runner = Sweep(
        models.mlp,
        datasets.digits,
        config,
        {"lr": rd.loguniform(1e-3, 1e-2)},
        trials=6,
        cluster=cluster,
        view=view,
        pruner="none",
    )
    result = runner.run()
    returned = time.monotonic()
    # a sweep that ignored Ctrl-C would train 500 epochs (minutes): the bound tells that apart, not speed (load varies)
    assert view.sent_at is not None and returned - view.sent_at < 60.0
    assert len(result.table) == 2 and set(result.table["state"]) == {"FAIL"}  # the running trials, ended and recorded
    assert open_store().get_run(result.run_id)["status"] == "interrupted"
    assert cluster.run(lambda: 6) == [6, 6]  # no orphaned work: the engines answer at once


@pytest.mark.engines
def test_a_trial_that_kills_its_engine_fails_and_the_sweep_restarts_the_cluster(cluster, tmp_path) -> None:
    marker = str(tmp_path / "died")

    def data_killing_the_first_engine():
        from rapydli.zoo import datasets as data

        try:  # the first trial to get here takes its engine down (a segfault, an OOM kill)
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
            os._exit(1)
        except FileExistsError:
            return data.digits()

    config = rd.TrainConfig(max_steps=6, eval_every=3, batch_size=32, allreduce="mpi")
    result = rd.sweep(
        models.mlp,
        data_killing_the_first_engine,
        config,
        {"lr": rd.loguniform(1e-3, 1e-2)},
        trials=3,
        cluster=cluster,
        pruner="none",
        live=False,
    )
    states = list(result.table["state"])
    errors = result.table[["trial", "state", "error"]].to_string()
    assert states[-1] == "COMPLETE" and "FAIL" in states, errors  # the sweep went on after the failure
    failed = result.table[result.table["state"] == "FAIL"]
    assert failed["error"].str.contains("died").any()
    # a trial ended only because MPI took its ranks down with the dead engine runs again, same parameters
    table = result.table.reset_index(drop=True)
    for position in table.index[table["error"].str.contains("run again", na=False)]:
        assert (table.loc[position + 1 :, "lr"] == table.loc[position, "lr"]).any(), errors
    assert len(table) - len(table.index[table["error"].str.contains("run again", na=False)]) == 3
    assert cluster.running and cluster.run(lambda: 8) == [8, 8]


@pytest.mark.engines
def test_loss_optimizer_and_metrics_reach_every_trial(cluster) -> None:
    from train_cases import PASSED, RegressionMLP, passed_through, regression

    config = rd.TrainConfig(max_steps=4, batch_size=4, allreduce="mpi")
    result = rd.sweep(
        RegressionMLP,
        regression,
        config,
        {"lr": rd.loguniform(1e-3, 1e-1)},
        trials=2,
        cluster=cluster,
        pruner="none",
        metric="val_mae",
        live=False,
        **PASSED,
    )
    assert list(result.table["state"]) == ["COMPLETE", "COMPLETE"], result.table.to_string()
    for _, trial in result.table.iterrows():
        final = open_store().final_metrics(trial["run_id"])
        passed_through(final, trial["lr"])
        assert trial["value"] == pytest.approx(final["val_mae"])  # the user's metric is what the sweep optimised


def _views(run_id: str, metric: str = "val_loss") -> dict[str, str]:
    """A trial's state as each front end shows it: the store, ``rapydli runs show``, the REST routes."""
    from click.testing import CliRunner

    from rapydli.cli import cli
    from rapydli.experiments.sweep.lifecycle import state_of
    from rapydli.server.run_handlers import _trial

    store = open_store()
    run = store.get_run(run_id)
    shown = CliRunner().invoke(cli, ["runs", "show", run_id], catch_exceptions=False).output.splitlines()[0]
    return {
        "store": state_of(run["status"]),
        "cli": state_of(shown.rsplit("[", 1)[1].rstrip("]")),
        "rest": _trial(store, run, metric)["state"],
    }


def _last_steps(run_id: str) -> dict[str, int]:
    """The last step each rank trained, from the store (rank 0's loss; the others' step timings)."""
    last: dict[str, int] = {}
    for row in open_store().metrics(run_id):
        if row["name"] == "loss" or row["name"].startswith("step_time_s@rank"):
            key = row["name"].partition("@")[2] or "rank0"
            last[key] = max(last.get(key, 0), row["step"])
    return last


@pytest.mark.engines
def test_a_pruned_trial_stops_on_all_its_ranks_within_a_step_and_every_view_says_pruned(cluster) -> None:
    import optuna

    config = rd.TrainConfig(max_steps=30, epochs=2, eval_every=5, batch_size=32, allreduce="mpi")
    # the first trial is pruned at its first report (step 5); the second runs to the end
    pruner = optuna.pruners.ThresholdPruner(upper=5.0)
    result = rd.sweep(
        models.mlp,
        datasets.digits,
        config,
        {"lr": rd.loguniform(1e-3, 10.0)},
        trials=2,
        workers_per_trial=2,
        cluster=cluster,
        pruner=pruner,
        enqueue=[{"lr": 8.0}, {"lr": 0.05}],
        live=False,
    )
    table = result.table.set_index("trial")
    assert list(table["state"]) == ["PRUNED", "COMPLETE"], table[["state", "error"]].to_string()
    pruned, complete = table.loc[0, "run_id"], table.loc[1, "run_id"]
    decision = open_store().records(pruned)["prune"]["value"]["step"]
    assert decision == 5
    last = _last_steps(pruned)
    assert set(last) == {"rank0", "rank1"} and all(step <= decision + 1 for step in last.values()), last
    assert _last_steps(complete) == {"rank0": 30, "rank1": 30}
    assert _views(pruned) == {"store": "PRUNED", "cli": "PRUNED", "rest": "PRUNED"}
    assert _views(complete) == {"store": "COMPLETE", "cli": "COMPLETE", "rest": "COMPLETE"}
    assert result.best_trial == 1 and result.best_params == {"lr": pytest.approx(0.05)}


@pytest.mark.engines
def test_a_grid_sweep_runs_its_whole_grid_with_pruned_and_failed_points_and_ends_normally(cluster) -> None:
    import optuna

    config = rd.TrainConfig(max_steps=10, eval_every=5, batch_size=32, allreduce="mpi")
    space = {"lr": rd.choice([0.05, 8.0]), "grad_accum": rd.choice([1, 1000])}  # grad_accum 1000 raises on the ranks
    result = rd.sweep(
        models.mlp,
        datasets.digits,
        config,
        space,
        trials=10,
        workers_per_trial=2,
        cluster=cluster,
        sampler="grid",
        pruner=optuna.pruners.ThresholdPruner(upper=5.0),
        live=False,
    )
    table = result.table
    points = {(row.lr, row.grad_accum): row.state for row in table.itertuples()}
    assert len(table) == 4 and points == {
        (0.05, 1): "COMPLETE",
        (8.0, 1): "PRUNED",
        (0.05, 1000): "FAIL",
        (8.0, 1000): "FAIL",
    }, points
    assert open_store().get_run(result.run_id)["status"] == "finished"
    assert result.best_params == {"lr": 0.05, "grad_accum": 1}


class _StopWhenSecondTrains:
    """A sweep view that stops the sweep (the panel's Stop) once the second trial has reported."""

    def __init__(self) -> None:
        self.runner: Sweep | None = None

    def update(self, table, force: bool = False) -> None:
        if self.runner is not None and len(table) == 2 and table["steps"].iloc[1] > 0:
            self.runner.stop()


@pytest.mark.engines
def test_a_stopped_sweep_records_true_states_and_its_best_is_a_complete_trial(cluster) -> None:
    view = _StopWhenSecondTrains()
    config = rd.TrainConfig(max_steps=20, eval_every=2, batch_size=32, allreduce="mpi")
    runner = Sweep(
        models.mlp,
        datasets.digits,
        config,
        {"max_steps": rd.choice([20, 5000])},
        trials=3,
        workers_per_trial=2,
        cluster=cluster,
        view=view,
        pruner="none",
        enqueue=[{"max_steps": 20}, {"max_steps": 5000}],
    )
    view.runner = runner
    result = runner.run()
    table = result.table.set_index("trial")
    assert list(table["state"]) == ["COMPLETE", "FAIL"], table[["state", "error"]].to_string()
    assert "stopped with the sweep" in table.loc[1, "error"]
    assert _views(table.loc[0, "run_id"])["store"] == "COMPLETE"
    assert _views(table.loc[1, "run_id"]) == {"store": "FAIL", "cli": "FAIL", "rest": "FAIL"}
    stopped = open_store().get_run(
        table.loc[1, "run_id"]
    )  # recorded once, as the sweep told Optuna (not "interrupted")
    assert stopped["status"] == "failed" and "stopped with the sweep" in stopped["error"]
    assert result.best_trial == 0 and result.best_params == {"max_steps": 20}
    assert open_store().get_run(result.run_id)["status"] == "finished"
