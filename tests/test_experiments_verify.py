"""``rd.verify_layout`` on real engines: a right layout passes per parameter, a plan that trains another model is named."""

from __future__ import annotations

import pytest
import torch
import train_cases
from hf_models import gpt2, lm_loss
from torch import nn

import rapydli as rd
from rapydli.errors import ConfigError


def softmax_mlp() -> nn.Module:
    """A softmax between two linear layers: column then row runs, but the softmax sees half the features per rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Softmax(-1), nn.Linear(16, 4))


def test_bad_arguments_are_refused_before_anything_starts() -> None:
    config = rd.TrainConfig(pipeline_stages=2, pipeline_split="h.1", batch_size=4, microbatches=2)
    with pytest.raises(ConfigError, match="steps=0 is invalid"):
        rd.verify_layout(gpt2, train_cases.tokens, config, steps=0, loss_fn=lm_loss)
    with pytest.raises(ConfigError, match="dtype='float16' is invalid: one of float64, float32"):
        rd.verify_layout(gpt2, train_cases.tokens, config, dtype="float16", loss_fn=lm_loss)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.forward takes 'labels'"):
        rd.verify_layout(gpt2, train_cases.tokens, config)


@pytest.mark.engines
def test_verify_layout_passes_a_tied_gpt2_pipeline_and_names_the_parameters_of_a_wrong_plan() -> None:
    with rd.Cluster(n=2) as cluster:
        config = rd.TrainConfig(
            pipeline_stages=2, pipeline_split="h.1", batch_size=4, microbatches=2, optimizer="adamw", lr=0.01
        )
        check = rd.verify_layout(gpt2, train_cases.tokens, config, steps=3, cluster=cluster, loss_fn=lm_loss)
        wrong = rd.verify_layout(
            softmax_mlp,
            train_cases.features,
            rd.TrainConfig(tensor_parallel=2, tensor_plan={"0": "column", "2": "row"}, batch_size=4, lr=0.1),
            steps=2,
            cluster=cluster,
        )
    assert check.passed and check.worst < 1e-9, check.table
    assert check.verdict.startswith(
        "2 ranks (data_parallel=1 x pipeline_stages=2 x tensor_parallel=1, zero=0) trains the one-process model: all 28 parameters within 1e-09"
    )
    assert set(check.table["parameter"]) == {
        name for name, _ in gpt2().named_parameters()
    }  # the tied weight is one row
    assert not wrong.passed and "does NOT train the one-process model" in wrong.verdict, wrong.verdict
    assert set(wrong.table[~wrong.table["ok"]]["parameter"]) >= {"0.weight", "0.bias"}, wrong.table


@pytest.mark.engines
def test_verify_layout_builds_a_library_model_as_rd_train_does() -> None:
    """transformers' GPT-2 built as users build it (``Model(cfg).double()``) under ZeRO-3 and tensor parallelism: verify_layout
    used to build it whole and pass where rd.train's ranks, which record it on the meta device, crashed. Now both record it."""
    from library_models import MODELS

    gpt2_hf = MODELS["gpt2"]
    with rd.Cluster(n=2) as cluster:
        checks = [
            rd.verify_layout(
                gpt2_hf.model_fn,
                gpt2_hf.data,
                rd.TrainConfig(batch_size=2, lr=0.05, **fields),
                steps=2,
                cluster=cluster,
                loss_fn=gpt2_hf.loss,
            )
            for fields in ({"zero": 3}, {"tensor_parallel": 2})
        ]
    for check in checks:
        assert check.passed and check.built == ("deferred",), (check.verdict, check.built)
        held = sum(1 for _ in gpt2_hf.model_fn().parameters()) + sum(1 for _ in gpt2_hf.model_fn().buffers())
        assert len(check.table) == held + 1, (
            check.table
        )  # and the validation loss, as each model's own evaluation computes it
        assert "(validation loss)" in set(check.table["parameter"]) and check.verdict.endswith(
            "its validation loss agrees too"
        ), check.verdict
