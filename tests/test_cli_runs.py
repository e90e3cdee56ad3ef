"""``rapydli runs list|show|compare|repeat|export`` over a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from rapydli import settings
from rapydli.cli import cli, main
from rapydli.experiments.store import runstore as store_mod

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> store_mod.RunStore:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(settings.PARENT_RUN, raising=False)
    monkeypatch.chdir(tmp_path)
    return store_mod.open_store()


def invoke(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def two_runs(store: store_mod.RunStore) -> tuple[str, str]:
    config = {"lr": 0.1, "epochs": 1, "seed": 0}
    a = store.create_run("train", "mlp", {"model_fn": "m:f", "data_fn": "d:g", "config": config}, world_size=2, seed=0)
    store.log_metrics(a, [(1, "loss", 1.0), (2, "loss", 0.5), (2, "val_accuracy", 0.9)])
    store.finish_run(a)
    b = store.create_run(
        "train", "mlp", {"model_fn": "m:f", "data_fn": "d:g", "config": {**config, "lr": 0.01}}, seed=0
    )
    store.log_metrics(b, [(2, "loss", 0.8), (2, "val_accuracy", 0.7)])
    store.finish_run(b, "failed", error="RankFailure: rank 1 died")
    return a, b


def test_list_filters_and_json(two_runs: tuple[str, str], store: store_mod.RunStore) -> None:
    a, b = two_runs
    sweep = store.create_run("sweep", "sw", {})
    out = invoke("runs", "list")
    assert out.index(sweep) < out.index(b) < out.index(a)  # newest first
    assert "finished" in out and "failed" in out
    out = invoke("runs", "list", "--status", "failed")
    assert b in out and a not in out
    out = invoke("runs", "list", "--kind", "train", "-n", "1")
    assert b in out and a not in out and "(1 of 2 runs" in out
    rows = json.loads(invoke("runs", "list", "--json"))  # one JSON array, not JSON lines
    assert [r["id"] for r in rows] == [sweep, b, a] and rows[2]["started"].endswith("Z")
    assert json.loads(invoke("runs", "list", "--json", "--kind", "tune")) == []


def test_show_prints_params_metrics_and_error(two_runs: tuple[str, str]) -> None:
    a, b = two_runs
    out = invoke("runs", "show", a[:6])
    assert f"run {a}  train  mlp  [finished]" in out
    assert "loss = 0.5" in out and "val_accuracy = 0.9" in out and "world_size  2" in out
    assert "rapydli 0.1.0" in out
    assert "RankFailure: rank 1 died" in invoke("runs", "show", b)
    payload = json.loads(invoke("runs", "show", a, "--json"))
    assert payload["final_metrics"] == {"loss": 0.5, "val_accuracy": 0.9} and payload["params"]["config"]["lr"] == 0.1


def test_compare_shows_differences_and_metrics(two_runs: tuple[str, str]) -> None:
    a, b = two_runs
    out = invoke("runs", "compare", a, b)
    assert "parameters that differ:" in out and "config.lr" in out and "config.epochs" not in out
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["config.lr"] == ["0.1", "0.01"]
    assert lines["loss"] == ["(last)", "0.5", "0.8"] and lines["val_accuracy"] == ["(eval)", "0.9", "0.7"]
    assert "config.epochs" in invoke("runs", "compare", a, b, "--all-params")


def test_tags_and_note_round_trip(two_runs: tuple[str, str], store: store_mod.RunStore) -> None:
    a, _ = two_runs
    assert invoke("runs", "tag", a[:6], "best", "baseline").strip() == f"{a}: best baseline"
    assert invoke("runs", "tag", a, "best").strip() == f"{a}: best baseline"  # adding twice keeps one
    assert invoke("runs", "tag", a, "--remove", "baseline").strip() == f"{a}: best"
    assert invoke("runs", "tag", a).strip() == f"{a}: best"
    assert store.tags(a) == ["best"]
    invoke("runs", "note", a, "lr 0.1 wins;\nuse it for the paper")
    assert invoke("runs", "note", a).strip() == "lr 0.1 wins;\nuse it for the paper"
    out = invoke("runs", "show", a)
    assert "tags        best" in out and "note        lr 0.1 wins;" in out
    assert json.loads(invoke("runs", "show", a, "--json"))["tags"] == ["best"]
    invoke("runs", "note", a, "--clear")
    assert store.get_run(a)["note"] is None


def test_export_jsonl_and_csv(two_runs: tuple[str, str], tmp_path: Path) -> None:
    a, b = two_runs
    invoke("runs", "export", "-o", str(tmp_path / "runs.jsonl"))
    rows = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert {r["id"] for r in rows} == {a, b}
    by_id = {r["id"]: r for r in rows}
    assert [m["value"] for m in by_id[a]["metrics"] if m["name"] == "loss"] == [1.0, 0.5]
    invoke("runs", "export", a, "--format", "csv", "-o", str(tmp_path / "runs.csv"))
    table = pd.read_csv(tmp_path / "runs.csv", dtype={"id": str})  # a hex id may be all digits
    assert list(table["id"]) == [a] and table.loc[0, "params.config.lr"] == 0.1 and table.loc[0, "metric.loss"] == 0.5


def test_user_mistakes_are_one_line_exit_2(
    two_runs: tuple[str, str], store: store_mod.RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = store.create_run("sweep", "sw", {})
    lam = store.create_run("train", "lam", {"model_fn": "<function <lambda>>", "data_fn": "d:g", "config": {}})
    for argv, message in (
        (["runs", "show", "nope"], "no run 'nope'"),
        (["runs", "show", "../x"], "run ids are"),
        (["runs", "compare", two_runs[0]], "at least two run ids"),
        (["runs", "tag", two_runs[0], "has space"], "tag 'has space' is invalid"),
        (["runs", "note", two_runs[0], "x", "--clear"], "either TEXT or --clear"),
        (["runs", "repeat", sweep], "is a sweep run; only train and batch runs can be repeated"),
        (["runs", "repeat", lam], "not an importable 'module:qualname'"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("rapydli: error: ") and message in err and err.count("\n") == 1, err


def test_store_off_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RAPYDLI_STORE", "off")
    assert main(["runs", "list"]) == 2
    assert "disabled (RAPYDLI_STORE=off)" in capsys.readouterr().err


@pytest.mark.notebook
def test_repeat_a_batch_item_with_the_same_parameters(store: store_mod.RunStore, tmp_path: Path) -> None:
    from rapydli.experiments.batch.batch import batch

    first = batch(NOTEBOOKS / "params.ipynb", {"x": [3], "label": ["zz"]}, out="out", progress=False)
    item = first.loc[0, "run_id"]
    out = invoke("runs", "repeat", item)
    new_id = out.split(" as run ")[1].split()[0]
    assert new_id != item and "[finished]" in out
    again = store.get_run(new_id)
    assert again["params"]["parameters"] == {"x": 3, "label": "zz"}
    assert store.records(new_id)["y"]["value"] == 6.0
    # the recorded batch itself can be repeated as a whole
    batch_id = store.get_run(item)["parent"]
    out = invoke("runs", "repeat", batch_id, "--out", str(tmp_path / "again"))
    assert (tmp_path / "again" / "summary.csv").exists() and "[finished]" in out


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_repeat_a_train_run_with_the_same_seed(store: store_mod.RunStore) -> None:
    from rapydli.experiments.run import run_training

    config = {"lr": 0.05, "epochs": 1, "max_steps": 3, "batch_size": 16, "optimizer": "sgd", "seed": 3, "workers": 1}
    first = run_training("rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", config, progress=False)
    out = invoke("runs", "repeat", first.run_id)
    new_id = out.split(" as run ")[1].split()[0]
    a, b = store.get_run(first.run_id), store.get_run(new_id)
    assert b["kind"] == "train" and b["status"] == "finished" and b["params"] == a["params"] and b["seed"] == 3
    losses = [[m["value"] for m in store.metrics(r) if m["name"] == "loss"] for r in (first.run_id, new_id)]
    assert losses[0] == pytest.approx(losses[1])  # same seed, same data order: the same run again


def test_show_prints_notebook_sources_and_repeat_refuses_them(
    store: store_mod.RunStore, capsys: pytest.CaptureFixture[str]
) -> None:
    source = "class Net(nn.Module):\n    def forward(self, x):\n        return x\n"
    params = {"model_fn": "<notebook> model_fn", "data_fn": "d:g", "config": {"lr": 0.1},
              "loss_fn": "<notebook> my_loss", "sources": {"Net": source}}  # fmt: skip
    run = store.create_run("train", "net", params, seed=0)
    store.finish_run(run)
    out = invoke("runs", "show", run)
    assert "source of Net (defined in the notebook):" in out and "        return x" in out
    assert "sources =" not in out
    assert main(["runs", "repeat", run]) == 2
    assert "not an importable 'module:qualname'" in capsys.readouterr().err

    params = {"model_fn": "m:f", "data_fn": "d:g", "config": {"lr": 0.1}, "loss_fn": "<notebook> my_loss"}
    run = store.create_run("train", "net", params, seed=0)
    assert main(["runs", "repeat", run]) == 2
    err = capsys.readouterr().err
    assert "its loss_fn was recorded as '<notebook> my_loss'" in err and "rapydli runs show" in err, err


def test_list_fits_an_80_column_terminal_without_cutting_the_parameters(
    store: store_mod.RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parameters that differ are wrapped under each run, whole, not cut with '...' nor wider than the terminal."""
    monkeypatch.setenv("COLUMNS", "80")
    config = {
        "lr": 0.1,
        "optimizer": "adamw",
        "batch_size": 32,
        "momentum": 0.9,
        "weight_decay": 0.01,
        "warmup_steps": 100,
    }
    for changed in (
        {},
        {"lr": 0.01, "optimizer": "sgd", "batch_size": 64, "momentum": 0.5, "weight_decay": 0.1, "warmup_steps": 10},
    ):
        store.finish_run(
            store.create_run("train", "gpt2-small-finetune", {"model_fn": "m:f", "config": {**config, **changed}})
        )
    out = invoke("runs", "list")
    assert all(len(line) <= 80 for line in out.splitlines()), out
    flat = " ".join(out.split())
    for key, value in (
        ("lr", "0.01"),
        ("optimizer", "sgd"),
        ("batch_size", "64"),
        ("momentum", "0.5"),
        ("weight_decay", "0.1"),
        ("warmup_steps", "10"),
    ):
        assert f"{key}={value}" in flat, out
    assert "..." not in out
    help_text = CliRunner().invoke(cli, ["--help"], terminal_width=80).output  # every command's summary whole, wrapped
    commands = help_text.split("Commands:")[1].splitlines()
    assert not any(line.endswith("...") for line in commands) and all(
        len(line) <= 80 for line in help_text.splitlines()
    ), help_text


def test_show_tells_the_world_size_over_time_and_each_restart(store: store_mod.RunStore) -> None:
    run = store.create_run("train", "mlp", {"model_fn": "m:f", "data_fn": "d:g", "config": {}}, world_size=4)
    restarts = [
        {
            "time": 0.0,
            "cause": "host h2 down",
            "ranks": [2, 3],
            "resumed_from_step": 4,
            "workers": 2,
            "recovery_s": 6.25,
        },
        {"time": 1.0, "cause": "rank 1 died", "ranks": [1], "resumed_from_step": 8, "workers": 1},
    ]
    store.add_record(run, "restarts", "json", restarts)
    store.finish_run(run)
    out = invoke("runs", "show", run)
    assert "  world size  4 (from step 1), 2 (from step 5), 1 (from step 9)\n" in out, out
    assert "  restart     host h2 down; resumed from step 4 on 2 ranks 6.25 s later\n" in out, out
    assert "  restart     rank 1 died; resumed from step 8 on 1 rank\n" in out, out


def test_delete_removes_runs_their_children_and_the_models_they_kept_not_the_users_checkpoints(
    store: store_mod.RunStore, tmp_path: Path
) -> None:
    from rapydli.paths import subdir

    sweep = store.create_run("sweep", "sw", {})
    trial = store.create_run(
        "trial", "sw-trial-0", {"config": {"checkpoint_dir": str(tmp_path / "mine")}}, parent=sweep
    )
    kept = subdir("models") / trial
    kept.mkdir(parents=True)
    (kept / "checkpoint.pt").write_bytes(b"x")
    (tmp_path / "mine").mkdir()
    store.add_record(trial, "model", "json", {"directory": str(kept)})
    store.log_metrics(trial, [(1, "loss", 1.0)])
    store.add_tags(trial, ["keep"])
    other = store.create_run("train", "other", {})
    for run in (trial, sweep, other):
        store.finish_run(run)
    running = store.create_run("train", "busy", {})
    with pytest.raises(Exception, match="is running: stop it first"):
        CliRunner().invoke(cli, ["runs", "delete", running], catch_exceptions=False)

    out = invoke("runs", "delete", sweep[:8])
    assert (
        f"deleted {sweep} (sweep sw)" in out
        and f"deleted {trial} (trial sw-trial-0), its model {kept.resolve()}" in out
    )
    assert f"its checkpoint_dir {tmp_path / 'mine'} stays" in out
    assert not kept.exists() and (tmp_path / "mine").is_dir()
    assert {r["id"] for r in store.list_runs()[0]} == {other, running}
    assert store.metrics(trial) == [] and store.records(trial) == {}
