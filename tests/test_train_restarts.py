"""``rd.train(..., restarts=N)`` on real clusters: an engine killed mid-run, a user error, a restart
that cannot bring the engines back; a host killed (namespace hosts, going on with the engines
left: ``min_workers``) and a Slurm job cancelled from outside. A restarted run resumes from its last
checkpoint and ends with the parameters of the same run uninterrupted (where it keeps the global batch)."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import nshosts
import pytest
import torch
from restart_cases import SAMPLES, LoggedData, StallingModel, served
from trackers_files import tensorboard_scalars, tensorboard_texts

import rapydli as rd
from rapydli.errors import ClusterError, RankFailure
from rapydli.experiments.store.runstore import open_store
from rapydli.experiments.trackers.sync import links
from rapydli.trainer import checkpoint as ckpt

CONFIG = dict(
    epochs=1,
    max_steps=12,
    batch_size=16,
    lr=0.05,
    optimizer="sgd",
    momentum=0.9,
    eval_every=0,
    checkpoint_every=4,
    allreduce="mpi",
    seed=5,
)


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def killing_model(marker: Path, at_call: int, after_checkpoint: Path | None = None):
    """A model_fn whose rank 1 dies (``os._exit``) in its ``at_call``-th forward, once (a marker file remembers);
    with ``after_checkpoint``, only once a checkpoint is on disk there (written in the background, it may lag)."""

    def model_fn():
        import os
        import pathlib
        import time

        from rapydli.cluster.engine import context
        from rapydli.trainer.checkpoint import checkpoint_path
        from rapydli.zoo import models

        model = models.mlp()
        calls = [0]

        def die(module, args):
            calls[0] += 1
            if context().rank == 1 and calls[0] == at_call and not pathlib.Path(marker).exists():
                while after_checkpoint is not None and not checkpoint_path(after_checkpoint).exists():
                    time.sleep(0.05)
                pathlib.Path(marker).write_text("killed")
                os._exit(1)

        model.register_forward_pre_hook(die)
        return model

    return model_fn


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_an_engine_killed_mid_run_restarts_and_ends_where_an_uninterrupted_run_ends(
    cluster, tmp_path: Path, monkeypatch
) -> None:
    import tqdm

    import rapydli.notebook

    bars: list[tqdm.tqdm] = []
    closed: list[int] = []

    class Bar(tqdm.tqdm):  # a red bar is one closed before its total: the restart must go on with it, not close it
        def close(self) -> None:
            if not self.disable:
                closed.append(self.n)
            super().close()

    monkeypatch.setattr(
        rapydli.notebook,
        "progress_bar",
        lambda **kw: bars.append(Bar(**kw, disable=False, file=open(os.devnull, "w"))) or bars[-1],
    )
    marker = tmp_path / "killed"
    rows: list[dict] = []
    monkeypatch.setenv("RAPYDLI_TENSORBOARD_DIR", str(tmp_path / "tb"))
    config = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "cut"), trackers="tensorboard")
    result = rd.train(
        killing_model(marker, at_call=7, after_checkpoint=tmp_path / "cut"),
        "rapydli.zoo.datasets:digits",
        config,
        cluster=cluster,
        restarts=1,
        callbacks=[rows.append],
        progress=True,
        live=False,
    )
    assert marker.exists()  # rank 1 really died
    # every step is in the history once, in order: those the first attempt's dying engines never sent
    # come from the checkpoint the run resumed from
    steps = result.history[result.history["kind"] == "train"]["step"].tolist()
    assert steps == list(range(1, 13)), steps
    assert {r["step"] for r in rows if r["kind"] == "train"} == set(range(1, 13))  # the callbacks got them too
    assert len(bars) == 1 and closed == [12]  # one bar, gone on with after the restart, closed once at its end

    run = open_store().get_run(result.run_id)
    assert run["status"] == "finished"
    (restart,) = open_store().records(result.run_id)["restarts"]["value"]
    assert restart["ranks"] == [1] and "died" in restart["cause"] and restart["resumed_from_step"] == 4
    assert restart["workers"] == 2 and restart["recovery_s"] > 0  # how long it took, recorded (runs show prints it)
    assert [r["step"] for r in rows if r["kind"] == "restart"] == [4]  # the live plot's marker
    assert [shape.x0 for shape in result.figure.layout.shapes] == [4]  # the returned figure marks it too
    tracked = links(open_store(), result.run_id)["tensorboard"][
        "logdir"
    ]  # the tracker's run goes on too, and says it restarted
    assert "* rapydli.restarts: 1\n* rapydli.resumed_from_step: 4" in tensorboard_texts(tracked, "tags")[-1]
    assert sorted({step for step, _ in tensorboard_scalars(tracked)["loss"]}) == list(range(1, 13))

    reference = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "whole"))
    rd.train(
        killing_model(marker, at_call=7),
        "rapydli.zoo.datasets:digits",
        reference,
        cluster=cluster,
        progress=False,
        live=False,
    )
    (cut, cut_step), (whole, whole_step) = (
        ckpt.read_state_dict(tmp_path / "cut"),
        ckpt.read_state_dict(tmp_path / "whole"),
    )
    assert cut_step == whole_step == 12
    for name, value in whole.items():
        torch.testing.assert_close(cut[name], value, rtol=0, atol=1e-6)


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_without_restarts_a_death_fails_the_run(cluster, tmp_path: Path) -> None:
    config = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(RankFailure) as info:
        rd.train(
            killing_model(tmp_path / "killed", at_call=3),
            "rapydli.zoo.datasets:digits",
            config,
            cluster=cluster,
            progress=False,
            live=False,
        )
    assert info.value.died and info.value.ranks == [1]
    cluster.restart()


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_an_exception_in_user_code_is_never_retried(cluster, tmp_path: Path) -> None:
    attempts = tmp_path / "attempts"

    def data_fn():
        import pathlib

        from rapydli.cluster.engine import context

        if context().rank == 0:
            with pathlib.Path(attempts).open("a") as stream:
                stream.write("x")
        raise ValueError("a bug in the user's data_fn")

    before = {r["id"] for r in open_store().list_runs(kind="train")[0]}
    with pytest.raises(RankFailure) as info:
        rd.train(
            "rapydli.zoo.models:mlp",
            data_fn,
            rd.TrainConfig(**CONFIG),
            cluster=cluster,
            restarts=2,
            progress=False,
            live=False,
        )
    assert not info.value.died and "a bug in the user's data_fn" in str(info.value)
    assert attempts.read_text() == "x"  # one attempt only
    (new,) = [r for r in open_store().list_runs(kind="train")[0] if r["id"] not in before]
    assert new["status"] == "failed" and "restarts" not in open_store().records(new["id"])
    assert cluster.run(lambda: 7) == [7, 7]


def _new_run(before: set[str]) -> dict:
    (new,) = [r for r in open_store().list_runs(kind="train")[0] if r["id"] not in before]
    return new


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_a_restart_that_cannot_bring_the_engines_back_fails_the_run_and_keeps_the_checkpoint(
    cluster, tmp_path: Path
) -> None:
    directory = tmp_path / "ckpt"
    config = rd.TrainConfig(**CONFIG, checkpoint_dir=str(directory))
    before = {r["id"] for r in open_store().list_runs(kind="train")[0]}
    cluster.start_timeout = 1  # fresh engines cannot register this fast: the restart's start fails
    try:
        with pytest.raises(ClusterError) as info:
            rd.train(
                killing_model(tmp_path / "killed", at_call=7, after_checkpoint=directory),
                "rapydli.zoo.datasets:digits",
                config,
                cluster=cluster,
                restarts=1,
                progress=False,
                live=False,
            )
    finally:
        cluster.start_timeout = 120
    message = str(info.value)
    assert "ranks [1] died and the cluster could not be restarted" in message and "could not start 2 engines" in message
    assert f"the last checkpoint is in {directory}" in message
    run = _new_run(before)
    assert run["status"] == "failed" and "could not be restarted" in run["error"]
    (attempt,) = open_store().records(run["id"])["restarts"]["value"]
    assert attempt["ranks"] == [1] and "could not start" in attempt["error"]
    kept = ckpt.load(
        ckpt.checkpoint_path(directory)
    )  # intact: the step before the death, nothing half-written beside it
    assert kept["step"] == 4 and kept["world_size"] == 2 and not list(directory.glob(".*.tmp"))
    cluster.start()
    assert cluster.run(lambda: 2) == [2, 2]


# -- a host dies, a Slurm job ends ---------------------------------------------------------------

RESIZE = dict(
    epochs=1,
    batch_size=8,
    lr=0.05,
    optimizer="sgd",
    momentum=0.9,
    eval_every=0,
    checkpoint_every=4,
    allreduce="mpi",
    seed=5,
)


def _assert_same_parameters(cut: Path, whole: Path) -> None:
    """The last checkpoints in ``cut`` (the restarted run) and ``whole`` (an uninterrupted one) hold the same step and parameters."""
    (cut_state, cut_step), (whole_state, whole_step) = ckpt.read_state_dict(cut), ckpt.read_state_dict(whole)
    assert cut_step == whole_step
    for name, value in whole_state.items():
        torch.testing.assert_close(cut_state[name], value, rtol=0, atol=1e-6)


def _uninterrupted(cluster: rd.Cluster, marker: Path, directory: Path, config: rd.TrainConfig) -> None:
    """The same run, never interrupted (the marker exists, so no rank stalls), checkpointing into ``directory``."""
    directory.mkdir()
    rd.train(
        StallingModel(str(marker), at_call=7),
        LoggedData(str(directory)),
        config,
        cluster=cluster,
        progress=False,
        live=False,
    )


def _when_stalled(marker: Path, end_it: Callable[[], object]) -> threading.Thread:
    """A thread that calls ``end_it`` once rank 1 stalls (the marker appears), as a host death or ``scancel`` would come."""

    def wait_then_end() -> None:
        deadline = time.monotonic() + 180
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        end_it()

    thread = threading.Thread(target=wait_then_end, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def on_hosts(hosts):
    """Two engines, one on each namespace host (``h1``, ``h2``), MPI on TCP."""
    with rd.Cluster(n=2, launcher="ssh", **hosts.launcher_options()) as started:
        yield started


@pytest.fixture
def whole(hosts, on_hosts):
    """The hosts cluster with both hosts up and both engines running; after the test too."""
    yield on_hosts
    if not on_hosts.running or on_hosts.n != 2:
        if any(h.sshd is None or h.sshd.poll() is not None for h in hosts.hosts):
            nshosts.revive(hosts, "h2")
        on_hosts.restart()


@pytest.mark.hosts
@pytest.mark.engines
@pytest.mark.timeout(600)
@pytest.mark.parametrize("on_resize", ["keep", "scale"])
def test_a_host_killed_mid_run_goes_on_with_the_engines_left(hosts, whole, tmp_path: Path, on_resize: str) -> None:
    marker = tmp_path / "stalled"
    killer = _when_stalled(marker, hosts.host("h2").kill)
    config = rd.TrainConfig(**RESIZE, on_resize=on_resize, checkpoint_dir=str(tmp_path / "ckpt"))
    result = rd.train(
        StallingModel(str(marker), at_call=7, after_checkpoint=config.checkpoint_dir),
        LoggedData(str(tmp_path)),
        config,
        cluster=whole,
        restarts=1,
        min_workers=1,
        progress=False,
        live=False,
    )
    killer.join()
    assert marker.read_text() == "h2"  # rank 1 stalled on h2, where it died with its host
    assert whole.n == 1 and whole.status()["rank_hosts"] == {0: "h1"}  # h2 does not answer: left out

    run = open_store().get_run(result.run_id)
    assert run["status"] == "finished"
    (restart,) = open_store().records(result.run_id)["restarts"]["value"]
    assert restart["ranks"] == [1] and "host h2 down" in restart["cause"], restart
    assert restart["workers"] == 1 and restart["resumed_from_step"] == 4

    # every sample of the epoch once: steps 1-4 on 2 ranks, the rest of the epoch on the one left
    resumed = served(tmp_path, attempt=1)
    assert served(tmp_path, attempt=0, first=4 * 8) + resumed == Counter(range(SAMPLES))
    train = result.history[result.history["kind"] == "train"]
    after = train[train["step"] > 4]
    if on_resize == "keep":  # the global batch of 16 kept: two micro-batches of 8 a step, the same lr
        assert list(after["step"]) == list(range(5, 13)) and after["lr"].tolist() == pytest.approx([0.05] * 8)
    else:  # one rank's batch of 8 a step, the lr scaled with it
        assert list(after["step"]) == list(range(5, 21)) and after["lr"].tolist() == pytest.approx([0.025] * 16)
    assert (after["world_size"] == 1).all()
    assert after["loss"].iloc[-4:].mean() < train["loss"].iloc[:4].mean()  # training went on
    if (
        on_resize == "keep"
    ):  # the same global batches with the same lr: the parameters of a run on 2 ranks that nothing cut
        nshosts.revive(hosts, "h2")
        whole.restart()
        assert whole.n == 2
        _uninterrupted(
            whole, marker, tmp_path / "whole", rd.TrainConfig(**RESIZE, checkpoint_dir=str(tmp_path / "whole" / "ckpt"))
        )
        _assert_same_parameters(tmp_path / "ckpt", tmp_path / "whole" / "ckpt")


@pytest.mark.hosts
@pytest.mark.engines
@pytest.mark.timeout(600)
def test_without_min_workers_a_host_down_fails_the_restart_at_once(hosts, whole, tmp_path: Path) -> None:
    marker, directory = tmp_path / "stalled", tmp_path / "ckpt"
    killer = _when_stalled(marker, hosts.host("h2").kill)
    before = {r["id"] for r in open_store().list_runs(kind="train")[0]}
    with pytest.raises(ClusterError) as info:
        rd.train(
            StallingModel(str(marker), at_call=7, after_checkpoint=str(directory)),
            LoggedData(str(tmp_path)),
            rd.TrainConfig(**RESIZE, checkpoint_dir=str(directory)),
            cluster=whole,
            restarts=1,
            progress=False,
            live=False,
        )
    killer.join()
    message = str(info.value)
    assert "only 1 of 2 engines can start (h2: ssh fails" in message and "need 2" in message, message
    assert f"the last checkpoint is in {directory}" in message
    run = _new_run(before)
    assert run["status"] == "failed" and "h2" in run["error"]
    assert ckpt.load(ckpt.checkpoint_path(directory))["step"] == 4


@pytest.mark.slurm
@pytest.mark.engines
@pytest.mark.timeout(600)
def test_a_slurm_job_cancelled_from_outside_restarts_as_a_new_job(local_slurm, tmp_path: Path) -> None:
    marker = tmp_path / "stalled"
    config = rd.TrainConfig(**RESIZE, checkpoint_dir=str(tmp_path / "ckpt"))
    with rd.Cluster(n=2, launcher="slurm", nodes=2, ntasks_per_node=1) as cluster:
        first = cluster.status()["job"]["id"]
        killer = _when_stalled(marker, lambda: local_slurm.run("scancel", first))
        result = rd.train(
            StallingModel(str(marker), at_call=7, after_checkpoint=config.checkpoint_dir),
            LoggedData(str(tmp_path)),
            config,
            cluster=cluster,
            restarts=1,
            progress=False,
            live=False,
        )
        killer.join()
        second = cluster.status()["job"]["id"]
        assert second != first and first not in local_slurm.queue()
        _uninterrupted(
            cluster,
            marker,
            tmp_path / "whole",
            rd.TrainConfig(**RESIZE, checkpoint_dir=str(tmp_path / "whole" / "ckpt")),
        )
    assert second not in local_slurm.queue()

    assert open_store().get_run(result.run_id)["status"] == "finished"
    (restart,) = open_store().records(result.run_id)["restarts"]["value"]
    assert f"job {first} ended (CANCELLED" in restart["cause"] and restart["ranks"] == [0, 1], restart
    assert restart["workers"] == 2 and restart["resumed_from_step"] == 4
    assert served(tmp_path, attempt=0, first=4 * 8) + served(tmp_path, attempt=1) == Counter(range(SAMPLES))
    steps = result.history[result.history["kind"] == "train"]["step"].tolist()
    assert steps[-1] == 12 and set(range(5, 13)) <= set(steps)
    _assert_same_parameters(
        tmp_path / "ckpt", tmp_path / "whole" / "ckpt"
    )  # resumed in the new job from step 4, ended as if never cut
