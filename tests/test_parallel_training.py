"""A pipelined ``rd.train`` on a real 2-engine cluster: history, timeline, refusals, a failing stage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import rapydli as rd
from rapydli.errors import ConfigError, RankFailure
from rapydli.zoo import models


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def deep_mlp() -> nn.Module:
    return models.mlp(in_features=64, hidden=64, depth=4)


class Exploding(nn.Module):
    """Raises in forward once it has run ``after`` times (a stage that breaks mid-schedule)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("the last stage broke")
        return self.fc(x)


def exploding_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), Exploding(after=5))


def test_a_world_that_does_not_divide_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="TrainConfig.workers=2: 2 ranks cannot run pipeline_stages=4"):
        rd.TrainConfig(pipeline_stages=4)
    with pytest.raises(ConfigError, match="TrainConfig.microbatches=8 is larger than batch_size=4"):
        rd.TrainConfig(pipeline_stages=2, batch_size=4, microbatches=8)
    with pytest.raises(ConfigError, match="autotune=True cannot be combined with pipeline_stages=2"):
        rd.TrainConfig(pipeline_stages=2, autotune=True)
    with pytest.raises(ConfigError, match="pipeline_split='a,b' names 2 split point"):
        rd.TrainConfig(pipeline_stages=2, pipeline_split=["a", "b"])
    assert rd.TrainConfig(pipeline_stages=2, pipeline_split=["blocks.2"]).pipeline_split == "blocks.2"


@pytest.mark.engines
def test_a_cluster_that_does_not_divide_is_refused_before_the_run_starts(cluster) -> None:
    config = rd.TrainConfig(max_steps=2, pipeline_stages=4, workers=4)
    with pytest.raises(ConfigError, match="2 ranks cannot run pipeline_stages=4"):
        rd.train(deep_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)


@pytest.mark.engines
def test_pipelined_training_records_history_and_a_timeline(cluster) -> None:
    config = rd.TrainConfig(max_steps=6, batch_size=32, lr=0.01, eval_every=3, pipeline_stages=2, microbatches=4, pipeline_split="auto")
    result = rd.train(deep_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)
    history = result.history
    train_rows = history[history["kind"] == "train"]
    eval_rows = history[history["kind"] == "eval"]
    assert train_rows["step"].tolist() == list(range(1, 7))
    assert train_rows["loss"].notna().all() and eval_rows["val_loss"].notna().all()
    assert sorted(result.timelines) == [0, 1]
    assert {e["stage"] for e in result.timelines.values()} == {0, 1}
    figure = result.timeline()
    rows = {bar.y[0] for bar in figure.data}
    assert rows == {"rank 0", "rank 1"}
    names = {bar.name for bar in figure.data}
    assert {"forward", "backward", "ideal"} <= names
    assert "theory 20.0%" in figure.layout.title.text  # (p - 1) / (m + p - 1) = 1/5


@pytest.mark.engines
def test_a_stage_that_raises_names_its_rank_and_where_the_other_rank_was(cluster) -> None:
    config = rd.TrainConfig(max_steps=4, batch_size=16, microbatches=2, pipeline_stages=2, pipeline_split="3", pipeline_schedule="gpipe")
    with pytest.raises(RankFailure) as info:
        rd.train(exploding_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)
    text = str(info.value)
    assert info.value.ranks == [1]
    assert "StageFailure: pipeline stage 1 failed in forward(" in text and "the last stage broke" in text
    # rank 0 names its action when it stops within the 3 s grace; on a heavily loaded machine
    # IPython's formatting of its traceback can outlast the grace and the job aborts it instead
    # (the action naming itself is tested under mpiexec in test_parallel_executor.py)
    assert "other ranks: 0 interrupted (pipeline stage 0 was in recv_gradient(" in text or "other ranks: 0 aborted" in text
    if "other ranks: 0 aborted" in text:  # an aborted MPI job takes the engines with it
        cluster.restart()
    assert cluster.run(lambda: 7) == [7, 7]
