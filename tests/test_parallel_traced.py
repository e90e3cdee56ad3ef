"""Pipeline blocks read by tracing the forward of models as their codebases write them (no ``pipeline_blocks()``).

Training them pipelined equal to one process is tests/test_parallel_layouts.py's (the
``*_as_written`` and ``nanogpt`` cases); here: what the blocks are, that they compose to
the model's forward (its own loss included), and every refusal.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import BertForTokenClassification, GPT2LMHeadModel, LlamaForCausalLM, NanoGPT, as_written
from torch import nn
from torch.nn import functional as F

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.parallel import split, traced
from rapydli.parallel.preflight import check_layout
from rapydli.zoo.models import ResNetMini


def _composed(blocks: list[tuple[str, nn.Module]], x: torch.Tensor, targets: torch.Tensor | None = None) -> object:
    for _, block in blocks:
        x = block(x, targets) if getattr(block, "takes_targets", False) else block(x)
    return x


def _tensors(value: object) -> list[torch.Tensor]:
    return [t for t in traced.leaves(value)[0] if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize(
    ("cls", "names", "targets"),
    [
        (
            as_written(GPT2LMHeadModel),
            ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"],
            "labels",
        ),
        (
            as_written(LlamaForCausalLM),
            ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"],
            "labels",
        ),
        (
            as_written(BertForTokenClassification),
            [
                "bert.embeddings.word_embeddings",
                "bert.embeddings.LayerNorm",
                "bert.encoder.layer.0",
                "bert.encoder.layer.1",
                "bert.pooler.dense",
            ],
            "labels",
        ),
        (NanoGPT, ["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"], "targets"),
    ],
    ids=["gpt2", "llama", "bert", "nanogpt"],
)
def test_blocks_of_a_model_as_written_compose_to_its_forward_with_and_without_its_loss(
    cls: type[nn.Module], names: list[str], targets: str
) -> None:
    torch.manual_seed(0)
    model = cls().eval()  # no dropout: the two runs compare exactly
    idx, labels = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    for given in (None, targets):
        blocks = split.pipeline_blocks(model, given)
        assert [name for name, _ in blocks] == names
        assert [getattr(b, "takes_targets", False) for _, b in blocks] == [False] * (len(names) - 1) + [
            given is not None
        ]
        expected = model(idx, **({given: labels} if given else {}))
        got = _composed(blocks, idx, labels)
        assert type(got) is type(expected)  # a ModelOutput stays a ModelOutput, a tuple a tuple
        assert (
            len(_tensors(got))
            == len(_tensors(expected))
            == (2 if given else 1) + (cls.__name__ == "BertForTokenClassification")
        )
        for a, b in zip(_tensors(got), _tensors(expected), strict=True):
            assert torch.equal(a, b)
    # the blocks share the model's modules: every parameter is in a block, a tied weight one parameter in the first and the last
    ids = [{id(p) for p in block.parameters()} for _, block in split.pipeline_blocks(model)]
    assert set().union(*ids) == {id(p) for p in model.parameters()}
    assert len(ids[0] & ids[-1]) == (1 if cls.__name__ in ("GPT2LMHeadModel", "NanoGPT") else 0)


def test_an_assert_on_a_shape_stays_a_check_and_dropout_draws_as_in_forward() -> None:
    torch.manual_seed(0)
    model = NanoGPT()  # training mode: dropout on
    blocks = split.pipeline_blocks(model, "targets")
    idx, targets = torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))
    torch.manual_seed(1)
    expected = model(idx, targets)
    torch.manual_seed(1)
    got = _composed(blocks, idx, targets)
    assert torch.equal(expected[1], got[1])  # type: ignore[index]
    with pytest.raises(AssertionError, match="assert in forward"):
        _composed(blocks, torch.randint(0, 32, (2, 9)))  # longer than block_size: nanoGPT's assert still holds


def test_what_cannot_be_traced_or_cut_is_refused_saying_why_and_the_fix() -> None:
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                if x.sum() > 0:  # a branch on a value
                    x = -x
            return x

    with pytest.raises(
        ConfigError,
        match=r"Branches cannot be split into pipeline stages by tracing its forward \(TraceError: forward branches "
        r"on a tensor's value \(.*test_parallel_traced.py:\d+, in forward\)\): its blocks are layers \(2 x Linear\), .*"
        r"Train it with zero=3 or tensor_parallel instead .* or give the model a pipeline_blocks\(\) method",
    ):
        split.pipeline_blocks(Branches())

    class TwoInputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layers[1](self.layers[0](x) * mask)

    with pytest.raises(
        ConfigError,
        match="TwoInputs.forward needs 'mask' besides its input, which a pipeline cannot pass to its first stage",
    ):
        split.pipeline_blocks(TwoInputs())

    class EarlyTargets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
            x = self.layers[0](x) + targets  # the targets read by the first layer
            x = self.layers[2](self.layers[1](x))
            return F.mse_loss(x, targets)

    with pytest.raises(
        ConfigError, match=r"EarlyTargets.forward reads 'targets' before its last block .* pass loss_fn=fn to rd.train"
    ):
        split.pipeline_blocks(EarlyTargets(), "targets")


def test_blocks_that_compute_something_else_than_forward_are_refused_before_training() -> None:
    class Checks(nn.Module):
        """An isinstance test the tracer answers otherwise than the real call (a Proxy is not a Tensor)."""

        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x * 2 if isinstance(x, torch.Tensor) else x

    model = Checks()
    assert len(split.pipeline_blocks(model)) == 2  # it traces
    with pytest.raises(
        ConfigError,
        match=r"Checks's blocks, read by tracing its forward, do not compute what its forward computes: output 0 "
        r"differs from forward's by up to [\d.e-]+ \(a branch the tracer cannot follow",
    ):
        traced.check_faithful(model, torch.randn(3, 4))
    model = ResNetMini(width=4, blocks=(1, 1))  # BatchNorm in training mode: the check must not move its statistics
    before = [b.clone() for b in model.buffers()]
    traced.check_faithful(model, torch.randn(2, 3, 8, 8))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))


def test_rd_train_refuses_a_model_that_cannot_be_pipelined_once_on_the_client() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + x

    config = rd.TrainConfig(max_steps=1, batch_size=4, pipeline_stages=2, workers=2)
    with pytest.raises(ConfigError, match=r"Residual's forward, traced, has no point where one tensor alone flows"):
        check_layout(Residual, config)
    check_layout(
        NanoGPT,
        rd.TrainConfig(max_steps=1, batch_size=4, pipeline_stages=2, workers=2, pipeline_split="transformer.h.1"),
    )
