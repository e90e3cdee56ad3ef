"""The one layout object: degrees, refusals that name the ranks, and what a run with a cluster really records."""

from __future__ import annotations

import pytest

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.store.runstore import open_store
from rapydli.parallel.layout import Layout


def test_the_layout_answers_replicas_and_which_parallelism_is_on() -> None:
    layout = Layout.of(rd.TrainConfig(pipeline_stages=2, tensor_parallel=2, zero=1), 8)
    assert (layout.data_parallel, layout.ranks_per_replica) == (2, 4)
    assert (
        layout.uses_data_parallel
        and layout.uses_pipeline
        and layout.uses_tensor_parallel
        and layout.uses_zero
        and layout.sharded
    )
    plain = Layout(world_size=4)
    assert plain.data_parallel == 4 and not (
        plain.uses_pipeline or plain.uses_tensor_parallel or plain.uses_zero or plain.sharded
    )
    assert not Layout(world_size=1).uses_data_parallel
    assert layout.describe() == "8 ranks (data_parallel=2 x pipeline_stages=2 x tensor_parallel=2, zero=1)"
    # the grid's rank order: tensor ranks are neighbours, then the stages of one replica
    assert [layout.coordinates(r) for r in (0, 1, 2, 5, 7)] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)]
    assert all(layout.world_rank(*layout.coordinates(r)) == r for r in range(8))
    assert Layout.fits(6, 3) and not Layout.fits(4, 3) and not Layout.fits(2, 2, 2)


def test_a_layout_the_ranks_do_not_divide_into_is_refused_naming_them() -> None:
    with pytest.raises(
        ConfigError, match=r"^the cluster has 4 ranks: pipeline_stages=3 needs a multiple of 3 \(3, 6, 9, ...\)$"
    ):
        Layout.of(rd.TrainConfig(pipeline_stages=3), 4, where="the cluster")
    with pytest.raises(
        ConfigError,
        match=r"this run has 6 ranks: pipeline_stages=2 x tensor_parallel=2 needs a multiple of 4 \(4, 8, 12",
    ):
        Layout(world_size=6, pipeline_stages=2, tensor_parallel=2)
    with pytest.raises(ConfigError, match="has 2 ranks: tensor_parallel=4 needs a multiple of 4"):
        Layout(world_size=2, tensor_parallel=4)


def test_workers_is_only_checked_where_it_is_given() -> None:
    # the complaint of #32: a pipeline of 3 is not refused because of a workers nobody set
    assert rd.TrainConfig(pipeline_stages=3).workers is None
    assert rd.TrainConfig(pipeline_stages=3).ranks_to_start() == 3
    with pytest.raises(ConfigError, match="TrainConfig.workers=2 has 2 ranks: pipeline_stages=3 needs a multiple of 3"):
        rd.TrainConfig(pipeline_stages=3, workers=2)


@pytest.mark.engines
def test_a_cluster_decides_the_ranks_and_a_workers_that_differs_is_refused_before_anything_runs() -> None:
    mlp, digits = "rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits"
    store = open_store()
    with rd.Cluster(n=3) as cluster:
        before = store.list_runs()[1]
        with pytest.raises(
            ConfigError, match=r"TrainConfig.workers=2, but the cluster this run uses has 3 engines: .* set workers=3"
        ):
            rd.train(mlp, digits, rd.TrainConfig(max_steps=2, workers=2), cluster=cluster, progress=False)
        with pytest.raises(
            ConfigError, match=r"^the cluster has 3 ranks: pipeline_stages=2 needs a multiple of 2 \(2, 4, 6, ...\)$"
        ):
            rd.train(mlp, digits, rd.TrainConfig(max_steps=2, pipeline_stages=2), cluster=cluster, progress=False)
        assert store.list_runs()[1] == before  # refused before anything ran: nothing recorded
        # pipeline_stages=3 on 3 engines: no workers to set
        result = rd.train(
            mlp,
            digits,
            rd.TrainConfig(max_steps=2, batch_size=8, pipeline_stages=3, pipeline_split="2,4"),
            cluster=cluster,
            progress=False,
        )
    run = store.get_run(result.run_id)
    assert run["status"] == "finished" and run["world_size"] == 3
    assert run["params"]["config"]["workers"] == 3 and run["params"]["config"]["pipeline_stages"] == 3
    assert result.history[result.history["kind"] == "train"]["world_size"].eq(3).all()
