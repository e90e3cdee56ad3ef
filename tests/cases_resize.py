"""Rank-side code of tests/test_train_resize.py: a run checkpointed on W ranks resumed on W'.

Run on every rank by ``mpiexec``: ``python -c "import cases_resize; cases_resize.main(...)"``.
The training set logs every index it serves to ``<dir>/<phase>-rank<r>.txt`` so the test
can count the samples of the interrupted epoch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import Dataset

from rapydli.trainer import TrainConfig, Trainer
from rapydli.zoo import datasets


class Logged(Dataset):
    """A dataset that appends every index it serves to a file."""

    def __init__(self, base: Dataset, log: Path) -> None:
        self.base, self.log = base, log
        self.log.write_text("")

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> object:
        with self.log.open("a") as stream:
            stream.write(f"{index}\n")
        return self.base[index]


class Stop(Exception):
    """Raised by :class:`StopAfter` to end a run as a dead rank would."""


class StopAfter:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, metrics: dict) -> None:
        if metrics["step"] == self.step:
            raise Stop()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def main(directory: str, phase: str, stop: int | None, on_resize: str = "keep") -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    out = Path(directory)
    train, val = datasets.synthetic_features(num_samples=240, in_features=16, num_classes=4)
    train = torch.utils.data.Subset(train, range(192))
    config = TrainConfig(
        epochs=1,
        batch_size=8,
        lr=0.05,
        optimizer="sgd",
        momentum=0.9,
        checkpoint_every=6,
        eval_every=0,
        allreduce="mpi",
        checkpoint_dir=str(out / "ckpt"),
        resume=stop is None,
        on_resize=on_resize,
    )
    trainer = Trainer(
        model(),
        None,
        Logged(train, out / f"{phase}-rank{rank}.txt"),
        val,
        config,
        callbacks=[StopAfter(stop)] if stop else [],
    )
    result = {"rank": rank, "start_step": trainer.step, "grad_accum": trainer.config.grad_accum}
    try:
        history = trainer.fit()
    except Stop:
        history = trainer.history
    finally:
        trainer.close()
    result["losses"] = [r["loss"] for r in history if r["kind"] == "train"]
    result["lr"] = [r["lr"] for r in history if r["kind"] == "train"]
    result["params"] = [p.detach().double().flatten().tolist() for p in trainer.model.parameters()]
    if rank == 0:
        (out / f"{phase}.json").write_text(json.dumps(result))
    print("OK", rank, file=sys.stderr)
