"""``rd.train(..., restarts=N)`` on a real 2-engine cluster: an engine killed mid-run, a user error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rapydli as rd
from rapydli.errors import RankFailure
from rapydli.experiments.store import open_store
from rapydli.trainer import checkpoint as ckpt

CONFIG = dict(epochs=1, max_steps=12, batch_size=16, lr=0.05, optimizer="sgd", momentum=0.9, eval_every=0,
              checkpoint_every=4, allreduce="mpi", seed=5)  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def killing_model(marker: Path, at_call: int):
    """A model_fn whose rank 1 dies (``os._exit``) in its ``at_call``-th forward, once (a marker file remembers)."""

    def model_fn():
        import os
        import pathlib

        from rapydli.cluster.engine import context
        from rapydli.zoo import models

        model = models.mlp()
        calls = [0]

        def die(module, args):
            calls[0] += 1
            if context().rank == 1 and calls[0] == at_call and not pathlib.Path(marker).exists():
                pathlib.Path(marker).write_text("killed")
                os._exit(1)

        model.register_forward_pre_hook(die)
        return model

    return model_fn


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_an_engine_killed_mid_run_restarts_and_ends_where_an_uninterrupted_run_ends(cluster, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    rows: list[dict] = []
    config = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "cut"))
    result = rd.train(killing_model(marker, at_call=7), "rapydli.zoo.datasets:digits", config, cluster=cluster,
                      restarts=1, callbacks=[rows.append], progress=False, live=False)  # fmt: skip
    assert marker.exists()  # rank 1 really died
    # the resumed run's steps all arrive; the first attempt's rows may die with its engines (they stream
    # in batches), so only its steps up to the checkpoint that arrived are kept
    steps = result.history[result.history["kind"] == "train"]["step"].tolist()
    assert steps == sorted(set(steps)) and set(range(5, 13)) <= set(steps) and steps[-1] == 12

    run = open_store().get_run(result.run_id)
    assert run["status"] == "finished"
    (restart,) = open_store().records(result.run_id)["restarts"]["value"]
    assert restart["ranks"] == [1] and "died" in restart["cause"] and restart["resumed_from_step"] == 4
    assert [r["step"] for r in rows if r["kind"] == "restart"] == [4]  # the live plot's marker

    reference = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "whole"))
    rd.train(killing_model(marker, at_call=7), "rapydli.zoo.datasets:digits", reference, cluster=cluster, progress=False, live=False)
    cut = ckpt.load(ckpt.checkpoint_path(tmp_path / "cut"))
    whole = ckpt.load(ckpt.checkpoint_path(tmp_path / "whole"))
    assert cut["step"] == whole["step"] == 12
    for name, value in whole["model"].items():
        torch.testing.assert_close(cut["model"][name], value, rtol=0, atol=1e-6)


@pytest.mark.engines
@pytest.mark.timeout(600)
def test_without_restarts_a_death_fails_the_run(cluster, tmp_path: Path) -> None:
    config = rd.TrainConfig(**CONFIG, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(RankFailure) as info:
        rd.train(killing_model(tmp_path / "killed", at_call=3), "rapydli.zoo.datasets:digits", config, cluster=cluster,
                 progress=False, live=False)  # fmt: skip
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
        rd.train("rapydli.zoo.models:mlp", data_fn, rd.TrainConfig(**CONFIG), cluster=cluster, restarts=2, progress=False, live=False)
    assert not info.value.died and "a bug in the user's data_fn" in str(info.value)
    assert attempts.read_text() == "x"  # one attempt only
    (new,) = [r for r in open_store().list_runs(kind="train")[0] if r["id"] not in before]
    assert new["status"] == "failed" and "restarts" not in open_store().records(new["id"])
    assert cluster.run(lambda: 7) == [7, 7]
