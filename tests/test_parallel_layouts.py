"""Tensor parallelism and ZeRO reached through TrainConfig, alone and composed, on real MPI ranks.

Every layout trains the same parameters as one process on the same global batch
(float64; ``cases_layouts`` holds the rank-side code). Checkpoints resuming across layouts
are tests/test_train_checkpoint.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch import nn

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent

#: Built-in plans with the vocabulary split too: GPT-2's embedding and head are one (tied) parameter, Llama's two.
GPT2_VOCAB = {"transformer.h.*.attn": "heads", "transformer.h.*.mlp.c_fc": "column", "transformer.h.*.mlp.c_proj": "row",
              "transformer.wte": "vocab", "lm_head": "vocab"}  # fmt: skip
LLAMA_VOCAB = {"model.layers.*.self_attn": "heads", "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
               "model.layers.*.mlp.down_proj": "row", "model.embed_tokens": "vocab", "lm_head": "vocab"}  # fmt: skip
TINY_VOCAB = {
    "blocks.*.attn": "heads",
    "blocks.*.mlp.0": "column",
    "blocks.*.mlp.2": "row",
    "tok": "vocab",
    "head": "vocab",
}

TWO_RANKS = [
    ["tiny_lm", {"tensor_parallel": 2, "grad_clip": 0.05}],
    ["mlp", {"tensor_parallel": 2}],
    ["gpt2", {"tensor_parallel": 2, "grad_clip": 0.05}],  # built-in plan: Conv1D c_attn split by heads, c_fc/c_proj
    ["llama", {"tensor_parallel": 2, "grad_clip": 0.05}],  # built-in plan: GQA q/k/v/o by heads (4 q, 2 kv), SwiGLU
    [
        "bn_cnn",
        {"pipeline_stages": 2, "microbatches": 1, "pipeline_split": "3"},
    ],  # BatchNorm sees the whole batch, as in one process
    [
        "gpt2",
        {"tensor_parallel": 2, "tensor_plan": GPT2_VOCAB, "grad_clip": 0.05},
    ],  # the tied embedding and head split by vocabulary rows
    ["llama", {"tensor_parallel": 2, "tensor_plan": LLAMA_VOCAB}],
    [
        "tiny_lm_default_loss",
        {"tensor_parallel": 2, "tensor_plan": TINY_VOCAB, "grad_clip": 0.05},
    ],  # vocabulary-parallel cross-entropy
    [
        "bert",
        {"tensor_parallel": 2, "grad_clip": 0.05},
    ],  # built-in plan: attention.self by heads, its output.dense row; unused pooler
    ["bert", {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "layer.1"}],
    ["bert", {"zero": 2}],
    [
        "gpt2",
        {"zero": 2},
    ],  # 1 KB buckets: the tied embedding alone in one (reduce-scattered as autograd made its gradient), norms held until due
    ["llama", {"zero": 2}],  # the same with GQA and SwiGLU
    # no pipeline_blocks(): the blocks are traced from forward, whose loss from the labels runs on the last stage
    [
        "gpt2_as_written",
        {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "transformer.h.1"},
    ],  # tied across stages
    ["nanogpt", {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "auto", "grad_clip": 0.05}],
]
FOUR_RANKS = [
    ["tiny_lm", {"tensor_parallel": 2, "grad_clip": 0.05}],  # dp2 x tp2
    [
        "mlp",
        {"tensor_parallel": 2, "zero": 1, "optimizer": "sgd", "momentum": 0.9},
    ],  # dp2 x tp2, ZeRO-1 over the data dimension
    ["tiny_lm", {"tensor_parallel": 2, "zero": 2, "grad_clip": 0.05}],  # dp2 x tp2, ZeRO-2 clipping over its slices
    [
        "tiny_lm",
        {
            "pipeline_stages": 2,
            "tensor_parallel": 2,
            "microbatches": 2,
            "pipeline_split": "blocks.1",
            "grad_clip": 0.05,
        },
    ],
    [
        "mlp",
        {"pipeline_stages": 2, "tensor_parallel": 2, "microbatches": 2, "pipeline_split": "3"},
    ],  # column on stage 0, row on 1
    [
        "tiny_lm",
        {"pipeline_stages": 2, "zero": 1, "microbatches": 2, "pipeline_split": "blocks.1"},
    ],  # dp2 x pp2, ZeRO-1
    [
        "mlp",
        {"pipeline_stages": 2, "zero": 2, "microbatches": 2, "pipeline_split": "3", "grad_clip": 0.05},
    ],  # dp2 x pp2, ZeRO-2
    ["gpt2", {"tensor_parallel": 2}],  # dp2 x tp2
    ["llama", {"tensor_parallel": 2}],  # dp2 x tp2
    [
        "gpt2",
        {"pipeline_stages": 2, "tensor_parallel": 2, "microbatches": 2, "pipeline_split": "h.1", "grad_clip": 0.05},
    ],  # tied across stages
    [
        "llama",
        {
            "pipeline_stages": 2,
            "tensor_parallel": 2,
            "microbatches": 2,
            "pipeline_split": "layers.1",
            "grad_clip": 0.05,
        },
    ],
    [
        "gpt2",
        {
            "pipeline_stages": 2,
            "tensor_parallel": 2,
            "microbatches": 2,
            "pipeline_split": "h.1",
            "tensor_plan": GPT2_VOCAB,
        },
    ],  # tied rows across stages
    [
        "tiny_lm_default_loss",
        {
            "pipeline_stages": 2,
            "tensor_parallel": 2,
            "microbatches": 2,
            "pipeline_split": "blocks.1",
            "tensor_plan": TINY_VOCAB,
        },
    ],
    ["bert", {"tensor_parallel": 2, "zero": 1}],  # dp2 x tp2, ZeRO-1
    [
        "bert",
        {"pipeline_stages": 2, "tensor_parallel": 2, "microbatches": 2, "pipeline_split": "layer.1", "grad_clip": 0.05},
    ],
    ["bert", {"pipeline_stages": 2, "zero": 1, "microbatches": 2, "pipeline_split": "layer.1"}],  # dp2 x pp2, ZeRO-1
    [
        "gpt2_as_written",
        {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "transformer.h.1", "zero": 1},
    ],  # dp2 x pp2, traced
    [
        "llama_as_written",
        {"pipeline_stages": 2, "tensor_parallel": 2, "microbatches": 2, "pipeline_split": "model.layers.1"},
    ],
]


def _cases(run_mpi, function: str, n: int, *args: object) -> tuple[list, str]:
    arguments = ", ".join(repr(a) for a in args)
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_layouts; cases_layouts.{function}({arguments})"
    )
    result = run_mpi(code, n=n, timeout=400)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith(("{", "["))], result.stderr


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "cases"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_every_layout_trains_what_one_process_trains_on_the_global_batch(run_mpi, ranks: int, cases: list) -> None:
    results, stderr = _cases(run_mpi, "main", ranks, json.dumps(cases))
    assert stderr.count("OK layouts") == ranks
    assert len(results) == len(cases)
    for result in results:
        # built as rd.train builds it: a layout that splits the model never builds it whole (rapydli.parallel.deferred)
        splits = "tensor_parallel" in result["case"] or (
            "pipeline_stages" in result["case"] and "'auto'" not in result["case"]
        )
        assert result["built"] == ("deferred" if splits else "whole"), result
        assert result["worst"] < 1e-10, result
        # a pipeline's last stage computes the default loss in float32 (gpt2 and llama pass a float64 loss_fn)
        tolerance = (
            1e-6
            if "pipeline_stages" in result["case"]
            and not result["case"].startswith(("gpt2", "llama", "bn_cnn", "bert", "nanogpt"))
            else 1e-10
        )
        assert result["loss"] < tolerance and result["val_loss"] < tolerance, result
        assert result["evals"] >= 2, result
        if result["case"].startswith(
            ("gpt2", "nanogpt")
        ):  # its embedding and head stayed one parameter, equal wherever it is held
            assert result["tied_checked"] > 0, result
        if "'vocab'" in result["case"]:  # the vocabulary was split, not left dense
            assert {"VocabParallelEmbedding", "VocabParallelHead"} <= set(result["split"]), result
        if result["case"].startswith(
            "tiny_lm_default_loss"
        ):  # the trainer's cross-entropy was computed from each rank's rows
            assert result["vocab_losses"] > 0, result
        if "grad_clip" in result["case"]:  # clipping was at work, by the same global norm as in one process
            assert result["clipped"] >= 2 and result["grad_norm"] < 1e-10, result


def test_tensor_parallel_config_is_checked_before_anything_starts() -> None:
    from rapydli.trainer.config import TrainConfig

    with pytest.raises(
        ConfigError,
        match=r"TrainConfig.workers=2 has 2 ranks: pipeline_stages=2 x tensor_parallel=2 needs a multiple of 4 \(4, 8, 12",
    ):
        TrainConfig(pipeline_stages=2, tensor_parallel=2, workers=2)
    with pytest.raises(
        ConfigError,
        match=r"TrainConfig.workers=3 has 3 ranks: tensor_parallel=2 needs a multiple of 2",
    ):
        TrainConfig(tensor_parallel=2, workers=3)
    with pytest.raises(ConfigError, match="'diagonal' is not a style; allowed: column, row, heads"):
        TrainConfig(tensor_parallel=2, tensor_plan={"0": "diagonal"})
    with pytest.raises(ConfigError, match="tensor_plan='0: column' is invalid: it must be a dict"):
        TrainConfig(tensor_parallel=2, tensor_plan="0: column")
    config = TrainConfig(tensor_parallel=2, tensor_plan={"1": "column", "3": "row"}, workers=4)
    assert config.tensor_plan == '{"1": "column", "3": "row"}'  # kept as JSON text: the run store and the CLI carry it
    assert TrainConfig.from_dict(config.to_dict()) == config
    assert TrainConfig(tensor_plan="auto").tensor_plan is None


def test_the_built_in_plans_and_a_model_without_one() -> None:
    from rapydli.parallel.tensor import plan_for
    from rapydli.zoo import models

    assert plan_for(models.mlp()) == {"1": "column", "3": "row"}  # the classifier (5) stays dense
    assert plan_for(models.mlp(depth=3)) == {"1": "column", "3": "row", "5": "column", "7": "row"}
    assert plan_for(nn.Sequential(nn.Linear(4, 8), nn.Dropout(), nn.Linear(8, 4))) == {"0": "column", "2": "row"}
    assert plan_for(models.tiny_lm())["blocks.*.attn"] == "heads"
    with pytest.raises(ConfigError, match=r"no built-in tensor plan for ResNetMini: pass TrainConfig\(tensor_plan="):
        plan_for(models.resnet_mini())
    with pytest.raises(ConfigError, match="no built-in tensor plan for Sequential"):
        plan_for(nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 4)))


@pytest.mark.engines
def test_rd_train_splits_tiny_lm_over_two_engines_and_refuses_what_cannot_run() -> None:
    import rapydli as rd

    lm, tokens = "rapydli.zoo.models:tiny_lm", "rapydli.zoo.datasets:synthetic_tokens"
    with rd.Cluster(n=2) as cluster:
        with pytest.raises(
            ConfigError, match=r"the cluster has 2 ranks: tensor_parallel=3 needs a multiple of 3 \(3, 6, 9"
        ):
            rd.train(lm, tokens, rd.TrainConfig(max_steps=2, tensor_parallel=3), cluster=cluster, progress=False)
        with pytest.raises(
            ConfigError, match=r"no built-in tensor plan for ResNetMini: pass TrainConfig\(tensor_plan="
        ):  # on the client
            rd.train(
                "rapydli.zoo.models:resnet_digits",
                "rapydli.zoo.datasets:digits",
                rd.TrainConfig(max_steps=2, tensor_parallel=2),
                cluster=cluster,
                progress=False,
            )
        config = rd.TrainConfig(
            max_steps=3,
            batch_size=8,
            eval_every=2,
            tensor_parallel=2,
            tensor_plan={"blocks.*.mlp.0": "column", "blocks.*.mlp.2": "row"},
        )
        history = rd.train(lm, tokens, config, cluster=cluster, progress=False).history
    steps = history[history["kind"] == "train"]
    assert steps["step"].tolist() == [1, 2, 3] and steps["loss"].notna().all()
    assert history[history["kind"] == "eval"]["val_loss"].notna().all()
