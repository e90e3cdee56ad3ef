"""Rank-side code of tests/test_conformance.py: one architecture of tests/library_models.py under several layouts.

Each cell runs :func:`rapydli.experiments.verify.compare_layout`, the engine half of
``rd.verify_layout``, which builds the model as ``rd.train``'s ranks do
(:func:`rapydli.trainer.task.build_model`), trains the layout, then trains one process on
the global batch and compares what this rank holds. Rank 0 prints one JSON line per cell:
the worst relative difference over every rank's parameters and buffers, the names trained
apart that were tied, and how the model was built.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from library_models import MODELS
from mpi4py import MPI

from rapydli.experiments.verify import compare_layout
from rapydli.trainer import TrainConfig

WORLD = MPI.COMM_WORLD


def main(name: str, cells_json: str) -> None:
    """Run ``name`` under each ``[cell name, config fields]`` of ``cells_json`` on every rank of the world."""
    torch.set_num_threads(1)
    architecture = MODELS[name]
    for cell, fields in json.loads(cells_json):
        began = time.perf_counter()
        cfg = TrainConfig(
            **{
                "batch_size": 2,
                "max_steps": 2,
                "lr": 0.05,
                "seed": 0,
                "eval_every": 0,
                "workers": WORLD.Get_size(),
                **fields,
            }
        )
        found = compare_layout(
            architecture.model_fn,
            architecture.data,
            cfg,
            "float64",
            WORLD,
            torch.device("cpu"),
            loss_fn=architecture.loss,
        )
        merged: dict[str, tuple[float, float]] = {}
        for differences in WORLD.gather(found["differences"], root=0) or []:
            for parameter, (difference, value) in differences.items():
                old = merged.get(parameter, (0.0, 0.0))
                merged[parameter] = (max(old[0], difference), max(old[1], value))
        untied = WORLD.gather(found["untied"], root=0)
        built = WORLD.gather(found["built"], root=0)
        if WORLD.Get_rank() == 0:
            relative = {p: d / max(1.0, v) for p, (d, v) in merged.items()}
            worst = max(relative, key=relative.__getitem__) if relative else None
            print(
                json.dumps(
                    {
                        "model": name,
                        "cell": cell,
                        "compared": len(merged),
                        "worst": relative.get(worst, 0.0) if worst else 0.0,
                        "worst_name": worst,
                        "untied": sorted({n for names in untied or [] for n in names}),
                        "built": sorted(set(built or [])),
                        "seconds": round(time.perf_counter() - began, 2),
                    }
                ),
                flush=True,
            )
    print(f"OK matrix {name}", file=sys.stderr, flush=True)
