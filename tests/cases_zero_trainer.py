"""Rank-side code of the Trainer part of tests/test_parallel_zero.py: TrainConfig(zero=1|2) on every rank."""

from __future__ import annotations

import sys

import torch
from mpi4py import MPI
from torch import nn

from rapydli.trainer import TrainConfig, Trainer
from rapydli.zoo import datasets


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 4))


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def main(directory: str) -> None:
    train, val = datasets.synthetic_features(num_samples=160, in_features=16, num_classes=4)
    base = dict(epochs=1, batch_size=8, lr=0.01, optimizer="adamw", weight_decay=0.1, eval_every=0, allreduce="mpi", max_steps=8)
    plain = Trainer(model(), None, train, val, TrainConfig(**base))
    plain.fit()
    reference = params(plain)
    plain.close()
    for stage in (1, 2):
        trainer = Trainer(model(), None, train, val, TrainConfig(**base, zero=stage))
        trainer.fit()
        trainer.close()
        worst = max(float((a - b).abs().max()) for a, b in zip(reference, params(trainer)))
        assert worst < 1e-5, (stage, worst)
        # checkpointed after 4 steps, resumed to the end: the same parameters
        where = f"{directory}/zero{stage}"
        cut = Trainer(model(), None, train, val, TrainConfig(**{**base, "max_steps": 4}, zero=stage, checkpoint_dir=where))
        cut.fit()
        cut.close()
        resumed = Trainer(model(), None, train, val, TrainConfig(**base, zero=stage, checkpoint_dir=where, resume=True))
        assert resumed.step == 4, resumed.step
        resumed.fit()
        resumed.close()
        worst = max(float((a - b).abs().max()) for a, b in zip(reference, params(resumed)))
        assert worst < 1e-5, ("resumed", stage, worst)
    print("OK zero trainer", MPI.COMM_WORLD.Get_rank(), file=sys.stderr)
