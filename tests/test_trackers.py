"""Trackers: choosing them (TrainConfig, RAPYDLI_TRACKERS, rd.train), and TensorBoard and W&B (offline) fed by real runs."""

from __future__ import annotations

import glob
from pathlib import Path

import pytest
from trackers_files import (
    items_notebook,
    tensorboard_scalars,
    tensorboard_texts,
    wandb_config,
    wandb_history,
    wandb_run,
)

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.store.runstore import open_store
from rapydli.experiments.trackers.sync import flat_params, links, metric_key
from rapydli.registry import TRACKERS
from rapydli.settings import settings
from rapydli.trainer.config import fields_spec


@pytest.fixture
def offline_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TensorBoard into ``tmp_path/tb`` and W&B offline into ``tmp_path`` (skipped without their extras)."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    pytest.importorskip("wandb", reason="the wandb extra is not installed")
    monkeypatch.setenv("RAPYDLI_TENSORBOARD_DIR", str(tmp_path / "tb"))
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))


def test_trackers_are_chosen_by_registered_name_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    config = rd.TrainConfig(trackers=["mlflow", "tensorboard", "mlflow"])
    assert config.trackers == "mlflow,tensorboard"
    assert rd.TrainConfig.from_dict(config.to_dict()) == config
    assert rd.TrainConfig(trackers="wandb, tensorboard").trackers == "wandb,tensorboard"
    with pytest.raises(
        ConfigError,
        match=r"TrainConfig.trackers=\['mlfow'\] is invalid: 'mlfow' is not a tracker: allowed are 'mlflow', 'tensorb",
    ):
        rd.TrainConfig(trackers=["mlfow"])
    monkeypatch.setenv("RAPYDLI_TRACKERS", "tensorboard,wandb")
    assert settings().trackers == ("tensorboard", "wandb")
    monkeypatch.setenv("RAPYDLI_TRACKERS", "neptune")
    with pytest.raises(ConfigError, match="RAPYDLI_TRACKERS='neptune' is invalid: 'neptune' is not a tracker"):
        settings()
    TRACKERS.register("mine", "rapydli.experiments.trackers.tensorboard:TensorBoardTracker")
    try:
        assert rd.TrainConfig(trackers="mine").trackers == "mine"  # a registered tracker is selectable
    finally:
        TRACKERS.unregister("mine")
    assert {spec.name: spec.type for spec in fields_spec()}["trackers"] == "str"


def test_every_front_door_takes_trackers_as_rd_train_does() -> None:
    import inspect

    assert rd.TrainConfig(trackers="mlflow").with_trackers(["tensorboard", "mlflow"]).trackers == "mlflow,tensorboard"
    assert (
        rd.TrainConfig().with_trackers("wandb").trackers == "wandb"
        and rd.TrainConfig().with_trackers(None) == rd.TrainConfig()
    )
    with pytest.raises(ConfigError, match="'mlfow' is not a tracker"):
        rd.TrainConfig().with_trackers(["mlfow"])  # refused before anything runs, as rd.train refuses it
    for front_door in (rd.train, rd.sweep, rd.scaling_study, rd.batch):
        assert "trackers" in inspect.signature(front_door).parameters, front_door.__name__


def test_stored_names_become_tracker_keys_and_flat_params() -> None:
    assert metric_key("step_time_s@rank3") == "system/rank3/step_time_s"
    assert metric_key("val_loss") == "val_loss"
    flat = flat_params({"config": {"lr": 0.1, "trackers": ""}, "targets": [0, 1], "sources": {"Net": "class Net: ..."}})
    assert flat == {"config.lr": "0.1", "config.trackers": "", "targets": "[0, 1]"}


@pytest.mark.engines
def test_a_run_writes_tensorboard_events_and_an_offline_wandb_run_with_every_scalar(
    tmp_path, monkeypatch, offline_trackers
) -> None:
    monkeypatch.setenv("RAPYDLI_TRACKERS", "wandb")  # as a batch sets it: added to the config's
    config = rd.TrainConfig(
        max_steps=10, batch_size=16, eval_every=5, allreduce="mpi", workers=2, trackers="tensorboard"
    )
    result = rd.train("rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", config, progress=False, live=False)
    store = open_store()
    stored = store.metrics(result.run_id)
    assert set(links(store, result.run_id)) == {"tensorboard", "wandb"}

    scalars = tensorboard_scalars(links(store, result.run_id)["tensorboard"]["logdir"])
    for name in ("loss", "val_loss", "step_time_s@rank1", "step_time_s"):
        expected = sorted((m["step"], m["value"]) for m in stored if m["name"] == name)
        got = sorted(scalars[metric_key(name)])
        assert [s for s, _ in got] == [s for s, _ in expected], name
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), name
    assert [s for s, _ in scalars["loss"]] == list(range(1, 11))

    (run_file,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{result.run_id}" / f"run-{result.run_id}.wandb"))
    history = wandb_history(run_file)
    for name in ("loss", "val_loss", "step_time_s@rank1"):
        expected = sorted((m["step"], m["value"]) for m in stored if m["name"] == name)
        got = sorted((row["step"], row[metric_key(name)]) for row in history if metric_key(name) in row)
        assert [s for s, _ in got] == [s for s, _ in expected], name
        assert [v for _, v in got] == pytest.approx([v for _, v in expected]), name
    assert wandb_config(run_file)["config.max_steps"] == "10"


def test_exporting_a_recorded_run_to_tensorboard_twice_leaves_one_copy(tmp_path, monkeypatch, capsys) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from rapydli.cli import main as cli_main

    monkeypatch.setenv("RAPYDLI_TENSORBOARD_DIR", str(tmp_path))
    store = open_store()
    run_id = store.create_run("train", "recorded", {"config": {"lr": 0.1}}, world_size=2)
    store.log_metrics(
        run_id,
        [(step, "loss", 1.0 / step) for step in range(1, 6)]
        + [(step, "step_time_s@rank1", 0.01) for step in range(1, 6)],
    )
    store.finish_run(run_id)
    for _ in range(2):
        assert cli_main(["runs", "export", "--to", "tensorboard", run_id]) == 0
    logdir = links(store, run_id)["tensorboard"]["logdir"]
    assert capsys.readouterr().out.count(f"{run_id} -> tensorboard {logdir}") == 2
    assert len(glob.glob(f"{logdir}/events.out.tfevents.*")) == 1
    scalars = tensorboard_scalars(logdir)
    assert [s for s, _ in scalars["loss"]] == [1, 2, 3, 4, 5] and [
        s for s, _ in scalars["system/rank1/step_time_s"]
    ] == [1, 2, 3, 4, 5]


def test_exporting_a_recorded_batch_to_tensorboard_nests_its_items_and_their_runs_once(
    tmp_path, monkeypatch, capsys
) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from rapydli.cli import main as cli_main

    monkeypatch.setenv("RAPYDLI_TENSORBOARD_DIR", str(tmp_path))
    store = open_store()  # a recorded batch, never logged: two items, each with the run its notebook trained
    batch = store.create_run("batch", "grid", {"notebook": "grid.ipynb"})
    inner: dict[str, str] = {}
    for x in (1, 2):
        item = store.create_run("batch", f"grid/item{x}", {"parameters": {"x": x}}, parent=batch)
        store.add_record(item, "score", "scalar", x * 0.5)
        inner[item] = store.create_run("train", f"inner-{x}", {"x": x}, parent=item)
        store.log_metrics(inner[item], [(step, "loss", x / step) for step in (1, 2)])
        store.finish_run(inner[item])
        store.finish_run(item)
    store.finish_run(batch)
    for _ in range(2):
        assert cli_main(["runs", "export", "--to", "tensorboard", batch]) == 0
    order = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert order == [batch, *[run for item in inner for run in (item, inner[item])]] * 2  # each after its parent
    batch_dir = Path(links(store, batch)["tensorboard"]["logdir"])
    assert batch_dir.parent == tmp_path and "batch" in "".join(tensorboard_texts(batch_dir, "tags"))
    for x, item in enumerate(inner, 1):
        item_dir, run_dir = (Path(links(store, run)["tensorboard"]["logdir"]) for run in (item, inner[item]))
        assert item_dir.parent == batch_dir and run_dir.parent == item_dir  # one folder each, inside its parent's
        for folder in (batch_dir, item_dir, run_dir):
            assert len(glob.glob(f"{folder}/events.out.tfevents.*")) == 1, (
                folder
            )  # the second export rewrote, not added
        assert tensorboard_scalars(item_dir)["score"] == [(0, pytest.approx(x * 0.5))]
        assert tensorboard_scalars(run_dir)["loss"] == [(1, pytest.approx(x)), (2, pytest.approx(x / 2))]


@pytest.mark.notebook
def test_a_batch_logged_to_tensorboard_and_offline_wandb_is_a_parent_with_one_child_per_item(
    tmp_path, monkeypatch, offline_trackers
) -> None:
    from rapydli.cli import main as cli_main

    items_notebook(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert (
        cli_main(
            [
                "batch",
                "items.ipynb",
                "--grid",
                "x=1,2",
                "--parallel",
                "2",
                "--trackers",
                "tensorboard,wandb",
                "--out",
                "out",
            ]
        )
        == 0
    )
    store = open_store()
    batch = next(
        run["id"] for run in store.list_runs(kind="batch", limit=10)[0] if run["parent"] is None
    )  # the newest batch
    items = [run["id"] for run in store.list_runs(parent=batch)[0]]
    inner = {item: store.list_runs(parent=item)[0][0] for item in items}  # the run each item's notebook recorded
    assert len(items) == 2 and sorted(run["params"]["x"] for run in inner.values()) == [1, 2]

    batch_dir = Path(links(store, batch)["tensorboard"]["logdir"])  # TensorBoard: folders inside the parent's
    assert (
        batch_dir.parent == tmp_path / "tb" and f"rapydli.run_id: {batch}" in tensorboard_texts(batch_dir, "tags")[-1]
    )
    for item in items:
        item_dir, run_dir = (Path(links(store, run)["tensorboard"]["logdir"]) for run in (item, inner[item]["id"]))
        assert item_dir.parent == batch_dir and run_dir.parent == item_dir
        assert f"rapydli.run_id: {item}" in tensorboard_texts(item_dir, "tags")[-1]
        assert tensorboard_scalars(run_dir)["loss"] == [(1, pytest.approx(inner[item]["params"]["x"]))]

    def wandb_file(run_id: str) -> str:  # W&B: one offline run per RaPyDLI run, all in the batch's group
        (found,) = glob.glob(str(tmp_path / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
        return found

    def group_and_type(run_id: str) -> tuple[str, str]:
        run = wandb_run(wandb_file(run_id))
        return run.run_group, run.job_type

    assert group_and_type(batch) == (batch, "batch")
    for item in items:
        assert group_and_type(item) == (batch, "batch") and group_and_type(inner[item]["id"]) == (batch, "train")
        history = wandb_history(wandb_file(inner[item]["id"]))
        assert [(row["step"], row["loss"]) for row in history if "loss" in row] == [
            (1, pytest.approx(inner[item]["params"]["x"]))
        ]
