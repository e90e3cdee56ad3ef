"""``rd.train`` on a real 2-engine cluster: history, live rows, the run store, rank failures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

import rapydli as rd
from rapydli.errors import ConfigError, RankFailure
from rapydli.experiments.job import TASK_STARTED
from rapydli.experiments.store.refs import callable_ref, resolve_callable
from rapydli.experiments.store.runstore import open_store
from rapydli.trainer.task import TRAINER_SETUP
from rapydli.widgets.live import LivePlot
from rapydli.zoo import models


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def test_bad_arguments_fail_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="TrainConfig.lr"):
        rd.train(models.mlp, "rapydli.zoo.datasets:digits", {"lr": -1.0})
    with pytest.raises(ConfigError, match="model_fn='rapydli.zoo.models:nope' cannot be imported"):
        rd.train("rapydli.zoo.models:nope", "rapydli.zoo.datasets:digits", rd.TrainConfig())
    with pytest.raises(ConfigError, match="data_fn=42"):
        rd.train(models.mlp, 42, rd.TrainConfig())  # type: ignore[arg-type]


def test_callable_refs_round_trip() -> None:
    assert callable_ref(models.resnet_mini) == "rapydli.zoo.models:resnet_mini"
    assert resolve_callable("rapydli.zoo.models:resnet_mini", "model_fn") is models.resnet_mini
    assert callable_ref(lambda: None) is None


@pytest.mark.engines
def test_train_returns_history_and_records_the_run(cluster) -> None:
    live: list[dict] = []
    config = rd.TrainConfig(epochs=1, max_steps=8, batch_size=32, lr=0.01, eval_every=4, allreduce="mpi")
    result = rd.train(
        models.mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, callbacks=[live.append], progress=False
    )
    history = result.history
    train_rows = history[history["kind"] == "train"]
    eval_rows = history[history["kind"] == "eval"]
    assert train_rows["step"].tolist() == list(range(1, 9))
    assert eval_rows["step"].tolist() == [4, 8]
    assert (train_rows["world_size"] == 2).all() and train_rows["comm_time_s"].sum() > 0
    assert eval_rows["val_loss"].iloc[-1] < eval_rows["val_loss"].iloc[0]
    assert [row["step"] for row in live if row["kind"] == "train"] == list(range(1, 9))
    assert len(result.figure.data) == 2  # train and val loss

    store = open_store()
    run = store.get_run(result.run_id)
    assert run["status"] == "finished" and run["kind"] == "train" and run["world_size"] == 2
    assert run["params"]["model_fn"] == "rapydli.zoo.models:mlp"
    assert run["params"]["data_fn"] == "rapydli.zoo.datasets:digits"
    assert run["params"]["config"]["max_steps"] == 8
    logged = store.metrics(result.run_id)
    assert {m["name"] for m in logged} >= {"loss", "lr", "val_loss", "val_accuracy", "step_time_s"}
    # rank 1's own step timings are stored beside rank 0's, and the hosts the run ran on
    assert {m["name"] for m in logged} >= {"step_time_s@rank1", "comm_wait_s@rank1"}
    assert store.records(result.run_id)["hosts"]["value"] == [socket.gethostname()]
    # where the time before step 1 went, phase by phase, in the order they ran
    setup = dict(store.records(result.run_id)["setup_s"]["value"])
    assert list(setup) == ["engines ready", TASK_STARTED, "model and data", TRAINER_SETUP]
    assert all(seconds >= 0 for seconds in setup.values())


def _count_layouts(reset: bool = False) -> int:
    """Layouts built in this process since the counter was installed (installed, or reset, by ``reset``)."""
    from rapydli.parallel import layout

    if reset or not hasattr(layout, "_built"):
        original = getattr(layout, "_original_post_init", layout.Layout.__post_init__)
        layout._original_post_init, layout._built = original, [0]

        def counted(self):  # type: ignore[no-untyped-def]
            layout._built[0] += 1
            original(self)

        layout.Layout.__post_init__ = counted
    return int(layout._built[0])


@pytest.mark.engines
@pytest.mark.parametrize("degrees", [{}, {"tensor_parallel": 2}, {"pipeline_stages": 2, "microbatches": 2}])
def test_a_run_builds_its_layout_once_and_hands_it_to_the_ranks(cluster, monkeypatch, degrees) -> None:
    """One Layout per run, built where the run is planned (the job) and passed whole to the engine task and the
    Trainer; the ranks build none of their own (it was built three times: job, engine task, Trainer). What to train
    is one RunSpec, resolved at the front door (rd.train resolved the model once more for its live plot's title)."""
    from rapydli.experiments.spec import RunSpec
    from rapydli.parallel import layout

    monkeypatch.setattr(layout.Layout, "__post_init__", layout.Layout.__post_init__)  # restored after the test
    specs: list[RunSpec] = []
    build_spec = RunSpec.__init__

    def counted_spec(self: RunSpec, *args: object, **kwargs: object) -> None:
        specs.append(self)
        build_spec(self, *args, **kwargs)

    monkeypatch.setattr(RunSpec, "__init__", counted_spec)
    _count_layouts(reset=True)
    assert cluster.run(_count_layouts, True) == [0, 0]
    rd.train(
        models.tiny_lm,
        "rapydli.zoo.datasets:synthetic_tokens",
        rd.TrainConfig(max_steps=2, batch_size=4, **degrees),
        cluster=cluster,
        progress=False,
        live=True,  # as in a notebook: the live plot is titled from the one spec
    )
    assert cluster.run(_count_layouts) == [0, 0]  # the ranks used the one they were sent
    assert _count_layouts() == 1
    assert len(specs) == 1


@pytest.mark.engines
def test_a_rank_that_raises_is_named_and_the_run_is_failed(cluster) -> None:
    def data_failing_on_rank_1():
        from rapydli.cluster.engine import context
        from rapydli.zoo import datasets

        if context().rank == 1:
            raise RuntimeError("broken shard on rank 1")
        return datasets.digits()

    before = {r["id"] for r in open_store().list_runs(kind="train")[0]}
    with pytest.raises(RankFailure) as info:
        rd.train(models.mlp, data_failing_on_rank_1, rd.TrainConfig(max_steps=5), cluster=cluster, progress=False)
    assert info.value.ranks == [1] and "broken shard on rank 1" in str(info.value.failures[1])
    (new,) = [r for r in open_store().list_runs(kind="train")[0] if r["id"] not in before]
    assert new["status"] == "failed" and "rank" in new["error"]
    assert cluster.run(lambda: 7) == [7, 7]  # the cluster is still usable


@pytest.mark.engines
def test_a_rank_slower_than_the_others_is_named_with_its_host() -> None:
    import train_cases  # tests/: rank 1's forward sleeps 40 ms a step, a straggler the others wait for

    config = rd.TrainConfig(epochs=50, max_steps=16, batch_size=4, lr=0.01, allreduce="mpi", eval_every=0)
    # a cluster whose engines come up as part of the run (`%rapydli start --no-wait`): its hosts were "?" in the
    # straggler report and empty in the run's records, read before the engines were ready
    starting = rd.Cluster(n=2).start(wait=False)
    plot = LivePlot(live=False)
    try:
        result = rd.train(
            train_cases.SlowOnRank1,
            train_cases.features,
            config,
            cluster=starting,
            progress=False,
            live=False,
            callbacks=[plot],
        )
    finally:
        starting.stop()
    plot.close()  # the live plot marks the rank: its comm-wait line, and the report over the step-time panel
    assert [n["rank"] for n in plot.notices if n["kind"] == "straggler"] == [1]
    assert any(
        (a.text or "").startswith(f"rank 1 (host {socket.gethostname()}) is a straggler")
        for a in plot.figure.layout.annotations
    )
    assert any((t.name or "") == "comm wait rank 1 (s), straggler" for t in plot.figure.data)
    records = open_store().records(result.run_id)
    assert records["rank_hosts"]["value"] == [socket.gethostname()] * 2 and records["hosts"]["value"] == [
        socket.gethostname()
    ]
    found = records["stragglers"]["value"]
    assert [s["rank"] for s in found] == [1] and found[0]["host"] == socket.gethostname(), found
    assert found[0]["busy_s"] >= 0.04 and found[0]["text"].startswith(
        f"rank 1 (host {socket.gethostname()}) is a straggler"
    )


@pytest.mark.engines
@pytest.mark.alone  # a second test worker's load on rank 0's core hides rank 1's
def test_a_rank_pinned_to_a_busy_core_is_named_with_its_host(cluster) -> None:
    import train_cases  # tests/: each rank's threads pinned to a core of its own; a spinning process shares rank 1's

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores: one for each rank")
    core = train_cases.pinned_core(1)
    # three processes spinning on rank 1's core, each in a session of its own: Linux shares a core between sessions
    # (autogroups) before processes, so they keep three quarters of it even when the machine is busy too
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass"
    config = rd.TrainConfig(epochs=50, max_steps=16, batch_size=4, lr=0.01, allreduce="mpi", eval_every=0)
    busy = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True) for _ in range(3)]
    try:
        result = rd.train(
            train_cases.BusyOnPinnedCores, train_cases.features, config, cluster=cluster, progress=False, live=False
        )
    finally:
        for process in busy:
            process.kill()
            process.wait()
    found = open_store().records(result.run_id)["stragglers"]["value"]
    assert [s["rank"] for s in found] == [1] and found[0]["host"] == socket.gethostname(), found
    assert found[0]["text"].startswith(f"rank 1 (host {socket.gethostname()}) is a straggler"), found
    print(found[0]["text"])
