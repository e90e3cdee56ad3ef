"""The ``mlflow`` tracker against a real ``mlflow server`` (SQLite backend) on 127.0.0.1, with real engines."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from trackers_files import items_notebook

import rapydli as rd
from rapydli.cli import main as cli_main
from rapydli.errors import RapydliWarning
from rapydli.experiments.store.runstore import open_store
from rapydli.experiments.trackers.sync import links

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'rapydli[mlflow]')")

pytestmark = pytest.mark.engines


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_server(where: Path) -> tuple[subprocess.Popen, str]:
    """A real MLflow tracking server with a SQLite backend on 127.0.0.1, in a process group of its own, once it answers."""
    port = _free_port()
    command = [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{where}/mlflow.db",
               "--artifacts-destination", str(where / "artifacts"), "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]  # fmt: skip
    with open(where / "server.log", "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=where, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server, uri
        except OSError:
            assert server.poll() is None, (where / "server.log").read_text()
            assert time.monotonic() < deadline, (
                "mlflow server did not answer in 300 s:\n" + (where / "server.log").read_text()
            )
            time.sleep(0.5)


def _stop_server(server: subprocess.Popen) -> None:
    """Stop the server's process group (the mlflow command and its uvicorn worker)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(10)
            break
        except subprocess.TimeoutExpired:
            continue
    server.wait()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory):
    server, uri = _start_server(tmp_path_factory.mktemp("mlflow"))
    yield uri
    _stop_server(server)


@pytest.fixture
def tracking(mlflow_server: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "rapydli-tests")
    return mlflow.MlflowClient(mlflow_server)


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def _mlflow_runs(client, run_id: str) -> list:
    experiment = client.get_experiment_by_name("rapydli-tests")
    return client.search_runs([experiment.experiment_id], filter_string=f"tags.`rapydli.run_id` = '{run_id}'")


def test_a_run_on_two_ranks_is_one_mlflow_run_with_every_metric_at_every_step(cluster, tracking, capsys) -> None:
    config = rd.TrainConfig(max_steps=12, batch_size=16, eval_every=4, lr=0.05, allreduce="mpi")
    result = rd.train(
        "rapydli.zoo.models:mlp",
        "rapydli.zoo.datasets:digits",
        config,
        cluster,
        trackers=["mlflow"],
        progress=False,
        live=False,
    )
    store = open_store()
    (found,) = _mlflow_runs(tracking, result.run_id)  # one tracker run per RaPyDLI run, not one per rank
    assert links(store, result.run_id)["mlflow"]["id"] == found.info.run_id
    assert found.info.status == "FINISHED"
    assert found.data.params["config.lr"] == "0.05" and found.data.params["config.max_steps"] == "12"
    assert found.data.tags["rapydli.kind"] == "train" and found.data.tags["rapydli.rank1.host"] == socket.gethostname()
    stored = store.metrics(result.run_id)
    for name, key in (("loss", "loss"), ("val_loss", "val_loss"), ("step_time_s@rank1", "system/rank1/step_time_s")):
        expected = [(m["step"], m["value"]) for m in stored if m["name"] == name]
        got = sorted((m.step, m.value) for m in tracking.get_metric_history(found.info.run_id, key))
        assert expected and got == sorted(expected), name
    assert [m.step for m in tracking.get_metric_history(found.info.run_id, "loss")] == list(range(1, 13))
    artifacts = {a.path for a in tracking.list_artifacts(found.info.run_id, "figures")}
    assert artifacts == {"figures/loss.html"}
    capsys.readouterr()
    assert cli_main(["runs", "show", result.run_id]) == 0
    assert links(store, result.run_id)["mlflow"]["url"] in capsys.readouterr().out


def test_an_unreachable_tracker_is_one_warning_for_a_whole_sweep_and_its_runs_are_complete(
    cluster, monkeypatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = rd.TrainConfig(max_steps=3, batch_size=16, allreduce="mpi", trackers="mlflow")
    with pytest.warns(RapydliWarning, match=r"not logged to 'mlflow': .*rapydli runs export --to mlflow") as caught:
        rd.sweep(
            "rapydli.zoo.models:mlp",
            "rapydli.zoo.datasets:digits",
            config,
            {"lr": rd.loguniform(1e-3, 1e-1)},
            trials=3,
            workers_per_trial=1,
            pruner="none",
            cluster=cluster,
            live=False,
        )
    assert (
        len([w for w in caught if issubclass(w.category, RapydliWarning)]) == 1
    )  # one for the sweep, not one per trial
    store = open_store()
    sweep_run = store.list_runs(kind="sweep", limit=1)[0][0]
    trials, _ = store.list_runs(parent=sweep_run["id"])
    assert sweep_run["status"] == "finished" and len(trials) == 3 and "mlflow" not in links(store, sweep_run["id"])
    for trial in trials:
        assert trial["status"] == "finished" and "mlflow" not in links(store, trial["id"])
        assert [m["step"] for m in store.metrics(trial["id"]) if m["name"] == "loss"] == [1, 2, 3]


def test_a_tracker_that_is_not_installed_is_reported_before_the_run_trains(cluster, monkeypatch) -> None:
    from rapydli.experiments.trackers.mlflow import MlflowTracker

    monkeypatch.setattr(MlflowTracker, "module", "mlflow_not_installed_here")
    with pytest.warns(
        RapydliWarning, match=r"needs the mlflow_not_installed_here package.*pip install 'rapydli\[mlflow\]'"
    ):
        result = rd.train(
            "rapydli.zoo.models:mlp",
            "rapydli.zoo.datasets:digits",
            rd.TrainConfig(max_steps=2, allreduce="mpi"),
            cluster,
            trackers="mlflow",
            progress=False,
            live=False,
        )
    assert open_store().get_run(result.run_id)["status"] == "finished"


def test_a_sweep_is_a_parent_mlflow_run_with_one_nested_run_per_two_rank_trial(cluster, tracking) -> None:
    config = rd.TrainConfig(max_steps=4, batch_size=16, eval_every=2, allreduce="mpi")
    result = rd.sweep(
        "rapydli.zoo.models:mlp",
        "rapydli.zoo.datasets:digits",
        config,
        {"lr": rd.loguniform(1e-3, 1e-1)},
        trials=4,
        workers_per_trial=2,
        pruner="none",
        cluster=cluster,
        live=False,
        trackers=["mlflow"],
    )  # as rd.train takes it
    store = open_store()
    (sweep_run,) = store.list_runs(kind="sweep", limit=1)[0]  # this sweep: the newest
    (parent,) = _mlflow_runs(tracking, sweep_run["id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rapydli.kind"] == "sweep"
    trials, _ = store.list_runs(parent=sweep_run["id"])
    assert len(trials) == 4 == len(result.table)
    experiment = tracking.get_experiment_by_name("rapydli-tests")
    nested = tracking.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert sorted(r.data.tags["rapydli.run_id"] for r in nested) == sorted(t["id"] for t in trials)
    for run in nested:
        stored = [m["step"] for m in store.metrics(run.data.tags["rapydli.run_id"]) if m["name"] == "loss"]
        assert [m.step for m in tracking.get_metric_history(run.info.run_id, "loss")] == stored == [1, 2, 3, 4]
        assert run.info.status == "FINISHED" and float(run.data.params["config.lr"]) > 0


def test_exporting_a_recorded_run_twice_updates_one_mlflow_run(cluster, tracking, capsys) -> None:
    config = rd.TrainConfig(max_steps=5, batch_size=16, allreduce="mpi")
    result = rd.train(
        "rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", config, cluster, progress=False, live=False
    )
    store = open_store()
    assert _mlflow_runs(tracking, result.run_id) == []  # not logged live
    outputs = []
    for _ in range(2):
        assert cli_main(["runs", "export", "--to", "mlflow", result.run_id]) == 0
        outputs.append(capsys.readouterr().out)
    (found,) = _mlflow_runs(tracking, result.run_id)
    assert outputs[0] == outputs[1] and found.info.run_id in outputs[0]
    assert found.info.status == "FINISHED"
    expected = [m["step"] for m in store.metrics(result.run_id) if m["name"] == "loss"]
    assert [m.step for m in tracking.get_metric_history(found.info.run_id, "loss")] == expected == [1, 2, 3, 4, 5]


def test_exporting_a_recorded_sweep_twice_updates_one_parent_run_and_its_nested_trials(tracking, capsys) -> None:
    store = open_store()  # a recorded sweep, never logged: store rows only
    sweep_id = store.create_run("sweep", "recorded-sweep", {"metric": "loss", "direction": "minimize"})
    trials = []
    for i in range(2):
        trial = store.create_run(
            "trial", f"recorded-sweep-trial-{i}", {"params": {"lr": 0.01 * (i + 1)}}, parent=sweep_id
        )
        store.log_metrics(trial, [(step, "loss", (i + 1) / step) for step in (1, 2, 3)])
        store.finish_run(trial)
        trials.append(trial)
    store.finish_run(sweep_id)
    outputs = []
    for _ in range(2):
        assert cli_main(["runs", "export", "--to", "mlflow", sweep_id]) == 0  # the parent alone is named
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and [line.split()[0] for line in outputs[0].splitlines()] == [sweep_id, *trials]
    (parent,) = _mlflow_runs(tracking, sweep_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["rapydli.kind"] == "sweep"
    experiment = tracking.get_experiment_by_name("rapydli-tests")
    nested = tracking.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    assert sorted(r.data.tags["rapydli.run_id"] for r in nested) == sorted(trials)
    for run in nested:
        trial = run.data.tags["rapydli.run_id"]
        assert [r.info.run_id for r in _mlflow_runs(tracking, trial)] == [run.info.run_id]  # one, after two exports
        assert links(store, trial)["mlflow"]["id"] == run.info.run_id and run.info.status == "FINISHED"
        expected = [(m["step"], m["value"]) for m in store.metrics(trial) if m["name"] == "loss"]
        assert sorted((m.step, m.value) for m in tracking.get_metric_history(run.info.run_id, "loss")) == expected
        assert len(expected) == 3 and float(run.data.params["params.lr"]) > 0


@pytest.mark.timeout(600)  # a server of its own: its start is most of the time
def test_a_tracker_server_that_dies_mid_run_is_one_warning_and_the_run_is_complete(
    cluster, tmp_path, monkeypatch
) -> None:
    server, uri = _start_server(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retries would only delay the warning
    store = open_store()
    killed: list[int] = []

    def kill_once_logging(row: dict) -> None:  # in the client's polling thread, while the ranks train on
        if killed or row.get("kind") != "train":
            return
        run_id = store.list_runs(kind="train", limit=1)[0][0]["id"]
        deadline = time.monotonic() + 120
        while "mlflow" not in links(store, run_id) and time.monotonic() < deadline:
            time.sleep(0.1)  # until the MLflow run exists: the server then dies mid-run
        _stop_server(server)
        killed.append(row["step"])

    config = rd.TrainConfig(max_steps=40, batch_size=16, eval_every=10, allreduce="mpi", trackers="mlflow")
    try:
        with pytest.warns(RapydliWarning, match=r"not logged to 'mlflow'") as caught:
            result = rd.train(
                "rapydli.zoo.models:mlp",
                "rapydli.zoo.datasets:digits",
                config,
                cluster,
                callbacks=[kill_once_logging],
                progress=False,
                live=False,
            )
    finally:
        _stop_server(server)
    assert killed and len([w for w in caught if issubclass(w.category, RapydliWarning)]) == 1
    assert store.get_run(result.run_id)["status"] == "finished"
    assert [m["step"] for m in store.metrics(result.run_id) if m["name"] == "loss"] == list(range(1, 41))
    assert "mlflow" in links(store, result.run_id)  # the MLflow run it had: `rapydli runs export` catches it up


def test_a_batch_is_one_parent_mlflow_run_with_one_child_per_parallel_item(tracking, tmp_path, monkeypatch) -> None:
    items_notebook(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert (
        cli_main(["batch", "items.ipynb", "--grid", "x=1,2", "--parallel", "2", "--trackers", "mlflow", "--out", "out"])
        == 0
    )
    store = open_store()
    batch_id = next(
        run["id"] for run in store.list_runs(kind="batch", limit=10)[0] if run["parent"] is None
    )  # the newest batch
    (parent,) = _mlflow_runs(tracking, batch_id)  # made once, though both items started at once
    experiment = tracking.get_experiment_by_name("rapydli-tests")

    def children(run) -> list:
        return tracking.search_runs(
            [experiment.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'"
        )

    items = children(parent)
    assert parent.info.status == "FINISHED" and len(items) == 2
    assert sorted(r.data.tags["rapydli.run_id"] for r in items) == sorted(
        r["id"] for r in store.list_runs(parent=batch_id)[0]
    )
    for item in items:
        assert item.info.status == "FINISHED" and len(_mlflow_runs(tracking, item.data.tags["rapydli.run_id"])) == 1
        (inner,) = children(item)  # the notebook's run, nested under its item's in the item's own process
        assert inner.info.status == "FINISHED" and inner.data.params["x"] == item.data.params["parameters.x"]


@pytest.mark.parametrize(
    ("status", "word"), [("finished", "FINISHED"), ("failed", "FAILED"), ("interrupted", "KILLED")]
)
def test_a_run_in_mlflows_own_local_store_ends_with_its_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: str, word: str
) -> None:
    """MLflow 3's default store is SQLite (``sqlite:///mlflow.db`` in the working folder), written without a server: there the
    run stayed RUNNING, the status given as a word (MLflow warned "Could not get string corresponding to run status")."""
    from rapydli.experiments.trackers.mlflow import MlflowTracker

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "rapydli-local")
    tracker = MlflowTracker()
    link = tracker.open({"id": "r1", "name": "local", "started": time.time()}, None, None)
    tracker.finish(status, time.time())
    run = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(link["id"])
    assert run.info.status == word and run.info.end_time is not None
