"""A model never built whole (``rapydli.parallel.deferred``): recorded on the meta device, each tensor made alone, bit-equal.

The equivalence of every split layout built this way (zero=3 on dp, x tp2, x pp2) to one
process is ``test_parallel_zero3``'s (its ranks build the model as ``rd.train`` does); here:
the values, the random state, what cannot be recorded, and the memory of a model whose
parameters alone are more than what a rank uses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rapydli.parallel import deferred
from rapydli.parallel.deferred import Unrecordable, record, recording_of
from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from hf_models import bert, gpt2, llama  # noqa: E402

from rapydli.zoo import models  # noqa: E402


class Initialised(nn.Module):
    """Initialisation the way model code writes it: nn.init on parameters, slices, copies, a constant buffer, a re-init pass."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = nn.Parameter(torch.randn(6) * 0.02)  # a random factory, then an op on it
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
        nn.init.orthogonal_(self.b.weight)  # QR of what it drew: recorded as one call
        nn.init.trunc_normal_(self.a.weight, std=0.02)  # draws until every value is in range: recorded as one call
        with torch.no_grad():
            self.a.weight[:, :2].zero_()  # part of a weight, through a view
            self.b.bias.copy_(self.a.bias * 2)  # one parameter from another
        self.apply(self._init)  # nanoGPT's pass over every module after they are built

    def _init(self, module: nn.Module) -> None:
        if module is self.b:
            nn.init.normal_(module.weight, mean=0.0, std=0.1)


MODELS = {
    "gpt2": gpt2,  # Conv1D made by torch.randn(...) * 0.02, tied lm_head
    "llama": llama,
    "bert": bert,
    "resnet": models.resnet_digits,  # BatchNorm: num_batches_tracked is torch.tensor(0) on the meta device
    "initialised": Initialised,
}


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_tensor_computed_alone_equals_the_whole_models_and_the_random_state_goes_on_the_same(
    name: str, dtype: torch.dtype
) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(7)
        whole = MODELS[name]()
        drawn_after_whole = torch.rand(5)
        torch.manual_seed(7)
        model, recording = record(MODELS[name])
        drawn_after_record = torch.rand(5)
    finally:
        torch.set_default_dtype(previous)
    assert torch.equal(
        drawn_after_record, drawn_after_whole
    )  # the data order, dropout: the same as after building whole
    assert recording_of(model) is recording
    assert all(p.is_meta for p in model.parameters())
    expected = dict(whole.named_parameters()) | dict(whole.named_buffers())
    for key, tensor in [*model.named_parameters(), *model.named_buffers()]:
        state = torch.random.get_rng_state()
        made = recording.value(tensor)
        assert torch.equal(
            torch.random.get_rng_state(), state
        )  # replaying draws from saved states, the caller's untouched
        assert made.dtype == expected[key].dtype and torch.equal(made, expected[key].detach()), key


def test_materialize_keeps_tied_weights_tied_and_lazy_parameters_hold_no_memory() -> None:
    torch.manual_seed(0)
    whole = gpt2()
    model, recording = record(gpt2)
    recording.materialize(model)
    assert model.lm_head.weight is model.transformer.wte.weight  # one parameter, as in the whole model
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), whole.state_dict().values(), strict=True))
    lazy, recording = record(gpt2)
    recording.materialize(lazy, lazy=True)
    from rapydli.parallel import deferred

    weight = lazy.transformer.wte.weight
    assert (
        deferred.is_lazy(weight) and weight.untyped_storage().nbytes() == weight.element_size()
    )  # a stride-0 placeholder
    assert torch.equal(deferred.value(weight), whole.transformer.wte.weight.detach())


class ReadsAValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        if self.linear.weight.abs().max().item() > 10:  # a branch on a value: there are none on the meta device
            raise AssertionError


class ConstantBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("scale", torch.tensor([0.5, 2.0]) * 3)  # data the meta device does not keep, then read


class SkipsMeta(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        from torch.nn.init import (
            orthogonal_,
        )  # imported before recording: the function that returns at once for meta tensors

        _skipping(orthogonal_)(self.weight)


def _skipping(initialiser):
    def skip(tensor):
        return tensor if tensor.is_meta else initialiser(tensor)

    return skip


@pytest.mark.parametrize(
    ("model_fn", "named"),
    [
        (ReadsAValue, "failed on the meta device"),
        (SkipsMeta, "weight was allocated but never initialised"),
        (lambda: 3, "returned int, not an nn.Module"),
    ],
    ids=["reads-a-value", "initialiser-skips-meta", "not-a-module"],
)
def test_what_cannot_be_recorded_is_refused_naming_it_and_the_random_state_is_left_as_it_was(
    model_fn, named: str
) -> None:
    torch.manual_seed(1)
    state = torch.random.get_rng_state()
    with pytest.raises(Unrecordable, match=named):
        record(model_fn)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_a_model_fn_that_cannot_be_recorded_is_built_whole_and_says_why() -> None:
    from rapydli.trainer.task import build_model

    model, built = build_model(ReadsAValue, TrainConfig(zero=3, workers=2), 2, "cpu")
    assert not any(p.is_meta for p in model.parameters()) and built.startswith(
        "whole: model_fn() failed on the meta device"
    )
    model, built = build_model(gpt2, TrainConfig(zero=2, workers=2), 2, "cpu")
    assert built == "whole"  # every rank holds every parameter at zero=2 anyway


@pytest.mark.parametrize(
    ("fields", "deferred"),
    [
        ({"zero": 3}, True),
        ({"tensor_parallel": 2}, True),
        ({"pipeline_stages": 2, "pipeline_split": "h.1"}, True),
        ({"pipeline_stages": 2}, False),  # the automatic split times the whole model's blocks on rank 0
        ({"zero": 2}, False),
        ({}, False),
    ],
)
def test_the_layout_records_the_model_when_it_is_split(fields: dict, deferred: bool) -> None:
    config = TrainConfig(workers=2, **fields)
    assert Layout.of(config, 2).builds_deferred(config) is deferred


@pytest.mark.mpi
def test_a_model_whose_parameters_are_more_than_a_rank_uses_trains_with_zero3_never_built_whole(run_mpi) -> None:
    # glibc keeps freed blocks mapped by default (its thresholds grow with use): make resident memory what the process holds
    env = {"MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = {}
    for how in ("deferred", "whole"):
        code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_deferred; cases_deferred.bigger_than_a_rank({how!r})"
        result = run_mpi(code, n=4, timeout=300, env=env)
        assert result.stderr.count("OK deferred") == 4, result.stderr
        rows[how] = next(json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    size = rows["deferred"]["parameter_bytes"]
    assert rows["deferred"]["built"] == "deferred" and rows["whole"]["built"] == "whole"
    assert rows["deferred"]["checksum"] == rows["whole"]["checksum"]  # the same training either way
    # SGD without momentum, zero=3 on 4 ranks: 8 bytes a parameter / 4 kept, plus the blocks gathered and the gradients in flight
    assert all(growth < 0.85 * size for growth in rows["deferred"]["growth"]), (rows, size)
    assert all(growth >= size for growth in rows["whole"]["growth"]), (
        rows,
        size,
    )  # building it whole holds all of it at once


def _bit_equal(model_fn) -> None:
    """``record(model_fn)`` gives every parameter and buffer of ``model_fn()`` bit-equal, and leaves the random state as it does."""
    torch.manual_seed(3)
    whole = model_fn()
    after_whole = torch.random.get_rng_state()
    torch.manual_seed(3)
    model, recording = record(model_fn)
    assert torch.equal(torch.random.get_rng_state(), after_whole)
    made = dict([*whole.named_parameters(), *whole.named_buffers()])
    mine = dict([*model.named_parameters(), *model.named_buffers()])
    assert mine.keys() == made.keys()
    for name, tensor in mine.items():
        value = recording.value(tensor)
        assert value.dtype == made[name].dtype and torch.equal(value, made[name].detach()), name


def test_values_given_to_torch_tensor_are_kept_and_replayed() -> None:
    _bit_equal(ConstantBuffer)


class ConvertsItself(nn.Module):
    """Users' float64 models: ``self.to(dtype)`` ends the constructor, ``.data`` is written, a buffer is computed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.linear.weight.data = torch.randn(4, 4) * 0.1  # a new tensor through .data
        self.linear.bias.data.zero_()
        with torch.no_grad():
            self.linear.weight[0].fill_(1.0)
        positions = torch.arange(8).float()
        self.register_buffer(
            "table", torch.outer(positions, 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))).cos()
        )
        self.to(torch.float64)


@pytest.mark.parametrize(
    "convert",
    [
        lambda m: m,
        lambda m: m.double(),
        lambda m: m.to(torch.float64),
        lambda m: m.half(),
        lambda m: m.bfloat16(),
        lambda m: m.float().double(),
    ],
    ids=["as-built", "double", "to-float64", "half", "bfloat16", "float-then-double"],
)
def test_dtype_conversions_replay_bit_equal(convert) -> None:
    _bit_equal(lambda: convert(ConvertsItself()))
    _bit_equal(lambda: convert(nn.Sequential(nn.Linear(3, 5), nn.LayerNorm(5), nn.Embedding(7, 5))))


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5", "bert", "vit", "resnet"])
def test_transformers_models_built_as_users_build_them_replay_bit_equal(name: str) -> None:
    """``Model(config).double()`` and ``.to(torch.float64)`` of the real library's classes: ``post_init`` runs while recording
    (transformers skips it when it sees the meta device), rotary tables and relative-position buckets are replayed."""
    from library_models import MODELS

    build = MODELS[name].build
    _bit_equal(lambda: build().double())
    _bit_equal(lambda: build().to(torch.float64))


def test_a_frozen_parameter_is_made_at_once_where_trained_ones_stay_placeholders() -> None:
    """ZeRO-3 shards and computes trained parameters only; a frozen one (Whisper's sinusoidal positions) is kept whole, so it is made now."""

    def model_fn() -> nn.Module:
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        model[0].weight.requires_grad_(False)
        return model.double()

    torch.manual_seed(0)
    whole = model_fn()
    torch.manual_seed(0)
    model, recording = record(model_fn)
    recording.materialize(model, lazy=True)
    assert not deferred.is_lazy(model[0].weight) and torch.equal(model[0].weight, whole[0].weight)
    assert deferred.is_lazy(model[1].weight) and torch.equal(deferred.value(model[1].weight), whole[1].weight.detach())
