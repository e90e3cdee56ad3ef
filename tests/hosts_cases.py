"""Code the hosts tests run on the engines (importable, so engines unpickle it by reference)."""

from __future__ import annotations

import socket
from typing import Any


def allreduce_on_host(nbytes: int) -> tuple[str, float]:
    """Allreduce ``nbytes`` of ones over the task's ranks; (host, the first reduced value)."""
    import numpy as np

    from rapydli.cluster.engine import context

    comm = context().comm
    data = np.ones(nbytes // 4, dtype=np.float32)
    out = np.empty_like(data)
    comm.Allreduce(data, out)
    return socket.gethostname(), float(out[0])


def train_matches_one_process() -> dict[str, Any]:
    """Train on the task's ranks with ``auto`` and return how far it is from one process.

    The reference is one process stepping on the ranks' batches concatenated (the global
    batch), as in ``test_train_trainer``; ``auto`` is measured first, across the ranks.
    """
    import torch
    from torch import nn
    from torch.nn import functional as F

    from rapydli.cluster.engine import context
    from rapydli.comm import Communicator
    from rapydli.data.sampler import rank_indices
    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.zoo import datasets

    ctx = context()
    size = ctx.world_size
    train, val = datasets.synthetic_features(num_samples=80, in_features=16, num_classes=4)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    comm = Communicator(ctx.comm, algorithm="auto")
    table = comm.tune(max_bytes=1 << 16)
    config = TrainConfig(
        epochs=1, batch_size=8, lr=0.05, optimizer="sgd", momentum=0.9, allreduce="auto", bucket_mb=0.001
    )
    trainer = Trainer(model(), None, train, val, config, comm=comm)
    trainer.fit()
    steps = len(train) // size // 8
    reference = model()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        batches = []
        for r in range(size):
            index = rank_indices(len(train), r, size, seed=0, epoch=0)[step * 8 : (step + 1) * 8]
            batches.append((train.tensors[0][index], train.tensors[1][index]))
        optimizer.zero_grad()
        F.cross_entropy(reference(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        optimizer.step()
    difference = max((p - q).abs().max().item() for p, q in zip(trainer.model.parameters(), reference.parameters()))
    trainer.close()
    return {
        "host": socket.gethostname(),
        "difference": difference,
        "steps": trainer.total_steps,
        "table_hosts": table.key["hosts"],
        "measured": sorted(name for name, times in table.times.items() if any(t is not None for t in times)),
        "choices": sorted(set(table.choices)),
    }
