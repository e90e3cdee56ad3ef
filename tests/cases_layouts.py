"""Rank-side code of tests/test_parallel_layouts.py: the Trainer on a layout equals one process.

Every case trains through :class:`~rapydli.trainer.Trainer` and ``TrainConfig`` (data x
pipeline x tensor, ZeRO) in float64 (the loss too, but through a pipeline, whose last stage computes the
default float32 cross-entropy), and the same rank then trains the dense model in one
process (``comm=COMM_SELF``) on the global batch (``batch_size x replicas``): every
parameter this rank holds must equal its slice of the dense one, and the losses the two
report must agree.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from cases_tensor import _shard_of
from hf_models import GPT2LMHeadModel, LlamaForCausalLM, as_written, bert, gpt2, llama, lm_loss
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from rapydli.parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabShard
from rapydli.trainer import TrainConfig, Trainer
from rapydli.trainer.task import build_model
from rapydli.zoo import datasets, models

torch.set_default_dtype(torch.float64)
WORLD = MPI.COMM_WORLD


def exact_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in the logits' own precision (the default loss computes in float32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_lm() -> nn.Module:
    torch.manual_seed(0)
    return models.tiny_lm(vocab_size=32, block_size=8, dim=16, layers=2, heads=4)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return models.mlp(in_features=16, hidden=32, num_classes=4, depth=2)


def tokens() -> tuple[TensorDataset, TensorDataset]:
    return datasets.synthetic_tokens(num_samples=80, block_size=8, vocab_size=32)


def features() -> tuple[TensorDataset, TensorDataset]:
    train, val = datasets.synthetic_features(num_samples=80, in_features=16, num_classes=4)
    return (
        TensorDataset(train.tensors[0].double(), train.tensors[1]),
        TensorDataset(val.tensors[0].double(), val.tensors[1]),
    )


def bn_cnn() -> nn.Module:
    """A CNN with BatchNorm (its running statistics decide the validation loss)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 4)
    )


def gpt2_as_written() -> nn.Module:
    torch.manual_seed(0)
    return as_written(GPT2LMHeadModel)()


def llama_as_written() -> nn.Module:
    torch.manual_seed(0)
    return as_written(LlamaForCausalLM)()


def nanogpt() -> nn.Module:
    from train_cases import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab=32, n_layer=2)


def images() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(6)
    x, y = torch.randn(96, 1, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (96,), generator=g)
    return TensorDataset(x[:80], y[:80]), TensorDataset(x[80:], y[80:])


#: name -> (model_fn, data_fn, loss_fn or None for the default (exact_loss where not pipelined))
MODELS: dict[str, tuple[Any, Any, Any]] = {
    "tiny_lm": (tiny_lm, tokens, None),
    "mlp": (mlp, features, None),
    "gpt2": (
        gpt2,
        tokens,
        lm_loss,
    ),  # HF GPT-2's shapes: Conv1D, fused c_attn, wte tied to lm_head, forward(input_ids, labels)
    "llama": (llama, tokens, lm_loss),  # RMSNorm, rotary, GQA 4 query / 2 key-value heads, SwiGLU, untied head
    "bn_cnn": (bn_cnn, images, exact_loss),
    "bert": (
        bert,
        tokens,
        lm_loss,
    ),  # BERT's shapes: attention.self q/k/v + attention.output.dense, intermediate/output, unused pooler
    "tiny_lm_default_loss": (
        tiny_lm,
        tokens,
        "default",
    ),  # the trainer's own cross-entropy (float64 here), vocabulary-parallel when split
    # as their codebases write them, no pipeline_blocks(): pipelined by tracing forward, which computes the loss from the labels
    "gpt2_as_written": (gpt2_as_written, tokens, "own"),
    "llama_as_written": (llama_as_written, tokens, "own"),
    "nanogpt": (nanogpt, tokens, "own"),  # forward(idx, targets=None) -> (logits, loss), wte tied to lm_head
}
BASE = {"batch_size": 4, "max_steps": 3, "lr": 0.01, "optimizer": "adamw", "weight_decay": 0.1, "eval_every": 2,
        "allreduce": "mpi", "bucket_mb": 0.001, "seed": 0}  # fmt: skip


def dense_names(model: nn.Module, held: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of ``model`` (the whole, split model) that this rank trains (those of ``held``), by name."""
    mine = {id(p) for p in held.parameters()}
    return {name: p for name, p in model.named_parameters() if id(p) in mine}


def owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    return {
        f"{m}.{n}" if m else n: (module, n)
        for m, module in model.named_modules()
        for n, _ in module.named_parameters(recurse=False)
    }


def worst_difference(trainer: Trainer, model: nn.Module, reference: nn.Module) -> float:
    """Largest difference between this rank's parameters and their slices of the one-process model's."""
    dense = dict(reference.named_parameters(remove_duplicate=False))
    found, dense_owners = owners(model), owners(reference)
    worst = 0.0
    for name, local in dense_names(model, trainer.model).items():
        module, short = found[name]
        if isinstance(module, ColumnParallelLinear | RowParallelLinear | VocabParallelEmbedding):
            whole = dense[name].detach().cpu()
            if (
                type(dense_owners[name][0]).__name__ == "Conv1D" and short == "weight"
            ):  # stored (in, out); the split layer keeps (out, in)
                whole = whole.t()
            expected = _shard_of(whole, local, module, short, _Group(trainer.grid.tensor_rank))  # type: ignore[arg-type]
        else:
            expected = dense[name].detach()
        worst = max(worst, float((expected.cpu() - local.detach().cpu()).abs().max()))
    return worst


class _Group:
    """What ``_shard_of`` reads of a tensor group: this rank's index."""

    def __init__(self, rank: int) -> None:
        self.rank = rank


class TiedCopies:
    """A callback: after every step, every rank's copy of each tied parameter must be bit-equal to every other's (collective).

    The ties are read from the whole model as the layout split it (a vocabulary-split
    embedding and head share the new parameter); copies are compared between the ranks
    of the same tensor rank (each keeps its rows).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.tied: dict[int, list[str]] | None = None
        self.params: dict[int, nn.Parameter] = {}
        self.held: set[int] = set()
        self.tensor_rank = 0
        self.checked = 0

    def on_step_end(self, row: dict[str, Any]) -> None:
        if self.tied is None:
            seen: dict[int, list[str]] = {}
            for n, p in self.model.named_parameters(remove_duplicate=False):
                seen.setdefault(id(p), []).append(n)
            self.tied = {pid: names for pid, names in seen.items() if len(names) > 1}
            self.params = {id(p): p for p in self.model.parameters()}
        tied = self.tied
        for pid in sorted(tied, key=lambda i: tied[i][0]):
            mine = (self.tensor_rank, self.params[pid].detach().cpu().clone()) if pid in self.held else None
            copies = [c for c in WORLD.allgather(mine) if c is not None]
            assert len(copies) >= 1, (tied[pid], row["step"])
            for rank, copy in copies:
                first = next(c for r, c in copies if r == rank)
                assert torch.equal(first, copy), (tied[pid], row["step"], rank)
            self.checked += len(copies)


def run(name: str, layout: dict[str, Any], directory: str | None = None, device: str = "cpu") -> dict[str, Any]:
    """Train ``name`` on ``layout`` (TrainConfig fields) and in one process, both on ``device``; return the differences."""
    model_fn, data_fn, own_loss = MODELS[name]
    model_fn = _on(model_fn, device)
    train, val = data_fn()
    # a pipeline's last stage computes the default loss
    loss = (
        None
        if own_loss in ("default", "own")
        else own_loss or (exact_loss if layout.get("pipeline_stages", 1) == 1 else None)
    )
    config = TrainConfig(**{**BASE, **layout, "workers": WORLD.Get_size()})
    model, built = build_model(
        model_fn, config, WORLD.Get_size(), device
    )  # as rd.train builds it: never whole where the layout splits it
    tied = TiedCopies(model)
    vocab_losses = [0]
    scored = VocabShard.cross_entropy

    def counted(
        self: VocabShard, targets: torch.Tensor
    ) -> torch.Tensor:  # the default loss took the vocabulary-parallel path
        vocab_losses[0] += 1
        return scored(self, targets)

    VocabShard.cross_entropy = counted  # type: ignore[method-assign]
    trainer = Trainer(model, None, train, val, config, loss_fn=loss)
    tied.held, tied.tensor_rank = (
        {id(p) for p in trainer.model.parameters()},
        trainer.grid.tensor_rank if trainer.grid is not None else 0,
    )
    trainer.callbacks += (tied,)
    try:
        history = trainer.fit()
    finally:
        VocabShard.cross_entropy = scored  # type: ignore[method-assign]
    trainer.close()
    replicas = trainer.data_size
    single = config.replace(
        batch_size=config.batch_size * replicas,
        pipeline_stages=1,
        tensor_parallel=1,
        zero=0,
        microbatches=1,
        workers=1,
        pipeline_split="auto",
    )
    reference = Trainer(model_fn(), None, train, val, single, comm=MPI.COMM_SELF, loss_fn=loss)
    expected = reference.fit()
    reference.close()
    worst = worst_difference(trainer, model, reference.model)
    losses = [
        WORLD.allreduce(r["loss"]) / WORLD.Get_size() for r in history if r["kind"] == "train"
    ]  # each replica logs its own batch's
    ref_losses = [r["loss"] for r in expected if r["kind"] == "train"]
    vals = [r["val_loss"] for r in history if r["kind"] == "eval"]
    ref_vals = [r["val_loss"] for r in expected if r["kind"] == "eval"]
    norms = [r["grad_norm"] for r in history if r["kind"] == "train" and r["grad_norm"] is not None]
    ref_norms = [r["grad_norm"] for r in expected if r["kind"] == "train" and r["grad_norm"] is not None]
    return {
        "case": f"{name} {layout}",
        "built": built,
        "worst": WORLD.allreduce(worst, op=MPI.MAX),
        "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "val_loss": max(abs(a - b) for a, b in zip(vals, ref_vals, strict=True)),
        "evals": len(vals),
        "tied_checked": WORLD.allreduce(tied.checked),  # copies of tied parameters compared after the steps
        "vocab_losses": WORLD.allreduce(vocab_losses[0]),  # losses computed from the ranks' vocabulary rows
        "shared": [item.describe()["names"] for item in trainer.pipeline.shared]
        if trainer.pipeline is not None
        else [],
        "split": sorted(
            {
                type(m).__name__
                for m in model.modules()
                if type(m).__name__.endswith(("ParallelLinear", "Embedding", "Head"))
            }
        ),
        # with grad_clip: steps the one-process norm was clipped in, and how far every rank's norm is from it
        "clipped": sum(n > config.grad_clip for n in ref_norms) if config.grad_clip else 0,
        "grad_norm": WORLD.allreduce(
            max((abs(a - b) for a, b in zip(norms, ref_norms, strict=True)), default=0.0), op=MPI.MAX
        ),
    }


def _on(model_fn: Any, device: str) -> Any:
    """``model_fn`` building its model on ``device`` (the GPU tests share one GPU between the ranks)."""
    return model_fn if device == "cpu" else lambda: model_fn().to(device)


def main(cases_json: str, device: str = "cpu") -> None:
    """Run each ``[model, layout]`` of the JSON list on ``device``; rank 0 prints one JSON line per case."""
    torch.set_num_threads(1)
    for name, layout in json.loads(cases_json):
        result = run(name, layout, device=device)
        if WORLD.Get_rank() == 0:
            print(json.dumps(result), flush=True)
    print("OK layouts", WORLD.Get_rank(), file=sys.stderr)
