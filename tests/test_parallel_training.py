"""A pipelined ``rd.train`` on a real 2-engine cluster: history, timeline, refusals, a failing stage."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch
import train_cases
from torch import nn

import rapydli as rd
from rapydli.errors import ConfigError, RankFailure
from rapydli.trainer import Trainer
from rapydli.widgets.timeline import LiveTimeline
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


class Dying(nn.Module):
    """Its process exits (``os._exit``: a segfault, an OOM kill) in forward once it has run ``after`` times."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.calls = after, 0
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.after:
            os._exit(3)
        return self.fc(x)


def dying_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), Dying(after=5))


class Paced(nn.Module):
    """Sleeps ``seconds`` in forward: steps that last however fast the machine is."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def paced_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), Paced(0.004), nn.Linear(64, 10), Paced(0.004))


def test_a_world_that_does_not_divide_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="TrainConfig.workers=2 has 2 ranks: pipeline_stages=4 needs a multiple of 4"):
        rd.TrainConfig(pipeline_stages=4, workers=2)
    # without workers the ranks are checked when they are known (the cluster's); rd.train alone starts a fitting one
    assert (
        rd.TrainConfig(pipeline_stages=4).ranks_to_start() == 4
        and rd.TrainConfig(pipeline_stages=3, tensor_parallel=2).ranks_to_start() == 6
    )
    with pytest.raises(ConfigError, match="TrainConfig.microbatches=8 is larger than batch_size=4"):
        rd.TrainConfig(pipeline_stages=2, batch_size=4, microbatches=8)
    with pytest.raises(ConfigError, match="autotune=True cannot be combined with pipeline_stages=2"):
        rd.TrainConfig(pipeline_stages=2, autotune=True)
    with pytest.raises(ConfigError, match="pipeline_split='a,b' names 2 split point"):
        rd.TrainConfig(pipeline_stages=2, pipeline_split=["a", "b"])
    assert rd.TrainConfig(pipeline_stages=2, pipeline_split=["blocks.2"]).pipeline_split == "blocks.2"


def test_a_model_that_computes_its_own_loss_and_lists_its_blocks_is_refused_pipelined() -> None:
    """Its forward takes the targets; the blocks it lists never call that forward: a ConfigError before the grid or the split.

    The same model without ``pipeline_blocks()`` is traced, its loss kept in the last block
    (``test_parallel_layouts`` trains it pipelined).
    """
    from hf_models import gpt2

    train, _ = train_cases.tokens()
    config = rd.TrainConfig(max_steps=1, batch_size=4, pipeline_stages=2, microbatches=2)
    with pytest.raises(
        ConfigError,
        match="GPT2LMHeadModel.forward takes 'labels' and computes its own loss, which pipeline_stages=2 cannot run",
    ) as info:
        Trainer(gpt2(), None, train, None, config)
    assert "loss_fn=lambda logits, targets" in str(info.value) and "remove pipeline_blocks()" in str(info.value)
    assert "pipeline_stages=1" in str(info.value)


@pytest.mark.engines
def test_a_cluster_that_does_not_divide_is_refused_before_the_run_starts(cluster) -> None:
    config = rd.TrainConfig(max_steps=2, pipeline_stages=4)
    with pytest.raises(
        ConfigError, match=r"the cluster has 2 ranks: pipeline_stages=4 needs a multiple of 4 \(4, 8, 12, ...\)"
    ):
        rd.train(deep_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)


@pytest.mark.engines
def test_pipelined_training_records_history_and_a_timeline(cluster) -> None:
    config = rd.TrainConfig(
        max_steps=6, batch_size=32, lr=0.01, eval_every=3, pipeline_stages=2, microbatches=4, pipeline_split="auto"
    )
    result = rd.train(deep_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)
    history = result.history
    train_rows = history[history["kind"] == "train"]
    eval_rows = history[history["kind"] == "eval"]
    assert train_rows["step"].tolist() == list(range(1, 7))
    assert train_rows["loss"].notna().all() and eval_rows["val_loss"].notna().all()
    assert sorted(result.timelines) == [0, 1]
    assert {e["stage"] for e in result.timelines.values()} == {0, 1}
    figure = result.timeline()
    rows = {y for bar in figure.data for y in bar.y}
    assert rows == {"rank 0", "rank 1"}
    names = {bar.name for bar in figure.data if len(bar.x)}
    assert {"forward", "backward", "ideal"} <= names
    assert "theory 20.0%" in figure.layout.title.text  # (p - 1) / (m + p - 1) = 1/5


@pytest.mark.engines
def test_a_stage_that_raises_names_its_rank_and_where_the_other_rank_was(cluster) -> None:
    config = rd.TrainConfig(
        max_steps=4, batch_size=16, microbatches=2, pipeline_stages=2, pipeline_split="3", pipeline_schedule="gpipe"
    )
    with pytest.raises(RankFailure) as info:
        rd.train(exploding_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False)
    text = str(info.value)
    assert info.value.ranks == [1]
    assert "StageFailure: pipeline stage 1 failed in forward(" in text and "the last stage broke" in text
    # rank 0 names its action when it stops within the 3 s grace; on a heavily loaded machine
    # IPython's formatting of its traceback can outlast the grace and the job aborts it instead
    # (the action naming itself is tested under mpiexec in test_parallel_executor.py)
    assert (
        "other ranks: 0 interrupted (pipeline stage 0 was in recv_gradient(" in text or "other ranks: 0 aborted" in text
    )
    if "other ranks: 0 aborted" in text:  # an aborted MPI job takes the engines with it
        cluster.restart()
    assert cluster.run(lambda: 7) == [7, 7]


@pytest.mark.engines
def test_the_timeline_is_drawn_while_the_run_goes(cluster) -> None:
    """rd.train's live timeline gets every rank's steps as they run and redraws the latest complete one."""
    timeline = LiveTimeline(live=False, max_redraws_per_s=20)
    drawn: list[tuple[float, int | None]] = []

    def follow(row: dict) -> None:
        timeline(row)
        drawn.append((time.monotonic(), timeline.step))

    config = rd.TrainConfig(
        max_steps=60, epochs=10, batch_size=16, pipeline_stages=2, microbatches=2, pipeline_split="3"
    )
    result = rd.train(
        paced_mlp,
        "rapydli.zoo.datasets:digits",
        config,
        cluster=cluster,
        progress=False,
        live=False,
        callbacks=[follow],
    )
    ended = time.monotonic()
    timeline.close()
    assert timeline.received == 2 * 60 and timeline.step == 60  # every rank's every step; the last drawn at the end
    steps = sorted({step for _, step in drawn if step is not None})
    assert len(steps) >= 3, steps  # redrawn while the run went (a batch at the end would give one step)
    first = min(t for t, step in drawn if step is not None)
    # 60 steps of >= 16 ms each (4 sleeps of 4 ms): the first drawing comes well before the run ends
    assert first < ended - 0.3, (ended - first, steps)
    assert result.timelines[1]["step"] == 60


@pytest.mark.engines
def test_a_rank_killed_mid_schedule_is_named_and_nothing_hangs(cluster) -> None:
    """Rank 1 (the last stage) dies in its sixth forward, in step 3: one RankFailure naming it, within the bound."""
    config = rd.TrainConfig(max_steps=20, batch_size=16, microbatches=2, pipeline_stages=2, pipeline_split="3")
    started = time.monotonic()
    with pytest.raises(RankFailure) as info:
        rd.train(dying_mlp, "rapydli.zoo.datasets:digits", config, cluster=cluster, progress=False, live=False)
    elapsed = time.monotonic() - started
    text = str(info.value)
    try:
        assert elapsed < 30, text  # generous for a loaded machine; a hang would last minutes
        assert info.value.ranks == [1] and info.value.died, text
        assert text.startswith("rank 1 died\n--- rank 1 (dead) ---\nthe engine process died"), text
        # rank 0 waits for rank 1 in its schedule: the notebook's interrupt makes it say where, unless
        # mpiexec's clean-up (which kills a job's other ranks when one dies) reached it first
        other = re.search(r"^other ranks: 0 (.*)$", text, flags=re.M)
        assert other, text
        said = re.fullmatch(r"interrupted \(pipeline stage 0 was in [a-z_]+\(\d+\) of step \d+\)", other[1])
        assert said or other[1] == "dead", text
    finally:
        cluster.restart()
    assert cluster.run(lambda: 7) == [7, 7]
