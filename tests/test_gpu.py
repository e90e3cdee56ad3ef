"""The GPU path: training, communication, layouts, autotuning and loading on a CUDA device.

Marked ``gpu`` and skipped, with the reason, on a machine without CUDA (every CI
machine); ``make gpu-check`` runs them on the GPU machine (one GPU, so two ranks share
it). ``RAPYDLI_GPU_TESTS_DEVICE=cpu`` runs the same tests on the CPU, where that means
something (not Triton), to rehearse them before a GPU is available.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

DEVICE = os.environ.get("RAPYDLI_GPU_TESTS_DEVICE", "cuda")
TESTS = Path(__file__).resolve().parent
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"
    ),
]
needs_triton = pytest.mark.skipif(DEVICE != "cuda", reason="the Triton kernels are compiled for a GPU only")


def _trainer(model: nn.Module, train, val, loss_fn=None, **config):
    from mpi4py import MPI

    from rapydli.trainer import TrainConfig, Trainer

    config = TrainConfig(**{"seed": 0, "eval_every": 0, **config})
    return Trainer(model.to(DEVICE), None, train, val, config, comm=MPI.COMM_SELF, loss_fn=loss_fn)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("loader", ["default", "clairvoyant"])
def test_trainer_steps_a_cnn_on_the_gpu(precision: str, loader: str) -> None:
    from rapydli.data.loaders import PinnedLoader
    from rapydli.zoo import datasets, models

    torch.manual_seed(0)
    train, val = datasets.digits()
    trainer = _trainer(
        models.resnet_digits(),
        train,
        val,
        batch_size=64,
        epochs=2,
        max_steps=30,
        lr=3e-3,
        optimizer="adamw",
        precision=precision,
        loader=loader,
    )
    assert trainer.device.type == DEVICE
    assert isinstance(trainer.loader, PinnedLoader) == (DEVICE == "cuda")  # batches come pinned, copied non-blocking
    history = trainer.fit()
    trainer.close()
    losses = [row["loss"] for row in history if row["kind"] == "train"]
    assert len(losses) == 30 and all(map(torch.isfinite, torch.tensor(losses)))
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5]), losses  # it learns, in bf16 too
    assert all(
        p.device.type == DEVICE and p.dtype == torch.float32 for p in trainer.model.parameters()
    )  # master weights stay float32
    assert trainer.evaluate()["val_accuracy"] > 0.5


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trainer_steps_a_small_transformer_on_the_gpu(precision: str) -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from hf_models import gpt2, lm_loss

    from rapydli.zoo import datasets

    train, val = datasets.synthetic_tokens(num_samples=512, block_size=8, vocab_size=32)
    model = gpt2()
    trainer = _trainer(
        model, train, val, lm_loss, batch_size=32, max_steps=40, lr=3e-3, optimizer="adamw", precision=precision
    )
    history = trainer.fit()
    trainer.close()
    losses = [row["loss"] for row in history if row["kind"] == "train"]
    assert all(map(torch.isfinite, torch.tensor(losses))) and sum(losses[-5:]) < 0.95 * sum(losses[:5]), losses
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after the steps on the device


def _mpi_json(run_mpi, code: str) -> dict:
    result = run_mpi(code, n=2, timeout=300)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


@pytest.mark.mpi
def test_every_algorithm_reduces_gpu_tensors_with_two_ranks_on_one_gpu(run_mpi) -> None:
    report = _mpi_json(
        run_mpi, f"import sys; sys.path.insert(0, {str(TESTS)!r}); import gpu_cases; gpu_cases.communicator({DEVICE!r})"
    )
    assert not report["failed"], "\n".join(f"{name}:\n{why}" for name, why in report["failed"].items())
    assert {f"allreduce {a}" for a in ("mpi", "ring", "shm", "gloo", "auto")} <= set(report["passed"])


@pytest.mark.mpi
def test_the_gradient_synchronizer_equals_ddp_on_the_gpu(run_mpi) -> None:
    report = _mpi_json(
        run_mpi, f"import sys; sys.path.insert(0, {str(TESTS)!r}); import gpu_cases; gpu_cases.synchronizer({DEVICE!r})"
    )
    assert not report["failed"], "\n".join(f"{name}:\n{why}" for name, why in report["failed"].items())
    assert len([n for n in report["passed"] if n.startswith("synchronizer")]) == 6


LAYOUTS = [
    [
        "gpt2",
        {"pipeline_stages": 2, "microbatches": 2, "pipeline_split": "h.1"},
    ],  # the tied embedding across two stages
    ["llama", {"tensor_parallel": 2}],  # fused-free Llama attention, GQA, SwiGLU split over two ranks
    ["gpt2", {"tensor_parallel": 2}],  # Conv1D, fused c_attn split by heads
    ["bn_cnn", {"pipeline_stages": 2, "microbatches": 1, "pipeline_split": "3"}],  # BatchNorm sees the whole batch
    ["mlp", {"zero": 1}],  # data parallel, optimizer state sharded
]


@pytest.mark.mpi
def test_pipeline_and_tensor_parallel_on_one_gpu_train_what_one_process_trains(run_mpi) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_layouts; cases_layouts.main({json.dumps(LAYOUTS)!r}, {DEVICE!r})"
    result = run_mpi(code, n=2, timeout=400)
    results = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(LAYOUTS), result.stdout + result.stderr
    for row in results:  # float64 on the GPU, as on the CPU
        assert row["worst"] < 1e-9 and row["loss"] < 1e-9 and row["val_loss"] < 1e-9, row
    assert results[0]["tied_checked"] > 0 and results[0]["shared"], results[0]


def test_tensor_parallel_reductions_take_bf16_activations(run_mpi) -> None:
    code = f"""
import torch
from mpi4py import MPI
from rapydli.parallel.tensor import TensorGroup
group = TensorGroup(MPI.COMM_WORLD)
x = torch.full((3, 5), 1.5, dtype=torch.bfloat16, device={DEVICE!r})
total = group.allreduce(x, "forward")
assert total.dtype == torch.bfloat16 and total.device == x.device and torch.all(total == 3.0), total
gathered = group.gather_last(x + group.rank)
assert gathered.shape == (3, 10) and gathered.dtype == torch.bfloat16 and torch.all(gathered[:, 5:] == 2.5)
print("OK bf16", flush=True)
"""
    assert run_mpi(code, n=2).stdout.count("OK bf16") == 2


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_an_offloaded_optimizer_keeps_its_state_in_host_memory_and_trains_as_the_one_on_the_gpu(zero: int) -> None:
    import sys

    sys.path.insert(0, str(TESTS))
    from recompute_models import dropout_net, features

    train, val = features()
    trained = []
    for offload in (False, True):
        trainer = _trainer(
            dropout_net(), train, val, batch_size=8, max_steps=4, zero=zero, offload_optimizer=offload, workers=1
        )
        trainer.fit()
        sharded = trainer.optimizer
        states = [
            value
            for state in sharded.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim()
        ]
        assert states and all(value.device.type == ("cpu" if offload else DEVICE) for value in states)
        if offload and DEVICE == "cuda":
            assert all(host.is_pinned() for _, host in sharded.host_copies)
        trained.append({k: v.cpu() for k, v in trainer.full_state_dict().items()})
        trainer.close()
    # the same AdamW steps, on the host instead of the GPU: equal to float tolerance (the kernels differ, not the math)
    assert all(torch.allclose(trained[0][k], trained[1][k], rtol=1e-5, atol=1e-6) for k in trained[0])


def test_the_clairvoyant_loader_yields_pinned_batches() -> None:
    from torch.utils.data import TensorDataset

    from rapydli.data.loaders import build_loader

    data = TensorDataset(torch.randn(40, 3, 4, 4), torch.arange(40))
    loader = build_loader(
        data, batch_size=8, rank=0, world_size=1, seed=0, epochs=1, kind="clairvoyant", pin_memory=True
    )
    seen = 0
    for x, y in loader:
        assert x.is_pinned() == y.is_pinned() == (DEVICE == "cuda")
        on_device = x.to(DEVICE, non_blocking=True)
        if DEVICE == "cuda":
            torch.cuda.current_stream().synchronize()
        assert torch.equal(on_device.cpu(), data.tensors[0][y])
        seen += len(y)
    assert seen == 40 and loader.stats()["epochs"][0]["batches"] == 5


BACKGROUND_LAYERS = ("alexnet.conv2", "alexnet.conv3", "overfeat.conv2", "overfeat.conv3")


@needs_triton
@pytest.mark.parametrize("layer", BACKGROUND_LAYERS)
def test_the_triton_candidate_is_tuned_against_cudnn_on_the_background_layers(layer: str) -> None:
    from rapydli.autotune.conv import tune_conv2d
    from rapydli.bench.conv import layer_shape

    shape = layer_shape(layer, 1.0)
    mode = (
        "train" if layer == BACKGROUND_LAYERS[0] else "inference"
    )  # every kernel on one layer, the forward on the rest
    result = tune_conv2d(
        shape,
        "cuda",
        mode,
        candidates=["torch_nchw", "torch_channels_last", "triton_igemm"],
        preset="small",
        cache=False,
        repetitions=3,
    )
    found = [(str(m.config), m.status, m.message) for m in result.measurements]
    statuses = {(m.config.candidate, m.status) for m in result.measurements}
    # validated against float64 and timed on the GPU ("slow": abandoned after one timed run, far behind the best)
    assert statuses & {("triton_igemm", "ok"), ("triton_igemm", "slow")} and ("torch_nchw", "ok") in statuses, found
    assert not any(m.status in ("invalid", "error") for m in result.measurements), found
    # float32 and TF32 tiles (torch lets cuDNN use TF32 by default), both validated against float64
    assert {m.config.param_dict["precision"] for m in result.measurements if m.config.candidate == "triton_igemm"} == {
        "ieee",
        "tf32",
    }
    assert all(m.median > 0 for m in result.measurements if m.status == "ok")


@needs_triton
def test_a_tuned_triton_convolution_runs_inside_a_model_and_trains() -> None:
    from rapydli.autotune.model import LayerChoice, Plan, TunedConv2d, apply_plan, conv_shape_of

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).to("cuda")
    x = torch.randn(8, 3, 16, 16, device="cuda")
    params = (("block_m", 64), ("block_n", 32), ("block_k", 32), ("num_stages", 2), ("num_warps", 4))
    layers = {
        name: LayerChoice(conv_shape_of(model.get_submodule(name), (8, c, 16, 16)), "triton_igemm", params, "nhwc", 1.0)
        for name, c in (("0", 3), ("2", 32))
    }
    reference = [p.detach().double().cpu() for p in model.parameters()]
    tuned = apply_plan(model, Plan(layers, "train", "test"))
    assert isinstance(tuned[0], TunedConv2d) and "cuda" in tuned[0].devices
    y = tuned(x)
    double = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(32, 10),
    ).double()
    with torch.no_grad():
        for p, r in zip(double.parameters(), reference, strict=True):
            p.copy_(r)
    want = double(x.double().cpu())
    assert (
        float((y.detach().double().cpu() - want.detach()).norm() / want.norm()) < 1e-4
    )  # IEEE float32 in the Triton kernels
    y.sum().backward()
    want.sum().backward()
    for got, ref in zip(tuned.parameters(), double.parameters(), strict=True):
        assert float((got.grad.double().cpu() - ref.grad).norm() / ref.grad.norm()) < 1e-3
    with (
        torch.no_grad(),
        torch.autocast("cuda", dtype=torch.bfloat16),
    ):  # the Triton layers stay float32, the head runs in bf16
        low = tuned(x)
    assert low.dtype == torch.bfloat16 and float((low.double().cpu() - want.detach()).norm() / want.norm()) < 2e-2


@needs_triton
def test_autotune_model_tunes_on_the_gpu_where_the_model_lives() -> None:
    from rapydli.autotune.model import autotune_model

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to("cuda")
    x = torch.randn(32, 3, 32, 32, device="cuda")
    tuned, report = autotune_model(model, x, "train", progress=False, preset="tiny", cache=False, repetitions=3)
    assert report.plan.fingerprint.startswith("cuda-"), report.plan.fingerprint  # measured on the GPU, not the CPU
    assert report.results and all(r.problem.device == "cuda" for r in report.results.values())
    with torch.no_grad():
        assert F.mse_loss(tuned(x), model(x)) < 1e-4
    tuned(x).sum().backward()
