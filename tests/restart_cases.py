"""Rank-side code of the restart tests (``tests/test_train_restarts.py``), importable so engines load it.

:class:`StallingModel` is a ``model_fn`` whose rank 1 stops in a chosen forward, once, so
the test can end it from outside right there (kill its host, cancel its Slurm job);
:class:`LoggedData` is a ``data_fn`` whose training set logs every index it serves, so the
test can count the samples of the interrupted epoch across the restart.
"""

from __future__ import annotations

import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from cases_resize import Logged
from torch import nn
from torch.utils.data import Subset, TensorDataset

SAMPLES = 192  # the training set: 12 steps of 2 ranks x 8


@dataclass(frozen=True)
class StallingModel:
    """Builds a small MLP; on rank 1 its ``at_call``-th forward writes ``marker`` (the host's name) and waits.

    With ``after_checkpoint``, rank 1 marks only once the checkpoint there is complete: it is
    written in the background and, on a loaded machine, may lag the steps by several.

    Once only: a restarted run finds the marker and goes on. The wait outlasts any test;
    the test ends it by killing the rank's host or job as soon as the marker appears.
    """

    marker: str
    at_call: int
    after_checkpoint: str | None = None

    def __call__(self) -> nn.Module:
        from rapydli.cluster.engine import context

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        calls = [0]
        marker, at_call, after_checkpoint = Path(self.marker), self.at_call, self.after_checkpoint

        def stall(module: nn.Module, args: object) -> None:
            calls[0] += 1
            if context().rank == 1 and calls[0] == at_call and not marker.exists():
                if after_checkpoint is not None:
                    from rapydli.trainer.checkpoint import checkpoint_path

                    while not checkpoint_path(after_checkpoint).exists():
                        time.sleep(0.05)
                marker.write_text(socket.gethostname())
                time.sleep(600)

        model.register_forward_pre_hook(stall)
        return model


@dataclass(frozen=True)
class LoggedData:
    """192 training samples (16 features, 4 classes) that log what they serve to ``<directory>/served-rank<r>-<attempt>.txt``.

    ``attempt`` counts the engine starts of that rank: 0 before a restart, 1 after.
    """

    directory: str

    def __call__(self) -> tuple[Logged, TensorDataset]:
        from rapydli.cluster.engine import context
        from rapydli.zoo import datasets

        train, val = datasets.synthetic_features(num_samples=240, in_features=16, num_classes=4)
        rank = context().rank
        attempt = len(list(Path(self.directory).glob(f"served-rank{rank}-*.txt")))
        return Logged(Subset(train, range(SAMPLES)), Path(self.directory) / f"served-rank{rank}-{attempt}.txt"), val


def served(directory: Path, attempt: int, first: int | None = None) -> Counter[int]:
    """How often each index was served in ``attempt`` over every rank (only each rank's ``first`` lines if given)."""
    counts: Counter[int] = Counter()
    for log in sorted(directory.glob(f"served-rank*-{attempt}.txt")):
        counts.update(int(line) for line in log.read_text().split()[:first])
    return counts
