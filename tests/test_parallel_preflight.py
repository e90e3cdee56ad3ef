"""A layout that cannot train the model is refused once, on the client, before any engine starts."""

from __future__ import annotations

import pytest
import torch
import train_cases
from hf_models import gpt2, lm_loss
from torch import nn

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.parallel.preflight import check_layout, meta_model

PIPELINED = {"max_steps": 1, "batch_size": 4, "pipeline_stages": 2, "microbatches": 2, "workers": 2}


def _refused_before_the_cluster_starts(model_fn, config: rd.TrainConfig, match: str, **kwargs) -> str:
    cluster = rd.Cluster(n=config.workers)
    with pytest.raises(ConfigError, match=match) as info:
        rd.train(model_fn, train_cases.tokens, config, cluster=cluster, progress=False, **kwargs)
    assert cluster.status()["state"] == "stopped"  # no engine was started, so none worked
    return str(info.value)


def test_a_model_computing_its_own_loss_pipelined_is_refused_once_on_the_client_naming_the_fix() -> None:
    message = _refused_before_the_cluster_starts(
        gpt2,
        rd.TrainConfig(**PIPELINED, pipeline_split="h.1"),
        "GPT2LMHeadModel.forward takes 'labels' and computes its own loss",
    )
    assert "rd.train(..., loss_fn=lambda logits, targets: torch.nn.functional.cross_entropy(" in message
    assert "pipeline_stages=1" in message
    check_layout(
        gpt2, rd.TrainConfig(**PIPELINED, pipeline_split="h.1"), loss_fn=lm_loss
    )  # with the fix: nothing to refuse


def test_a_tie_or_a_plan_that_cannot_be_honoured_is_refused_on_the_client() -> None:
    _refused_before_the_cluster_starts(
        gpt2,
        rd.TrainConfig(**PIPELINED, pipeline_split="h.1", zero=2),
        r"transformer.wte.weight \(also lm_head.weight\) is shared by pipeline stages 0, 1",
        loss_fn=lm_loss,
    )
    nanogpt = rd.TrainConfig(max_steps=1, tensor_parallel=2, workers=2, tensor_plan={"blocks.*.attn": "heads"})
    _refused_before_the_cluster_starts(
        train_cases.TinyGPT,
        nanogpt,
        r"'blocks.0.attn': 'heads' cannot split this CausalSelfAttention \(input width 16\): its forward fails",
    )
    _refused_before_the_cluster_starts(
        gpt2,
        rd.TrainConfig(**PIPELINED, pipeline_split="h.7"),
        r"pipeline_split point 'h.7' is not a split point of GPT2LMHeadModel",
        loss_fn=lm_loss,
    )


def test_the_model_is_built_shape_only_and_a_model_fn_the_meta_device_cannot_run_is_left_to_the_ranks() -> None:
    state = torch.random.get_rng_state()
    model = meta_model(gpt2)
    assert model is not None and model.lm_head.weight.is_meta and model.lm_head.weight is model.transformer.wte.weight
    assert torch.equal(torch.random.get_rng_state(), state)  # the client's random stream is untouched

    def loads_weights() -> nn.Module:
        model = nn.Linear(4, 4)
        if float(model.weight.detach().abs().sum()) == 0:  # reads a value: not on the meta device
            raise AssertionError("untrained")
        return model

    assert meta_model(loads_weights) is None
    check_layout(
        loads_weights, rd.TrainConfig(max_steps=1, tensor_parallel=2, workers=2)
    )  # not checkable here: no error


def test_batch_norm_cut_into_micro_batches_is_refused() -> None:
    def cnn() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4)
        )

    with pytest.raises(
        ConfigError,
        match=r"Sequential has BatchNorm \('1'\): with pipeline_stages=2 and microbatches=2 it would normalise each "
        r"micro-batch .* Set microbatches=1, or use GroupNorm / LayerNorm",
    ):
        check_layout(cnn, rd.TrainConfig(**{**PIPELINED, "pipeline_split": "3"}))
    check_layout(
        cnn, rd.TrainConfig(**{**PIPELINED, "microbatches": 1, "pipeline_split": "3"})
    )  # the replica's whole batch: as data parallelism


def test_a_model_fn_that_moves_its_model_to_a_gpu_is_built_on_the_meta_device_and_its_device_recorded() -> None:
    from rapydli.parallel.preflight import meta_build

    def on_gpu() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8)).to("cuda")
        model.register_buffer("mask", torch.ones(8, device="cuda"))  # a tensor made on the GPU
        return model

    def half_on_gpu() -> nn.Module:
        return nn.Linear(4, 8).cuda().to(torch.bfloat16)

    built = meta_build(on_gpu)
    assert built is not None and built.device == torch.device("cuda")
    assert all(t.is_meta for t in [*built.model.parameters(), *built.model.buffers()])
    half = meta_build(half_on_gpu)
    assert (
        half is not None
        and half.device.type == "cuda"
        and half.model.weight.dtype == torch.bfloat16
        and half.model.weight.is_meta
    )
    on_cpu = meta_build(lambda: nn.Linear(4, 8).to(torch.float64))
    assert on_cpu is not None and on_cpu.device == torch.device("cpu") and on_cpu.model.weight.dtype == torch.float64
