"""The command line's rough edges (#27): what differs, whole configs, rounded floats,
run-level final metrics, usage text, stopping every cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli import settings
from rapydli.cli import cli
from rapydli.experiments.store import runstore as store_mod

BASE = {"allreduce": "auto", "autotune": False, "autotune_budget": 8, "batch_size": 32, "epochs": 3, "lr": 0.1,
        "optimizer": "sgd", "seed": 0, "zero_stage": 0, "checkpoint_dir": "/a/very/long/path/" + "x" * 80}  # fmt: skip


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


def _train(store: store_mod.RunStore, **config: object) -> str:
    return store.create_run("train", "mlp", {"model_fn": "m:f", "data_fn": "d:g", "config": {**BASE, **config}}, seed=0)


def test_list_shows_the_params_that_differ(store: store_mod.RunStore) -> None:
    a = _train(store, lr=0.02693883019285411)
    b = _train(store, lr=0.1, batch_size=64)
    out = invoke("runs", "list")
    rows: dict[str, str] = {}
    for line in out.splitlines()[1:]:  # a narrow terminal puts a run's parameters on indented lines under it
        if line.startswith(" ") and rows:
            rows[next(reversed(rows))] += " " + line.strip()
        else:
            rows[line.split()[0]] = line
    assert "batch_size=32 lr=0.02694" in rows[a] and "batch_size=64 lr=0.1" in rows[b]
    assert "allreduce" not in out and "autotune" not in out  # the same on every row: not shown


def test_show_prints_the_whole_config_with_rounded_floats(store: store_mod.RunStore) -> None:
    a = _train(store, lr=0.02693883019285411)
    store.log_metrics(a, [(1, "val_accuracy", 0.8245125348189415)])
    out = invoke("runs", "show", a)
    assert "config.checkpoint_dir = " + BASE["checkpoint_dir"] in out  # not cut short
    assert "config.zero_stage = 0" in out and "config.lr = 0.02694" in out
    assert "val_accuracy = 0.8245" in out and "0.82451" not in out
    payload = json.loads(invoke("runs", "show", a, "--json"))  # JSON keeps every digit
    assert payload["params"]["config"]["lr"] == 0.02693883019285411
    assert payload["final_metrics"]["val_accuracy"] == 0.8245125348189415


def test_compare_final_metrics_are_the_runs(store: store_mod.RunStore) -> None:
    a, b = _train(store, lr=0.1), _train(store, lr=0.2)
    for run, slow in ((a, 0.5), (b, 0.1)):  # 3 steps of 100 samples; the last one slow
        rows = []
        for step, seconds in ((1, 0.1), (2, 0.1), (3, slow)):
            rows += [(step, "loss", 1.0 / step), (step, "samples_per_s", 100 / seconds), (step, "step_time_s", seconds)]
        rows += [(3, "val_loss", 0.4), (3, "val_accuracy", 0.8245125348189415)]
        store.log_metrics(run, rows)
    out = invoke("runs", "compare", a, b)
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    # the run's mean: 300 samples over 0.7 s and 0.3 s, not the last step's 200 and 1000
    assert lines["samples_per_s"][-2:] == ["428.6", "1000"] and "(mean)" in lines["samples_per_s"]
    assert lines["val_accuracy"][-2:] == ["0.8245", "0.8245"] and "(eval)" in lines["val_accuracy"]
    assert "(last)" in lines["loss"]
    assert "mean: run mean: samples over step time" in out and "eval: last evaluation" in out


def test_cluster_start_usage_names_its_arguments() -> None:
    out = invoke("cluster", "start", "--help")
    assert "cluster start [OPTIONS] [KEY=VALUE]..." in out
    assert "[OPTIONS] [OPTIONS]" not in out


@pytest.mark.engines
def test_cluster_stop_all_stops_every_cluster(tmp_path: Path) -> None:
    env = {**os.environ, "RAPYDLI_HOME": str(tmp_path / "home")}
    rapydli = [sys.executable, "-m", "rapydli", "cluster"]
    ids = []
    for _ in range(2):
        started = subprocess.run([*rapydli, "start", "-n", "1"], capture_output=True, text=True, env=env, timeout=180)
        assert started.returncode == 0, started.stderr
        ids.append(started.stdout.strip())
    stopped = subprocess.run([*rapydli, "stop", "--all"], capture_output=True, text=True, env=env, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert sorted(line.split()[1] for line in stopped.stdout.splitlines()) == sorted(ids)
    status = subprocess.run([*rapydli, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert status.stdout.strip() == "no clusters"
