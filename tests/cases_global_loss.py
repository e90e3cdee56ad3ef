"""Rank-side code of tests/test_train_outputs.py's layout test: the recorded loss is the global batch's.

The same float64 MLP and the same global batch of 32 trained as dp4 x 8, pp2 x dp2 x 16 and
tp2 x dp2 x 16 on 4 real ranks, and in one process (``comm=COMM_SELF``) with 32, with the
default loss: every rank of every layout must record, at every step, the loss one process
records (the global batch's mean, in float64), and the same validation loss; each rank's
own loss is ``rank_loss``.
"""

from __future__ import annotations

import json
import sys

import torch
from mpi4py import MPI
from torch.utils.data import TensorDataset

from rapydli.trainer import TrainConfig, Trainer
from rapydli.zoo import datasets, models

torch.set_default_dtype(torch.float64)
WORLD = MPI.COMM_WORLD
LAYOUTS = {
    "dp4 x 8": {"batch_size": 8},
    "pp2 x dp2 x 16": {"batch_size": 16, "pipeline_stages": 2, "microbatches": 2, "pipeline_split": "3"},
    "tp2 x dp2 x 16": {"batch_size": 16, "tensor_parallel": 2},
}
BASE = {"max_steps": 5, "lr": 0.2, "optimizer": "sgd", "eval_every": 5, "allreduce": "mpi", "seed": 0}


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.mlp(in_features=16, hidden=32, num_classes=4, depth=2)


def features() -> tuple[TensorDataset, TensorDataset]:
    train, val = datasets.synthetic_features(num_samples=320, in_features=16, num_classes=4)
    return (
        TensorDataset(train.tensors[0].double(), train.tensors[1]),
        TensorDataset(val.tensors[0].double(), val.tensors[1]),
    )


def curve(history: list[dict]) -> dict[str, list[float]]:
    return {
        "loss": [r["loss"] for r in history if r["kind"] == "train"],
        "rank_loss": [r["rank_loss"] for r in history if r["kind"] == "train"],
        "val_loss": [r["val_loss"] for r in history if r["kind"] == "eval"],
    }


def main() -> None:
    torch.set_num_threads(1)
    train, val = features()
    reference = Trainer(mlp(), None, train, val, TrainConfig(**BASE, batch_size=32, workers=1), comm=MPI.COMM_SELF)
    result = {"one process": curve(reference.fit())}
    reference.close()
    for name, layout in LAYOUTS.items():
        trainer = Trainer(mlp(), None, train, val, TrainConfig(**{**BASE, **layout, "workers": WORLD.Get_size()}))
        result[name] = curve(trainer.fit())
        trainer.close()
    every = WORLD.gather(result)
    if WORLD.Get_rank() == 0:
        print(json.dumps(every), flush=True)
    print("OK global loss", WORLD.Get_rank(), file=sys.stderr)


if __name__ == "__main__":
    main()
