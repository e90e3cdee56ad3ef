"""Rank-side code of tests/test_parallel_zero3.py: ``TrainConfig(zero=3)`` on every rank equals one process.

float64 (``cases_layouts`` sets it), the models of the hybrid-parallelism tests: GPT-2-style
(``wte`` tied to ``lm_head``, fused QKV ``Conv1D``, the loss from ``labels``), Llama-style
(GQA, SwiGLU, untied head) and BERT-style (a pooler computed under ``no_grad``: never a
gradient), each with an ``optimizer_fn`` of two parameter groups. The one-process
reference trains on the global batch (``batch_size x replicas``) with ``comm=COMM_SELF``.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import cases_layouts  # noqa: F401 - float64 by default from here on
import torch
from cases_checkpoint_layouts import two_groups
from hf_models import gpt2, llama, lm_loss
from mpi4py import MPI
from torch import nn
from train_cases import PooledClassifier, sequences, tokens

from rapydli.parallel.recompute import _recomputed_forward
from rapydli.parallel.zero3 import FullyShardedOptimizer
from rapydli.trainer import TrainConfig, Trainer
from rapydli.trainer.task import build_model

WORLD = MPI.COMM_WORLD


def bert() -> nn.Module:
    torch.manual_seed(0)
    return PooledClassifier()


def lm_tokens() -> tuple[Any, Any]:
    from cases_layouts import tokens as layout_tokens

    return layout_tokens()


def bert_data() -> tuple[Any, Any]:
    train, _ = sequences()
    return train, None


#: name -> (model_fn, data_fn): every loss is the model's own, from ``labels``
MODELS: dict[str, tuple[Any, Any]] = {"gpt2": (gpt2, lm_tokens), "llama": (llama, lm_tokens), "bert": (bert, bert_data)}
BASE = {
    "batch_size": 4,
    "max_steps": 3,
    "lr": 0.01,
    "optimizer": "adamw",
    "eval_every": 2,
    "allreduce": "mpi",
    "seed": 0,
}

_ = tokens  # train_cases' tokens are TinyGPT's: the hf models read cases_layouts'


def whole_state(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trained model gathered on rank 0, broadcast to every rank."""
    return WORLD.bcast(trainer.full_state_dict(), root=0)


def worst(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """Largest difference over the tensors both hold (a gathered state names a tied tensor once, a module's state_dict twice).

    The gathered state is in the model's own orientation (a tensor-parallel Conv1D's weight ``(in, out)``, as the model stores it).
    """
    keys = state.keys() & reference.keys()
    assert keys and len(keys) == min(len(state), len(reference)), (sorted(state), sorted(reference))
    return max(float((state[key] - reference[key]).abs().max()) for key in keys)


def loss_of(fields: dict[str, Any]) -> Any:
    """A pipeline's last stage computes the loss from the logits (lm_loss); otherwise the model's own, from ``labels``."""
    return lm_loss if fields.get("pipeline_stages", 1) > 1 else None


def one_process(
    name: str, fields: dict[str, Any], replicas: int
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    model_fn, data_fn = MODELS[name]
    train, val = data_fn()
    fields = {**BASE, **fields}
    config = TrainConfig(
        **{
            **fields,
            "batch_size": fields["batch_size"] * replicas,
            "zero": 0,
            "workers": 1,
            "tensor_parallel": 1,
            "pipeline_stages": 1,
            "microbatches": 1,
            "pipeline_split": "auto",
        }
    )
    trainer = Trainer(
        model_fn(), None, train, val, config, comm=MPI.COMM_SELF, optimizer_fn=two_groups, loss_fn=loss_of(fields)
    )
    history = trainer.fit()
    trainer.close()
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, history


def equivalence(cases_json: str) -> None:
    """Each ``[model, TrainConfig fields]`` under zero=3 on this world equals one process; rank 0 prints one JSON line per case."""
    torch.set_num_threads(1)
    for name, fields in json.loads(cases_json):
        model_fn, data_fn = MODELS[name]
        train, val = data_fn()
        initial = model_fn().state_dict()
        config = TrainConfig(**{**BASE, **fields}, zero=3, workers=WORLD.Get_size())
        model, built = build_model(
            model_fn, config, WORLD.Get_size(), "cpu"
        )  # as rd.train builds it: recorded on the meta device
        trainer = Trainer(model, None, train, val, config, optimizer_fn=two_groups, loss_fn=loss_of(fields))
        optimizer = trainer.optimizer
        assert isinstance(optimizer, FullyShardedOptimizer)
        history = trainer.fit()
        # between steps this rank keeps 1/N of the trained parameters: every one of them is its placeholder
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        whole = sum(p.numel() for p in trained)
        placeholders = all(p.untyped_storage().nbytes() == p.element_size() and bool(p.isnan().all()) for p in trained)
        kept = sum(b.local.numel() for b in optimizer.buckets)  # type: ignore[attr-defined]
        state = whole_state(trainer)
        optimizer.unshard()  # every rank's module whole again (what rd.verify_layout compares)
        held = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        trainer.close()
        reference, expected = one_process(name, fields, trainer.data_size)
        losses = [WORLD.allreduce(r["loss"]) / WORLD.Get_size() for r in history if r["kind"] == "train"]
        ref_losses = [r["loss"] for r in expected if r["kind"] == "train"]
        vals = [r["val_loss"] for r in history if r["kind"] == "eval" and "val_loss" in r]
        ref_vals = [r["val_loss"] for r in expected if r["kind"] == "eval" and "val_loss" in r]
        row = {
            "model": name,
            "fields": fields,
            "built": built,
            "worst": worst(state, reference),
            "unsharded": WORLD.allreduce(worst(held, reference), op=MPI.MAX)
            if config.tensor_parallel == config.pipeline_stages == 1
            else 0.0,
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "val_loss": max((abs(a - b) for a, b in zip(vals, ref_vals, strict=True)), default=0.0),
            "evals": len(vals),
            "placeholders": WORLD.allreduce(int(placeholders), op=MPI.MIN),
            "kept": WORLD.allgather(kept),
            "whole": WORLD.allgather(whole),  # this rank's trained elements (its stage's, its tensor slices)
            "data_parallel": trainer.data_size,
            "units": [u.name for u in optimizer.units],
            "buckets": [len(u.buckets) for u in optimizer.units],
            "recomputed": sum(getattr(m.forward, "__func__", None) is _recomputed_forward for m in model.modules()),
            "prefetched": optimizer.prefetched,
            "grad_norm": max(
                (
                    abs(a["grad_norm"] - b["grad_norm"])
                    for a, b in zip(history, expected, strict=True)
                    if a["kind"] == "train" and a["grad_norm"] is not None
                ),
                default=None,
            ),
            "pooler_moved": bool(any(not torch.equal(state[k], initial[k]) for k in state if k.startswith("pooler"))),
        }
        if WORLD.Get_rank() == 0:
            print(json.dumps(row), flush=True)
    print("OK zero3", WORLD.Get_rank(), file=sys.stderr)


def resumed(directory: str) -> None:
    """A zero=3 checkpoint of step 2 (GPT-2-style, tied) resumes under zero=3, zero=2 and in one process as the uninterrupted run.

    And a zero=2 checkpoint of step 2 resumes under zero=3 (each rank cuts its pieces from
    the assembled parameters). Needs 2 ranks. Rank 0 prints one JSON line per target.
    """
    torch.set_num_threads(1)
    model_fn, data_fn = MODELS["gpt2"]
    train, val = data_fn()
    config = TrainConfig(**{**BASE, "max_steps": 4, "eval_every": 0}, zero=3, workers=2)
    root = Path(directory)
    whole = Trainer(model_fn(), None, train, val, config, optimizer_fn=two_groups)
    whole.fit()
    expected = whole_state(whole)
    whole.close()
    cut = Trainer(
        model_fn(),
        None,
        train,
        val,
        config.replace(max_steps=2, checkpoint_dir=str(root / "cut")),
        optimizer_fn=two_groups,
    )
    cut.fit()
    cut.close()
    if WORLD.Get_rank() == 0:
        for target in ("zero3", "zero2", "one"):
            shutil.copytree(root / "cut", root / target)
    WORLD.Barrier()
    for target, comm, fields in (
        ("zero3", WORLD, {}),
        ("zero2", WORLD, {"zero": 2}),
        ("one", MPI.COMM_SELF, {"zero": 0, "workers": 1, "batch_size": 2 * BASE["batch_size"]}),
    ):
        if comm is MPI.COMM_SELF and WORLD.Get_rank() != 0:
            continue
        again = Trainer(
            model_fn(),
            None,
            train,
            val,
            config.replace(checkpoint_dir=str(root / target), resume=True, **fields),
            comm=comm,
            optimizer_fn=two_groups,
        )
        step = again.step
        again.fit()
        state = again.full_state_dict() if comm is WORLD else again.model.state_dict()
        again.close()
        if WORLD.Get_rank() == 0:
            print(json.dumps({"target": target, "step": step, "worst": worst(state, expected)}), flush=True)
    zero2 = config.replace(zero=2, max_steps=2, checkpoint_dir=str(root / "from-zero2"))
    first = Trainer(model_fn(), None, train, val, zero2, optimizer_fn=two_groups)
    first.fit()
    first.close()
    again = Trainer(
        model_fn(),
        None,
        train,
        val,
        config.replace(checkpoint_dir=str(root / "from-zero2"), resume=True),
        optimizer_fn=two_groups,
    )
    step = again.step
    again.fit()
    state = again.full_state_dict()
    again.close()
    if WORLD.Get_rank() == 0:
        print(json.dumps({"target": "zero2-to-zero3", "step": step, "worst": worst(state, expected)}), flush=True)
    print("OK resumed", WORLD.Get_rank(), file=sys.stderr)


def recomputed() -> None:
    """zero=3 with activation checkpointing (dropout on) gives bit-equal parameters to zero=3 without it; rank 0 prints one JSON line."""
    from recompute_models import dropout_net, features

    torch.set_num_threads(1)
    train, val = features()
    states, calls = {}, {}
    for spec in (None, "blocks", "every_k:2"):
        config = TrainConfig(
            **{**BASE, "max_steps": 3}, zero=3, activation_checkpointing=spec, workers=WORLD.Get_size()
        )
        trainer = Trainer(dropout_net(), None, train, val, config)
        trainer.fit()
        states[spec] = whole_state(trainer)
        calls[spec] = [block.calls for block in trainer.model.blocks]  # type: ignore[union-attr]
        trainer.close()
    equal = {str(spec): all(torch.equal(states[spec][k], states[None][k]) for k in states[None]) for spec in states}
    if WORLD.Get_rank() == 0:
        print(json.dumps({"equal": equal, "calls": {str(k): v for k, v in calls.items()}}), flush=True)
    print("OK recomputed", WORLD.Get_rank(), file=sys.stderr)


class RankBranch(nn.Module):
    """Rank 0 alone calls ``branch`` (a block the size of ``head``), or with ``in_loss`` all call it and rank 0 alone adds it to the loss."""

    def __init__(self, in_loss: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.head, self.branch = nn.Linear(8, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.in_loss = in_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.trunk(x)
        if self.in_loss:
            extra = self.branch(out)
            return self.head(out) + (extra if WORLD.Get_rank() == 0 else 0.0)
        if WORLD.Get_rank() == 0:
            out = out + self.branch(out)
        return self.head(out)


def diverging() -> None:
    """A block every rank calls but only rank 0's loss uses trains as under zero=2 (DDP's rules); one only rank 0 calls is refused.

    The refusal comes on every rank in the first step, naming what each rank gathered.
    """
    from recompute_models import features

    from rapydli.errors import ConfigError

    train, val = features()
    config = TrainConfig(**{**BASE, "max_steps": 2, "eval_every": 0}, zero=3, workers=WORLD.Get_size())
    states = []
    for stage in (2, 3):  # the branch's gradient exists on rank 0 only: averaged with rank 1's zeros
        trainer = Trainer(RankBranch(in_loss=True), None, train, val, config.replace(zero=stage))
        trainer.fit()
        states.append(whole_state(trainer))
        trainer.close()
    assert worst(states[1], states[0]) < 1e-12 and not torch.equal(
        states[1]["branch.weight"], RankBranch().branch.weight
    ), states
    trainer = Trainer(RankBranch(), None, train, val, config)
    try:
        trainer.fit()
    except ConfigError as exc:
        assert "zero=3: the ranks gathered different blocks at the same point (rank 0: branch, rank 1: head)" in str(
            exc
        ), exc
        assert "train this model with zero=2" in str(exc), exc
    else:
        raise AssertionError("ranks calling different blocks trained under zero=3")
    print("OK diverging", WORLD.Get_rank(), file=sys.stderr)


def memory_limit() -> None:
    """A 32-layer MLP whose fp32 AdamW training state (16 bytes a parameter) is 3x ``memory_per_rank`` trains under zero=3 on 4 ranks.

    The front door's prediction (:func:`rapydli.experiments.planning.fit.check_fits`) lets it
    through; each rank's measured peak of parameters, gradients and optimizer state (its
    slices, the whole blocks it gathered at once, the gradient buckets in flight) stays under
    the limit. Rank 0 prints one JSON line.
    """
    from cases_zero_trainer import data, model

    from rapydli.experiments.planning.fit import check_fits
    from rapydli.parallel.memory import training_bytes

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)  # the 16-bytes-a-parameter of the ZeRO paper is fp32's

    def build() -> nn.Module:
        return model(hidden=128, depth=31)

    psi = sum(p.numel() for p in build().parameters())
    limit = 16 * psi / 3
    train, val = data()
    config = TrainConfig(
        batch_size=8,
        max_steps=2,
        lr=0.01,
        optimizer="adamw",
        allreduce="mpi",
        eval_every=0,
        zero=3,
        memory_per_rank=limit,
        workers=WORLD.Get_size(),
    )
    predicted = check_fits(build, config, WORLD.Get_size())
    assert predicted is not None
    trainer = Trainer(build(), None, train, val, config)
    trainer.fit()
    measured = training_bytes(trainer.model, trainer.optimizer, trainer.sync)
    trainer.close()
    peaks = WORLD.gather(sum(measured.values()), root=0)
    if WORLD.Get_rank() == 0:
        print(
            json.dumps({"psi": psi, "limit": limit, "peaks": peaks, "predicted": predicted.peak, "measured": measured}),
            flush=True,
        )
    print("OK limit", WORLD.Get_rank(), file=sys.stderr)


def batchnorm() -> None:
    """A ResNet-style model with BatchNorm in every block under zero=3, with and without checkpointing, equals zero=0 on this world.

    BatchNorm normalises each rank's batch (as DDP does: not one process's global batch), so
    the reference is data parallelism without ZeRO on the same ranks; the running statistics
    (buffers, kept whole on every rank) and the validation loss they give must agree too.
    Rank 0 prints one JSON line.
    """
    from recompute_models import images, resnet

    torch.set_num_threads(1)
    train, val = images()
    runs = {}
    for zero, spec in ((0, None), (3, None), (3, "blocks")):
        config = TrainConfig(
            **{**BASE, "max_steps": 3, "eval_every": 3, "batch_size": 8},
            zero=zero,
            activation_checkpointing=spec,
            workers=WORLD.Get_size(),
        )
        trainer = Trainer(resnet(), None, train, val, config)
        history = trainer.fit()
        runs[f"zero{zero} {spec}"] = (whole_state(trainer), [r["val_loss"] for r in history if r["kind"] == "eval"])
        trainer.close()
    reference, ref_losses = runs.pop("zero0 None")
    row = {
        name: {
            "worst": worst(state, reference),
            "val_loss": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
            "buffers": sorted(k for k in state if "running" in k) == sorted(k for k in reference if "running" in k),
            "tracked": int(state["blocks.0.bn1.num_batches_tracked"]),
        }
        for name, (state, losses) in runs.items()
    }
    if WORLD.Get_rank() == 0:
        print(json.dumps(row), flush=True)
    print("OK batchnorm", WORLD.Get_rank(), file=sys.stderr)


def gradient_buffers() -> None:
    """Where a GPT-2's gradients wait under zero=3 before they are reduce-scattered (an ``AssertionError`` names what did not hold).

    The root unit's buckets are the tied embedding alone and the rest (position embedding,
    final norm). The final norm's gradients come at the start of backward and wait as autograd
    made them, so neither root bucket is whole while the blocks run backward; the embedding's
    gradient, which comes last, is reduce-scattered as autograd made it (its bucket is never
    filled); and every reduce-scatter lets go of its input as soon as it has run, before
    :meth:`~rapydli.parallel.zero.ShardedOptimizer.wait`.
    """
    import time
    import weakref

    from hf_models import GPT2LMHeadModel

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        vocab=64, positions=32
    )  # the position embedding more than 8x the final norm, as in GPT-2 (1024 x 768 : 2 x 768)
    optimizer = FullyShardedOptimizer(model, lambda ps: torch.optim.AdamW(ps, lr=0.01), WORLD)
    wte = model.transformer.wte.weight
    root = optimizer.units[-1]
    alone, rest = root.buckets
    assert [p is wte for p in alone.params] == [True] and all(p is not wte for p in rest.params), [
        p.shape for p in rest.params
    ]
    assert [p.shape for p in rest.params] == [model.transformer.wpe.weight.shape, (16,), (16,)], [
        p.shape for p in rest.params
    ]
    filled: list[Any] = []
    fill = optimizer._fill
    optimizer._fill = lambda bucket: (filled.append(bucket), fill(bucket))[1]  # type: ignore[method-assign]
    inputs: list[Any] = []
    scatter = optimizer._communicator.ireduce_scatter_
    optimizer._communicator.ireduce_scatter_ = lambda tensor, out, op: (
        inputs.append(weakref.ref(tensor)),
        scatter(tensor, out, op),
    )[1]
    seen: list[tuple[bool, int, bool]] = []
    model.transformer.h[0].register_full_backward_pre_hook(
        lambda module, grad: seen.append((rest.grads is None, len(rest.held), alone.grads is None))
    )
    ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(WORLD.Get_rank()))
    model(ids, labels=ids).loss.backward()
    assert seen == [(True, 2, True)], (
        seen
    )  # the last block's backward: the final norm's weight and bias held, no root bucket made
    assert rest in filled and alone not in filled, (len(filled), [len(b.params) for b in filled])
    assert len(inputs) == len(optimizer.buckets), (len(inputs), len(optimizer.buckets))
    deadline = time.monotonic() + 60
    while (
        any(ref() is not None for ref in inputs) and time.monotonic() < deadline
    ):  # the communication thread lets go as each runs
        time.sleep(0.01)
    assert all(ref() is None for ref in inputs), [ref() is not None for ref in inputs]
    optimizer.step()
    optimizer.zero_grad()
    optimizer.close()
    print("OK buffers", WORLD.Get_rank(), file=sys.stderr)
