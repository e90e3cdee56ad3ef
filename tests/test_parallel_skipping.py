"""Pipeline stages of library models that cannot be traced: each stage runs the model's own forward, other stages' layers skipped.

In one process: the stages of transformers' GPT-2 (tied head), Llama, BERT and ViT and of
an ``nn.TransformerEncoder`` LM, chained as the pipeline chains them (each stage's output
detached and received by the next, with the micro-batch's inputs), compute the model's
outputs and, backward, its gradients. Stages built from a model recorded on the meta device
(as each rank builds its stage) hold only their own parameters. Models whose layers cannot
be stages (an encoder-decoder; a parameter read between the layers) are refused before
training with the reason. On ranks, the conformance matrix (tests/test_conformance.py)
trains every architecture pipelined against one process.
"""

from __future__ import annotations

import pytest
import torch
from library_models import MODELS
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel import skipping, split


def _train_chain(model: nn.Module, bounds: list[int], inputs: torch.Tensor, targets: torch.Tensor, loss) -> object:
    """Forward and backward through the stages as the pipeline runs them: each stage's output detached and received by the
    next (with the micro-batch's inputs), the gradient of each received activation sent back into the stage before."""
    stages = [split.stage_module(model, bounds, s)[0] for s in range(len(bounds) - 1)]
    sent: list[torch.Tensor] = []
    received: list[torch.Tensor] = []
    out: object = None
    for index, stage in enumerate(stages):
        if index == 0:
            out = stage(inputs)
        else:
            assert isinstance(out, torch.Tensor)  # these models' layers return the hidden state alone
            received.append(out.detach().requires_grad_(True))
            out = stage(received[-1], inputs=inputs)
        if index < len(stages) - 1:
            sent.append(out)  # type: ignore[arg-type]
    loss(out, targets).backward()
    for index in range(len(sent) - 1, -1, -1):
        sent[index].backward(received[index].grad)
    return out


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "torch_encoder_lm"])
def test_stages_compute_the_models_outputs_and_gradients(name: str) -> None:
    architecture = MODELS[name]
    torch.manual_seed(0)
    model = architecture.model_fn()
    inputs, targets = architecture.data()[0][:4]
    inputs = inputs.double() if inputs.is_floating_point() else inputs
    expected = model(inputs)
    architecture.loss(expected, targets).backward()
    gradients = {n: p.grad.clone() for n, p in model.named_parameters()}
    blocks = split.pipeline_blocks(model)
    assert isinstance(split.stage_module(model, [0, 1, len(blocks)], 0)[0], skipping.LayerStage)
    for bounds in ([0, 1, len(blocks)], [0, 1, 2, len(blocks)]):  # two stages; three, the last holding only the head
        model.zero_grad()
        got = _train_chain(model, bounds, inputs, targets, architecture.loss)
        logits = lambda out: out if isinstance(out, torch.Tensor) else out["logits"]  # noqa: E731
        assert torch.equal(logits(got), logits(expected)), bounds
        for parameter, p in model.named_parameters():
            assert torch.allclose(p.grad, gradients[parameter], rtol=1e-10, atol=1e-13), (bounds, parameter)


def test_a_stage_of_a_model_recorded_on_the_meta_device_makes_only_its_own_parameters() -> None:
    """As each rank builds its stage: the embeddings and layer 0 stay on the meta device for stage 1, whose forward makes
    its side inputs (positions, the causal mask) from the batch with zeros where it would read them."""
    from rapydli.parallel.deferred import record

    architecture = MODELS["gpt2"]
    torch.manual_seed(0)
    whole = architecture.model_fn()
    torch.manual_seed(0)
    meta, recording = record(architecture.model_fn)
    inputs = architecture.data()[0][:4][0]
    bounds = [0, 1, len(split.pipeline_blocks(meta))]
    stage = split.stage_module(meta, bounds, 1)[0]
    recording.materialize(stage, within=meta)
    recording.materialize(stage.context, within=meta)
    assert meta.transformer.wpe.weight.is_meta and meta.transformer.h[0].attn.c_attn.weight.is_meta
    assert not any(p.is_meta for p in stage.parameters()) and stage.whole is meta
    assert {id(p) for p in stage.parameters()} >= {
        id(meta.lm_head.weight),
        id(meta.transformer.wte.weight),
    }  # the tied head
    received = split.stage_module(whole, bounds, 0)[0](inputs).detach()
    expected = split.stage_module(whole, bounds, 1)[0](received, inputs=inputs)
    assert torch.equal(stage(received, inputs=inputs)["logits"], expected["logits"])


def test_an_encoder_decoder_is_refused_naming_why() -> None:
    from rapydli.parallel.preflight import meta_model

    with pytest.raises(
        ConfigError,
        match="^T5ForConditionalGeneration is an encoder-decoder: its decoder's layers read the encoder's output",
    ):
        split.pipeline_blocks(meta_model(MODELS["t5"].model_fn))


class _Scaled(nn.Module):
    """Layers with a learned scale applied between them, and a branch on a value the tracer cannot follow."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.scale = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(4, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        if bool((idx > 100).any()):
            x = -x
        for layer in self.layers:
            x = layer(x) * self.scale
        return self.head(x)


def test_a_parameter_read_between_the_layers_is_refused_naming_it() -> None:
    reason = r"_Scaled's forward reads scale, a parameter outside layers, between its layers, which a stage holding only some layers cannot"
    with pytest.raises(
        ConfigError, match=rf"^{reason} compute. Nor can it be traced: .*forward branches on a tensor's value"
    ):
        split.pipeline_blocks(_Scaled())


def test_measuring_for_an_auto_split_is_no_training_step() -> None:
    """pipeline_split="auto" times forwards on rank 0's model before training: BatchNorm's running statistics and the
    random state must be what they were (they were not, and a pipelined ResNet's statistics differed from one process's)."""
    traced = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    for model, sample in (
        (MODELS["resnet"].model_fn(), torch.randn(4, 3, 8, 8, dtype=torch.float64)),
        (traced, torch.randn(8, 4)),
    ):
        before = [b.clone() for b in model.buffers()]
        state = torch.random.get_rng_state()
        measured = split.measure(model, sample)
        assert len(measured) == len(split.pipeline_blocks(model)) and all(t > 0 for t in measured)
        assert all(torch.equal(a, b) for a, b in zip(before, model.buffers(), strict=True))
        assert torch.equal(state, torch.random.get_rng_state())
