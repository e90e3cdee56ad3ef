"""Rank-side code of ``test_parallel_deferred``: a model whose parameters alone exceed what a rank may hold trains under zero=3.

``bigger_than_a_rank(how)`` builds the model as ``rd.train`` builds it (``"deferred"``:
recorded on the meta device, each rank making only its shards) or whole (``"whole"``: what
every rank did before), trains 2 steps with zero=3 on this world, and prints on rank 0 one
JSON line: the model's parameter bytes and each rank's growth of peak resident memory
(``ru_maxrss``: the most the process ever held) from just before the model was built (after
a small warm-up run: the imports, thread pools and communicators a first run allocates) to
the end of training.
"""

from __future__ import annotations

import functools
import json
import resource
import sys

import psutil
import torch
from mpi4py import MPI

from rapydli.trainer import TrainConfig, Trainer
from rapydli.trainer.task import build_model
from rapydli.zoo import datasets, models

WORLD = MPI.COMM_WORLD
#: 32 hidden layers of 1024: 33.6 M parameters, 134 MB in float32
big_mlp = functools.partial(models.mlp, in_features=64, hidden=1024, depth=32)


def bigger_than_a_rank(how: str) -> None:
    torch.set_num_threads(1)
    train, _ = datasets.synthetic_features(num_samples=80, in_features=64, num_classes=10)
    config = TrainConfig(
        batch_size=8, max_steps=2, eval_every=0, zero=3, optimizer="sgd", momentum=0.0, workers=WORLD.Get_size(), seed=0
    )
    warm_up = Trainer(
        models.mlp(in_features=64, hidden=32, depth=2), None, train, None, config, comm=WORLD
    )  # imports, pools, buffers
    warm_up.fit()
    warm_up.close()
    del warm_up
    before = max(psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    torch.manual_seed(config.seed)
    model, built = build_model(big_mlp, config, WORLD.Get_size(), "cpu") if how == "deferred" else (big_mlp(), "whole")
    trainer = Trainer(model, None, train, None, config, comm=WORLD)
    trainer.fit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    state = WORLD.bcast(trainer.full_state_dict(), root=0)
    trainer.close()
    row = {
        "built": built,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "growth": WORLD.gather(peak - before, root=0),
        "checksum": float(sum(v.double().sum() for v in state.values())),
    }
    if WORLD.Get_rank() == 0:
        print(json.dumps(row), flush=True)
    print("OK deferred", WORLD.Get_rank(), file=sys.stderr)
