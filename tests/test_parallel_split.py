"""rapydli.parallel.split and grid: where a model may be cut, and which world sizes a grid accepts."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel import split
from rapydli.parallel.layout import Layout


def nested() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Linear(8, 2)
    )


def test_blocks_expand_nested_sequentials_and_containers_are_split_points() -> None:
    model = nested()
    names = [name for name, _ in split.pipeline_blocks(model)]
    assert names == ["0", "1", "2.0", "2.1", "2.2", "3"]
    assert split.split_points(names) == ["1", "2", "2.0", "2.1", "2.2", "3"]
    assert split.boundaries(model, ["2"], 2) == split.boundaries(model, ["2.0"], 2) == [0, 2, 6]
    assert split.boundaries(model, ["2.1", "3"], 3) == [0, 3, 5, 6]


def test_stages_compose_to_the_model() -> None:
    model = nested()
    x = torch.randn(3, 4)
    bounds = split.boundaries(model, ["2.1", "3"], 3)
    y = x
    for stage in range(3):
        module, _ = split.stage_module(model, bounds, stage)
        y = module(y)
    assert torch.equal(y, model(x))


def test_unknown_or_misordered_split_names_the_allowed_points() -> None:
    model = nested()
    with pytest.raises(
        ConfigError, match=r"'blocks\.2' is not a split point of Sequential; allowed: 1, 2, 2\.0, 2\.1, 2\.2, 3"
    ):
        split.boundaries(model, ["blocks.2"], 2)
    with pytest.raises(ConfigError, match="give 2, from: 1, 2"):
        split.boundaries(model, ["2"], 3)
    with pytest.raises(ConfigError, match="forward order"):
        split.boundaries(model, ["3", "2"], 3)
    with pytest.raises(ConfigError, match="'0' is not a split point"):
        split.boundaries(model, ["0"], 2)


def test_a_model_that_cannot_be_split_is_refused_clearly() -> None:
    with pytest.raises(
        ConfigError, match=r"1 block\(s\) \(0\): it cannot be split into pipeline_stages=2; allowed split points: none"
    ):
        split.boundaries(nn.Sequential(nn.Linear(2, 2)), [], 2)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + x

    with pytest.raises(
        ConfigError, match="Net's forward, traced, has no point where one tensor alone flows.*pipeline_blocks"
    ):
        split.pipeline_blocks(Net())


def test_a_model_names_its_own_blocks() -> None:
    from rapydli.zoo.models import tiny_lm

    model = tiny_lm(vocab_size=16, block_size=8, dim=16, layers=3, heads=2)
    names = [name for name, _ in split.pipeline_blocks(model)]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    tokens = torch.randint(0, 16, (2, 8))
    bounds = split.boundaries(model, ["blocks.1", "head"], 3)
    y = tokens
    for stage in range(3):
        y = split.stage_module(model, bounds, stage)[0](y)
    assert torch.allclose(y, model(tokens))


def test_balance_minimises_the_slowest_stage() -> None:
    assert split.balance([1, 1, 1, 1], 2) == [0, 2, 4]
    assert split.balance([5, 1, 1, 1, 1, 1], 2) == [0, 1, 6]
    assert split.balance([1, 1, 4, 1, 1], 3) == [0, 2, 3, 5]
    costs = split.measure(nested(), torch.randn(16, 4))
    assert len(costs) == 6 and all(c > 0 for c in costs)


def test_grid_world_size_must_be_a_multiple_of_stages() -> None:
    assert Layout(6, 3).data_parallel == 2
    with pytest.raises(ConfigError, match="has 3 ranks: pipeline_stages=2 needs a multiple of 2 \\(2, 4, 6"):
        Layout(3, 2)
    with pytest.raises(ConfigError, match="has 1 ranks: pipeline_stages=2 needs"):
        Layout(1, 2)


def test_every_stage_holds_parameters_however_the_blocks_were_timed() -> None:
    # the digits MLP begins with a Flatten: timed slow by a busy machine, "auto" once gave it a stage of its own,
    # and that stage's rank failed with StopIteration (no parameters) in the middle of a sweep
    from rapydli.parallel.preflight import check_layout
    from rapydli.trainer.config import TrainConfig
    from rapydli.zoo.models import mlp

    model = mlp()
    holds = split.holds_parameters(model)
    assert holds == [False, True, False, True, False, True]
    assert split.balance([9.0, 1.0, 0.1, 1.0, 0.1, 1.0], 2) == [0, 1, 6]  # unconstrained: Flatten alone
    assert split.balance([9.0, 1.0, 0.1, 1.0, 0.1, 1.0], 2, holds) == [0, 2, 6]
    for stages in (2, 3):
        bounds = split.balance([9.0, 0.1, 9.0, 0.1, 9.0, 0.1], stages, holds)
        assert all(any(holds[a:b]) for a, b in zip(bounds, bounds[1:])), bounds
    with pytest.raises(
        ConfigError, match=r"only 3 of the model's 6 blocks hold parameters: pipeline_stages=4 needs one per stage"
    ):
        split.balance([1.0] * 6, 4, holds)
    with pytest.raises(ConfigError, match=r"pipeline stage 1 would hold only blocks without parameters \(2\)"):
        split.boundaries(model, ["2", "3"], 3)
    # refused on the client, once, before anything starts
    with pytest.raises(ConfigError, match="only 3 of the model's 6 blocks hold parameters"):
        check_layout(mlp, TrainConfig(pipeline_stages=4, workers=4))


def test_a_decoder_nested_as_hugging_face_nests_it_gives_its_layers_as_blocks() -> None:
    """``LlamaForCausalLM.model.layers``, ``GPT2LMHeadModel.transformer.h``: ZeRO-3 gathers and checkpointing
    recomputes one layer at a time, not the whole decoder as one block."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_models import GPT2LMHeadModel, as_written

    from rapydli.zoo import models

    llama = models.llama_style(vocab=64, hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2)
    assert [name for name, _ in split.model_blocks(llama)] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    gpt2 = as_written(GPT2LMHeadModel)()
    assert [name for name, _ in split.model_blocks(gpt2)] == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
