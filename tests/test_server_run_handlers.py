"""The run-store routes of the REST API (families, compare, tags and notes, artifacts, sweeps,
batches) against a real Jupyter server and a real run store; clusters started by the CLI
are listed and stopped through the API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import test_server_handlers
from pytest_jupyter.jupyter_server import *  # noqa: F403 - the jp_* fixtures

from rapydli.cluster import Cluster
from rapydli.experiments.store.runstore import RunStore

# The REST fixtures and the event-loop wrapper of the handler tests, shared.
api, store, jp_server_config = (
    test_server_handlers.api,
    test_server_handlers.store,
    test_server_handlers.jp_server_config,
)
on_server_loop = test_server_handlers.on_server_loop


PRUNE = {"pruner": "SuccessiveHalvingPruner", "metric": "val_loss", "step": 2, "value": 0.77, "compared_to": 0.7, "rung": 1,
         "competing": 5, "rule": "rung 1 keeps the best 1 of 5 trials (val_loss ≤ 0.7)",
         "text": "pruned at step 2 with val_loss 0.77: rung 1 keeps the best 1 of 5 trials (val_loss ≤ 0.7)"}  # fmt: skip


def seed(store: RunStore, tmp_path: Path) -> dict[str, Any]:
    """A sweep of six trials (one pruned), a batch of two items (one failed), two train runs."""
    ids: dict[str, Any] = {}
    ids["sweep"] = store.create_run("sweep", "lr-sweep", {"metric": "val_loss", "direction": "minimize", "trials": 6})
    ids["trials"] = []
    for i in range(6):
        lr, width = 0.01 * (i + 1), 16 * (1 + i % 3)
        trial = store.create_run(
            "trial", f"trial-{i}", {"trial": i, "params": {"lr": lr, "width": width}}, parent=ids["sweep"]
        )
        store.log_metrics(trial, [(1, "val_loss", 1.0), (2, "val_loss", 1.0 - 5 * lr + 0.001 * width)])
        if i == 4:  # as the sweep records it (rapydli.experiments.sweep.pruning, .lifecycle): why, and the status once
            store.add_record(trial, "prune", "json", PRUNE)
        store.finish_run(trial, "pruned" if i == 4 else "finished")
        ids["trials"].append(trial)
    store.finish_run(ids["sweep"])
    ids["batch"] = store.create_run("batch", "grid", {"notebook": "nb.ipynb"})
    ids["items"] = []
    for x in (1, 2):
        item = store.create_run("batch", f"nb/x{x}", {"parameters": {"x": x}}, parent=ids["batch"])
        notebook = tmp_path / f"out-{x}.ipynb"
        notebook.write_text('{"cells": []}')
        store.add_artifact(item, notebook, "notebook")
        store.add_record(item, "score", "scalar", x * 0.5)
        if x == 2:
            store.finish_run(item, "failed", error="cell 3: ZeroDivisionError: division by zero")
        else:
            store.finish_run(item)
        ids["items"].append(item)
    report = tmp_path / "report.html"
    report.write_text("<h1>report</h1>")
    store.add_artifact(ids["batch"], report, "report")
    store.finish_run(ids["batch"], "failed")
    ids["a"] = store.create_run("train", "resnet_digits", {"config": {"lr": 0.1, "epochs": 3}, "model_fn": "m"}, seed=0)
    ids["b"] = store.create_run(
        "train", "resnet_digits", {"config": {"lr": 0.01, "epochs": 3}, "model_fn": "m"}, seed=0
    )
    for run_id, scale in ((ids["a"], 1.0), (ids["b"], 2.0)):
        store.log_metrics(run_id, [(s, "loss", scale / s) for s in range(1, 6)] + [(5, "val_accuracy", 0.9 / scale)])
        store.finish_run(run_id)
    return ids


@on_server_loop
async def test_families_group_children_filter_sort_and_page(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store, tmp_path)
    code, data = await api("families")
    assert code == 200 and data["total"] == 4  # sweep, batch, two train runs: trials and items are inside
    by_id = {f["id"]: f for f in data["families"]}
    assert by_id[ids["sweep"]]["n_children"] == 6
    assert {c["id"] for c in by_id[ids["sweep"]]["children"]} == set(ids["trials"])
    assert [c["name"] for c in by_id[ids["batch"]]["children"]] == ["nb/x2", "nb/x1"]
    assert by_id[ids["batch"]]["children"][1]["final"] == {"score": 0.5}
    code, data = await api("families", params={"status": "failed"})
    assert {f["id"] for f in data["families"]} == {ids["batch"]}
    code, data = await api("families", params={"kind": "trial"})
    assert [f["id"] for f in data["families"]] == [ids["sweep"]]
    code, data = await api("families", params={"q": "RESNET"})
    assert {f["id"] for f in data["families"]} == {ids["a"], ids["b"]}
    code, data = await api("families", params={"sort": "name", "order": "asc", "limit": "1", "offset": "1"})
    assert data["total"] == 4 and [f["name"] for f in data["families"]] == ["lr-sweep"]
    for params, message in (
        ({"sort": "bogus"}, "'sort'"),
        ({"order": "up"}, "'order'"),
        ({"limit": "0"}, "'limit'"),
        ({"tag": "has space"}, "'tag'"),
        ({"kind": "x"}, "'kind'"),
    ):
        code, data = await api("families", params=params)
        assert code == 400 and message in data["error"], params


@on_server_loop
async def test_tags_and_note_round_trip(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store, tmp_path)
    code, data = await api("runs", ids["a"], method="PATCH", body={"tags": ["best", "paper"], "note": "lr 0.1 wins"})
    assert code == 200 and data == {"id": ids["a"], "tags": ["best", "paper"], "note": "lr 0.1 wins"}
    assert store.tags(ids["a"]) == ["best", "paper"] and store.get_run(ids["a"])["note"] == "lr 0.1 wins"
    code, run = await api("runs", ids["a"])
    assert run["tags"] == ["best", "paper"] and run["note"] == "lr 0.1 wins"
    code, data = await api("families", params={"tag": "best"})
    assert [f["id"] for f in data["families"]] == [ids["a"]] and data["families"][0]["tags"] == ["best", "paper"]
    code, data = await api("runs", ids["a"], method="PATCH", body={"note": ""})
    assert code == 200 and data["note"] is None and data["tags"] == ["best", "paper"]
    for body, message in (
        ({"tags": "best"}, "list of tags"),
        ({"tags": ["a b"]}, "tag 'a b' is invalid"),
        ({"note": 3}, "must be text"),
        ({"colour": "red"}, "unknown field"),
        ({}, "must set"),
        ("[1]", "JSON object"),
        ({"tags": ["t"] * 30 + [f"t{i}" for i in range(30)]}, "at most 20"),
    ):
        code, data = await api("runs", ids["a"], method="PATCH", body=body)
        assert code == 400 and message in data["error"], body
    assert store.tags(ids["a"]) == ["best", "paper"]  # nothing written by a bad request
    code, data = await api("runs", "feedbeef0000", method="PATCH", body={"tags": ["x"]})
    assert code == 404


@on_server_loop
async def test_a_run_shows_its_code_as_sources(
    api, store: RunStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "labrun_code.py").write_text("def load():\n    return [1, 2]\n")
    monkeypatch.chdir(tmp_path)  # the run's cwd, where its module is looked for
    notebook = "class Net:\n    def forward(self, x):\n        return x\n"
    run_id = store.create_run(
        "train", "custom", {"model_fn": "<notebook> Net", "data_fn": "labrun_code:load", "sources": {"Net": notebook}}
    )
    code, run = await api("runs", run_id)
    assert code == 200 and run["params"]["sources"] == {"Net": notebook}
    mine, module = run["sources"]
    assert module == {
        "name": "load",
        "origin": "module",
        "role": "data_fn",
        "ref": "labrun_code:load",
        "file": str(tmp_path / "labrun_code.py"),
        "line": 1,
        "source": "def load():\n    return [1, 2]\n",
    }
    assert mine == {"name": "Net", "origin": "notebook", "source": notebook}


@on_server_loop
async def test_a_run_shows_its_tracker_runs_as_links_and_folders(api, store: RunStore, tmp_path: Path) -> None:
    run_id = store.create_run(
        "train", "tracked", {"config": {"lr": 0.1}}
    )  # links as the trackers record them (trackers.sync)
    mlflow_url = "http://127.0.0.1:5000/#/experiments/1/runs/a81c"
    store.add_record(
        run_id,
        "tracker.mlflow",
        "json",
        {"id": "a81c", "experiment_id": "1", "tracking_uri": "http://127.0.0.1:5000", "url": mlflow_url},
    )
    store.add_record(
        run_id, "tracker.tensorboard", "json", {"id": run_id, "logdir": str(tmp_path / "tb" / f"tracked-{run_id}")}
    )
    store.add_record(
        run_id,
        "tracker.wandb",
        "json",
        {"id": run_id, "project": "rapydli", "group": None, "dir": str(tmp_path / "wandb"), "url": None},
    )
    store.finish_run(run_id)
    code, run = await api("runs", run_id)
    assert code == 200 and run["trackers"] == [
        {"tracker": "mlflow", "id": "a81c", "url": mlflow_url, "path": None},
        {"tracker": "tensorboard", "id": run_id, "url": None, "path": str(tmp_path / "tb" / f"tracked-{run_id}")},
        {"tracker": "wandb", "id": run_id, "url": None, "path": str(tmp_path / "wandb")},  # offline: its folder
    ]
    store.add_record(run_id, "tracker.mlflow", "json", {"id": "a81c", "url": "javascript:alert(1)"})  # never a link
    code, run = await api("runs", run_id)
    assert run["trackers"][0] == {"tracker": "mlflow", "id": "a81c", "url": None, "path": None}
    other = store.create_run("train", "untracked", {})
    code, run = await api("runs", other)
    assert code == 200 and run["trackers"] == []


@on_server_loop
async def test_compare_diffs_params_and_overlays_curves(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store, tmp_path)
    code, data = await api("compare", params={"ids": f"{ids['a']},{ids['b']}"})
    assert code == 200
    assert data["differ"] == ["config.lr"] and data["params"] == ["config.lr"]  # as `rapydli runs compare` prints
    assert data["values"][ids["a"]] == {"config.lr": 0.1} and data["values"][ids["b"]] == {"config.lr": 0.01}
    assert [r["final"]["val_accuracy"] for r in data["runs"]] == pytest.approx([0.9, 0.45])
    assert [p["value"] for p in data["curves"][ids["b"]]["loss"]] == pytest.approx([2.0, 1.0, 2 / 3, 0.5, 0.4])
    assert all(p["time"] >= 0 for p in data["curves"][ids["a"]]["loss"])
    for ids_arg, code_wanted, message in (
        (ids["a"], 400, "2..10"),
        (f"{ids['a']},{ids['a']}", 400, "twice"),
        (f"{ids['a']},../x", 400, "must be 1-64"),
        (f"{ids['a']},feedbeef0000", 404, "no run"),
    ):
        code, data = await api("compare", params={"ids": ids_arg})
        assert code == code_wanted and message in data["error"], ids_arg


@on_server_loop
async def test_sweep_has_states_intermediate_values_and_importance(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store, tmp_path)
    code, sweep = await api("sweeps", ids["sweep"])
    assert code == 200 and sweep["direction"] == "minimize"
    assert [t["state"] for t in sweep["trials"]] == ["COMPLETE"] * 4 + ["PRUNED", "COMPLETE"]
    assert [t["prune"] for t in sweep["trials"]] == [None] * 4 + [PRUNE, None]  # why the pruner stopped it
    code, families = await api("families", params={"kind": "trial"})
    assert [c["prune"] for c in families["families"][0]["children"] if c["state"] == "PRUNED"] == [PRUNE]
    assert sweep["trials"][0]["intermediate"][0] == [1, 1.0] and len(sweep["trials"][0]["intermediate"]) == 2
    assert sweep["trials"][2]["value"] == pytest.approx(1.0 - 0.15 + 0.048)
    assert set(sweep["importance"]) == {"lr", "width"} and sum(sweep["importance"].values()) == pytest.approx(1.0)
    assert "5 completed trials" in sweep["importance_basis"]
    # too few trials: no importance, and the reason says so
    small = store.create_run("sweep", "tiny", {"metric": "val_loss", "direction": "minimize"})
    code, sweep = await api("sweeps", small)
    assert sweep["importance"] is None and "needs 5 completed trials" in sweep["importance_basis"]


@on_server_loop
async def test_batch_items_and_artifact_download(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store, tmp_path)
    code, batch = await api("batches", ids["batch"])
    assert code == 200 and [i["parameters"] for i in batch["items"]] == [{"x": 1}, {"x": 2}]
    assert [i["status"] for i in batch["items"]] == ["finished", "failed"]
    assert batch["items"][1]["failing_cell"] == "cell 3: ZeroDivisionError: division by zero"
    assert batch["items"][0]["failing_cell"] is None and batch["items"][1]["final"] == {"score": 1.0}
    assert batch["items"][0]["notebook"] == str((tmp_path / "out-1.ipynb").resolve())
    assert [a["kind"] for a in batch["artifacts"]] == ["report"]
    code, data = await api("batches", ids["items"][0])
    assert code == 404 and "not a batch" in data["error"]
    code, data = await api("batches", ids["a"])
    assert code == 404
    response = await api.raw("runs", ids["batch"], "artifacts", "0")
    assert response.code == 200 and response.body == b"<h1>report</h1>"
    assert "attachment" in response.headers["Content-Disposition"]
    code, data = await api("runs", ids["batch"], "artifacts", "1")
    assert code == 404 and "has 1" in data["error"]
    code, data = await api("runs", ids["batch"], "artifacts", "x")
    assert code == 400 and "non-negative integer" in data["error"]


@pytest.mark.engines
@pytest.mark.timeout(240)
@on_server_loop
async def test_a_cli_started_cluster_is_listed_and_stopped_at_once(api, store: RunStore) -> None:
    started = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "rapydli", "cluster", "start", "-n", "2"],
        check=False,
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=180,
    )
    assert started.returncode == 0, started.stderr
    cluster_id = started.stdout.strip()
    (record,) = [r for r in Cluster.detached() if r["id"] == cluster_id]
    pids = [engine["pid"] for engine in record["engines"].values()]  # not our children: the CLI exited
    assert all(psutil.pid_exists(pid) for pid in pids)
    try:
        code, listed = await api("clusters")
        (entry,) = [c for c in listed["clusters"] if c["id"] == cluster_id]  # listed though another process started it
        assert entry["origin"] == "detached" and entry["engines_alive"] == 2 and entry["n"] == 2
        assert entry["state"] == "running" and entry["hosts"] and entry["created"] <= time.time()
        asked = time.monotonic()
        code, stopping = await api("clusters", cluster_id, method="DELETE")
        answered = time.monotonic() - asked
        assert code == 202 and stopping["state"] == "stopping", stopping
        print(f"DELETE answered in {answered:.2f} s")
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            code, entry = await api("clusters", cluster_id)
            if code == 404:
                break
            assert entry["state"] == "stopping", entry
            await asyncio.sleep(0.3)
        assert code == 404
        _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
        assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "rapydli", "cluster", "stop", "--all"],
            check=False,
            capture_output=True,
            timeout=120,
        )
