"""Rank-side code of tests/test_train_checkpoint.py's resume matrix: a checkpoint of any layout resumes under any other.

On 4 ranks, float64, the models of :mod:`cases_layouts` with an ``optimizer_fn`` of two
groups (AdamW: weights decayed at one rate, biases not decayed at another rate) on every
layout, and the same global batch of 8 on every layout (``batch_size`` = 8 / replicas):
a run cut after step 2 under layout A and resumed under layout B to step 4 ends with the
parameters of a run of 4 steps under B. The parameters are compared whole
(:func:`rapydli.trainer.checkpoint.read_state_dict` of the end-of-run checkpoints).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from rapydli.trainer import TrainConfig, Trainer
from rapydli.trainer.checkpoint import read_state_dict
from rapydli.zoo import datasets, models

WORLD = MPI.COMM_WORLD
GLOBAL_BATCH = 8

#: name -> (TrainConfig fields, data-parallel replicas on 4 ranks)
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "dp4": ({}, 4),
    "dp2xpp2": ({"pipeline_stages": 2, "pipeline_split": "3", "microbatches": 2}, 2),
    "dp2xtp2": ({"tensor_parallel": 2}, 2),
    "pp2xtp2": ({"pipeline_stages": 2, "tensor_parallel": 2, "pipeline_split": "3", "microbatches": 2}, 1),
    "dp4-zero1": ({"zero": 1}, 4),
    "dp2xtp2-zero2": ({"tensor_parallel": 2, "zero": 2}, 2),
    "dp4-zero3": ({"zero": 3}, 4),
    # GPT-2's built-in plan with its tied embedding and head split by vocabulary rows
    "dp2xtp2-vocab": ({"tensor_parallel": 2, "tensor_plan": "gpt2-vocab"}, 2),
    "pp2xtp2-vocab": (
        {
            "pipeline_stages": 2,
            "tensor_parallel": 2,
            "pipeline_split": "3",
            "microbatches": 2,
            "tensor_plan": "gpt2-vocab",
        },
        1,
    ),
}
BASE = {
    "lr": 0.01,
    "optimizer": "adamw",
    "eval_every": 0,
    "allreduce": "mpi",
    "bucket_mb": 0.0005,
    "seed": 0,
    "workers": 4,
}


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """Weights decayed at lr 0.01, biases not decayed at lr 0.02 (two parameter groups)."""
    weights = [p for p in model.parameters() if p.dim() > 1]
    biases = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 0.02}], lr=0.01
    )


#: where each model's pipeline splits
SPLITS = {"mlp": "3", "tiny_lm": "blocks.1", "gpt2": "h.1"}


def config(name: str, model: str, **fields: Any) -> TrainConfig:
    layout, replicas = LAYOUTS[name]
    if "pipeline_split" in layout:
        layout = {**layout, "pipeline_split": SPLITS[model]}
    if layout.get("tensor_plan") == "gpt2-vocab":
        from test_parallel_layouts import GPT2_VOCAB

        layout = {**layout, "tensor_plan": GPT2_VOCAB}
    return TrainConfig(**{**BASE, **layout, "batch_size": GLOBAL_BATCH // replicas, **fields})


def mlp() -> nn.Module:
    """The MLP of :mod:`cases_layouts` in the default dtype (what ``rd.train``'s engines build; cases_layouts sets float64)."""
    torch.manual_seed(0)
    return models.mlp(in_features=16, hidden=32, num_classes=4, depth=2)


def features() -> tuple[Any, Any]:
    return datasets.synthetic_features(num_samples=80, in_features=16, num_classes=4)


def train(name: str, model: str, **fields: Any) -> Trainer:
    from cases_layouts import MODELS  # float64 by default from here on (imported by the rank-side code only)

    model_fn, data_fn, loss_fn = MODELS[model]
    train_data, val = data_fn()
    trainer = Trainer(
        model_fn(), None, train_data, val, config(name, model, **fields), optimizer_fn=two_groups, loss_fn=loss_fn
    )
    trainer.fit()
    trainer.close()
    return trainer


def copy_checkpoint(source: Path, target: Path) -> None:
    if WORLD.Get_rank() == 0:
        shutil.copytree(source, target)
    WORLD.Barrier()


def main(directory: str, model: str, sources_json: str, targets_json: str) -> None:
    """For each source layout: cut at step 2, resume under each target layout to step 4, compare with its run of 4 steps.

    ``model``: ``"mlp"``, ``"tiny_lm"`` (attention split by heads: fused ``qkv`` slices) or
    ``"gpt2"`` (with the ``-vocab`` layouts: its tied embedding and head split by vocabulary rows).
    Rank 0 prints one JSON line per pair: ``{"from", "to", "step", "resumed", "worst"}``.
    """
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    root = Path(directory) / model
    targets = {}
    for name in json.loads(targets_json):  # the uninterrupted runs, once per layout
        train(name, model, max_steps=4, checkpoint_dir=str(root / f"whole-{name}"))
        targets[name] = read_state_dict(root / f"whole-{name}")[0]
    first = next(iter(targets.values()))
    for name, state in targets.items():  # every layout (ZeRO with the two groups too) trains the same parameters
        if WORLD.Get_rank() == 0:
            print(
                json.dumps({"whole": name, "worst": max(float((state[k] - v).abs().max()) for k, v in first.items())}),
                flush=True,
            )
    for source in json.loads(sources_json):
        cut = root / f"cut-{source}"
        train(source, model, max_steps=2, checkpoint_dir=str(cut))
        for target in targets:
            where = root / f"{source}-to-{target}"
            copy_checkpoint(cut, where)
            resumed = train(target, model, max_steps=4, checkpoint_dir=str(where), resume=True)
            state, step = read_state_dict(where)
            worst = max(float((state[k] - v).abs().max()) for k, v in targets[target].items())
            if WORLD.Get_rank() == 0:
                print(
                    json.dumps(
                        {
                            "from": source,
                            "to": target,
                            "step": step,
                            "resumed": resumed.history[0]["step"],
                            "worst": worst,
                        }
                    ),
                    flush=True,
                )
    print("OK matrix", WORLD.Get_rank(), file=sys.stderr)
