"""ZeRO-3 (fully sharded parameters) through TrainConfig on real MPI ranks: one process's parameters, 1/N of them kept; offload.

The rank-side code is ``cases_zero3``; the models are the hybrid-parallelism tests' (GPT-2-,
Llama- and BERT-style, float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent


def _run(run_mpi, n: int, call: str) -> tuple[list[dict], str]:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero3; cases_zero3.{call}"
    result = run_mpi(code, n=n, timeout=300)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], result.stderr


TWO_RANKS = [
    [
        "gpt2",
        {"grad_clip": 0.05},
    ],  # tied wte / lm_head in the root unit, fused QKV Conv1D, the loss from labels; clipped over the slices
    ["llama", {"grad_accum": 2, "batch_size": 2}],  # an embedding block of its own, GQA, SwiGLU; two micro-steps a step
    [
        "bert",
        {},
    ],  # the pooler is called under no_grad: it never has a gradient and must not move (weight decay included)
    [
        "bert",
        {"activation_checkpointing": "blocks"},
    ],  # the same, every block recomputed (the pooler's no_grad forward is not)
    [
        "gpt2",
        {"bucket_mb": 0.002},
    ],  # each block's parameters in several buckets (2 KB each), gathered and reduce-scattered apart
]
FOUR_RANKS = [
    ["gpt2", {"activation_checkpointing": "blocks"}],  # dp4
    ["gpt2", {"tensor_parallel": 2, "grad_clip": 0.05, "activation_checkpointing": "blocks"}],  # dp2 x tp2: slices of the split layers sharded
    ["llama", {"tensor_parallel": 2}],  # dp2 x tp2 without checkpointing: GQA's heads split
    ["llama", {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "layers.1", "grad_clip": 0.05,
               "activation_checkpointing": "every_k:2"}],  # dp2 x pp2: each stage's blocks sharded over its replicas
    ["llama", {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "layers.1"}],  # dp2 x pp2 without checkpointing
]  # fmt: skip
#: Blocks each checkpointing spec recomputes: GPT-2's h.0 and h.1; Llama's embed_tokens, layers.0 and layers.1 (every_k:2: embed_tokens and
#: layers.1); BERT-style's encoder, pooler and classifier.
RECOMPUTED = {("gpt2", "blocks"): 2, ("llama", "every_k:2"): 2, ("bert", "blocks"): 3}


@pytest.mark.mpi
@pytest.mark.parametrize(("ranks", "cases"), [(2, TWO_RANKS), (4, FOUR_RANKS)], ids=["2-ranks", "4-ranks"])
def test_zero3_trains_what_one_process_trains_and_keeps_a_slice_of_every_parameter(
    run_mpi, ranks: int, cases: list
) -> None:
    rows, stderr = _run(run_mpi, ranks, f"equivalence({json.dumps(cases)!r})")
    assert stderr.count("OK zero3") == ranks
    assert [[row["model"], row["fields"]] for row in rows] == cases
    for row in rows:
        assert row["worst"] < 1e-10 and row["loss"] < 1e-10 and row["val_loss"] < 1e-10 and row["unsharded"] < 1e-10, (
            row
        )
        assert row["built"] == "deferred", (
            row
        )  # never built whole: recorded on the meta device, each rank made only its part
        assert row["placeholders"] == 1, row  # between steps no rank holds a whole trained parameter
        n = row["data_parallel"]
        padding = sum(row["buckets"]) * (n - 1)  # at most n - 1 elements of padding a bucket
        assert all(
            whole / n <= kept <= whole / n + padding for kept, whole in zip(row["kept"], row["whole"], strict=True)
        ), row
        if row["fields"].get("bucket_mb", 25) < 1:
            assert all(buckets > 2 for buckets in row["buckets"][:-1]), row  # each block cut into buckets of 2 KB
        assert row["prefetched"] > 0, row  # the next block's gather started ahead of its use
        assert not row["pooler_moved"], row
        assert row["recomputed"] == RECOMPUTED.get((row["model"], row["fields"].get("activation_checkpointing")), 0), (
            row
        )
        if "grad_clip" in row["fields"]:
            assert row["grad_norm"] is not None and row["grad_norm"] < 1e-10, row
    assert rows[0]["units"] == [
        "h.0",
        "h.1",
        "",
    ]  # GPT-2's blocks; its embeddings, final norm and tied head are the root
    if ranks == 2:
        assert rows[1]["units"] == ["embed_tokens", "layers.0", "layers.1", ""] and rows[2]["units"] == [
            "encoder",
            "pooler",
            "classifier",
        ]


@pytest.mark.mpi
def test_a_zero3_checkpoint_resumes_under_zero3_zero2_and_in_one_process_and_zero2_under_zero3(
    run_mpi, tmp_path: Path
) -> None:
    rows, stderr = _run(run_mpi, 2, f"resumed({str(tmp_path)!r})")
    assert stderr.count("OK resumed") == 2
    assert [row["target"] for row in rows] == ["zero3", "zero2", "one", "zero2-to-zero3"]
    for row in rows:
        assert row["step"] == 2 and row["worst"] < 1e-10, row
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == [
        "checkpoint.pt",
        "part-s0-t0-d0-step2.pt",
        "part-s0-t0-d1-step2.pt",
    ]


def test_weights_tied_across_pipeline_stages_are_refused_before_anything_starts() -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from hf_models import gpt2, lm_loss

    from rapydli.parallel.preflight import check_layout
    from rapydli.trainer.config import TrainConfig

    config = TrainConfig(zero=3, pipeline_stages=2, pipeline_split="h.1", workers=4)
    with pytest.raises(
        ConfigError,
        match=r"transformer.wte.weight \(also lm_head.weight\) is shared by pipeline stages 0, 1 .* zero=3 cannot",
    ):
        check_layout(gpt2, config, loss_fn=lm_loss)
    check_layout(gpt2, config.replace(zero=1), loss_fn=lm_loss)
    with pytest.raises(ConfigError, match=r"TrainConfig.zero=4 is invalid: must be an integer in \[0, 3\]"):
        TrainConfig(zero=4)


def test_offload_optimizer_needs_zero_and_is_a_no_op_on_cpu_ranks() -> None:
    import sys

    import torch
    from mpi4py import MPI

    sys.path.insert(0, str(TESTS))
    from recompute_models import dropout_net, features

    from rapydli.trainer import TrainConfig, Trainer

    with pytest.raises(ConfigError, match=r"TrainConfig.offload_optimizer=True needs zero=1, 2 or 3 .* got zero=0"):
        TrainConfig(offload_optimizer=True)
    train, val = features()
    states = []
    for offload in (False, True):
        config = TrainConfig(batch_size=8, max_steps=2, seed=0, zero=1, offload_optimizer=offload, workers=1)
        trainer = Trainer(dropout_net(), None, train, val, config, comm=MPI.COMM_SELF)
        trainer.fit()
        trainer.close()
        states.append(trainer.model.state_dict())
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("shape", ["dropout_net", "gpt2", "llama"])
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_an_offloaded_optimizer_steps_host_copies_and_trains_and_resumes_as_the_one_in_place(
    zero: int, shape: str, monkeypatch, tmp_path
) -> None:
    """The host-copy path of offload_optimizer (what a GPU rank runs), taken here by calling this CPU's slices device memory.

    On a net with dropout, HF GPT-2's shapes (Conv1D, fused QKV, the embedding tied to the head) and Llama's (GQA, SwiGLU).
    """
    import functools
    import sys

    import torch
    from mpi4py import MPI

    sys.path.insert(0, str(TESTS))
    from hf_models import gpt2, llama, lm_loss
    from recompute_models import dropout_net, features

    from rapydli.parallel import zero as zero_module
    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.zoo import datasets

    build, loss_fn = {"dropout_net": (dropout_net, None), "gpt2": (gpt2, lm_loss), "llama": (llama, lm_loss)}[shape]
    data = (
        features
        if shape == "dropout_net"
        else functools.partial(datasets.synthetic_tokens, num_samples=40, block_size=8, vocab_size=32)
    )
    train, val = data()

    def two_groups(
        model: torch.nn.Module,
    ) -> torch.optim.Optimizer:  # decay on matrices only, another rate for the rest
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": matrices, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2
        )

    def run(offload: bool, steps: int, directory: str | None = None, resume: bool = False) -> Trainer:
        config = TrainConfig(
            batch_size=8,
            max_steps=steps,
            seed=0,
            zero=zero,
            offload_optimizer=offload,
            workers=1,
            eval_every=0,
            checkpoint_dir=directory,
            checkpoint_every=2 if directory else 0,
            resume=resume,
        )
        model = build()
        trainer = Trainer(model, two_groups(model), train, val, config, comm=MPI.COMM_SELF, loss_fn=loss_fn)
        trainer.fit()
        trainer.close()
        return trainer

    in_place = run(False, 4)
    monkeypatch.setattr(zero_module, "_in_device_memory", lambda piece: True)
    offloaded = run(True, 4)
    sharded = offloaded.optimizer
    assert sharded.host_copies and all(host.data_ptr() != piece.data_ptr() for piece, host in sharded.host_copies)
    assert {id(p) for group in sharded.optimizer.param_groups for p in group["params"]} == {
        id(host) for _, host in sharded.host_copies
    }
    assert set(map(id, sharded.optimizer.state)) <= {
        id(host) for _, host in sharded.host_copies
    }  # the state is the host copies'
    whole = [offloaded.full_state_dict(), in_place.full_state_dict()]
    assert all(torch.equal(whole[0][k], whole[1][k]) for k in whole[1]), "offloaded training differs"
    run(True, 2, str(tmp_path))  # checkpointed at step 2, resumed to step 4: the state comes back to the host copies
    resumed = run(True, 4, str(tmp_path), resume=True).full_state_dict()
    assert all(torch.equal(resumed[k], whole[1][k]) for k in whole[1]), "the offloaded run resumed differs"


@pytest.mark.mpi
def test_a_block_only_some_ranks_use_trains_one_only_some_call_is_refused_and_batch_norm_trains_as_data_parallel(
    run_mpi,
) -> None:
    """One launch of 2 ranks: the rules of blocks some ranks skip, and a ResNet-style model with BatchNorm (zero=3, checkpointing on and off)."""
    rows, stderr = _run(run_mpi, 2, "diverging(); cases_zero3.batchnorm()")
    assert stderr.count("OK diverging") == 2 and stderr.count("OK batchnorm") == 2
    assert set(rows[0]) == {"zero3 None", "zero3 blocks"}
    for name, row in rows[0].items():  # parameters, running statistics and the validation loss they give: as zero=0
        assert row["worst"] < 1e-10 and row["val_loss"] < 1e-10 and row["buffers"] and row["tracked"] == 3, (name, row)


def _mlp() -> object:
    import sys

    sys.path.insert(0, str(TESTS))
    from cases_zero_trainer import model

    return model(hidden=128, depth=31)


def _mlp_data() -> object:
    import sys

    sys.path.insert(0, str(TESTS))
    from cases_zero_trainer import data

    return data()


@pytest.mark.mpi
def test_a_model_three_times_memory_per_rank_trains_on_four_ranks_with_zero3_and_zero2_is_refused_before_starting(
    run_mpi,
) -> None:
    import rapydli as rd
    from rapydli.cluster import current

    psi = sum(p.numel() for p in _mlp().parameters())  # type: ignore[attr-defined]
    limit = 16 * psi / 3  # fp32 AdamW: 16 bytes a parameter (parameters, gradients, two moments)
    config = rd.TrainConfig(batch_size=8, max_steps=2, zero=2, workers=4, memory_per_rank=limit)
    for zero in (2, 1, 0):
        with pytest.raises(ConfigError) as refused:
            rd.train(_mlp, _mlp_data, config.replace(zero=zero))
        assert current() is None  # refused before any process started
        message = str(refused.value)
        assert (
            f"memory_per_rank={limit / 2**20:.4g} MiB is too small for 4 ranks (data_parallel=4 x pipeline_stages=1 x tensor_parallel=1, zero={zero})"
            in message
        )
        assert (
            "What would fit: zero=3 on these 4 ranks" in message and "activation_checkpointing='blocks'" in message
        ), message
    with pytest.raises(ConfigError, match=r"What would fit: zero=3 on (5|6|7|8) ranks or more") as more:
        rd.train(
            _mlp, _mlp_data, config.replace(zero=3, memory_per_rank=0.85 * limit)
        )  # 16 psi / 4 and the blocks in flight: over
    assert "zero=3): a rank is predicted to hold" in str(more.value) and current() is None
    rows, stderr = _run(run_mpi, 4, "memory_limit()")
    assert stderr.count("OK limit") == 4
    row = rows[0]
    assert row["psi"] == psi and row["limit"] == pytest.approx(limit)
    assert all(0 < peak < limit for peak in row["peaks"]), (
        row
    )  # parameters + gradients + optimizer state, measured on every rank
    assert max(row["peaks"]) <= row["predicted"] < limit, row  # the prediction bounds what was measured


@pytest.mark.mpi
def test_gradients_wait_as_autograd_made_them_until_their_bucket_is_due_and_a_reduce_scatter_lets_go_of_its_input(
    run_mpi,
) -> None:
    _, stderr = _run(run_mpi, 2, "gradient_buffers()")
    assert stderr.count("OK buffers") == 2, stderr[-3000:]
