"""The per-rank half of ``rapydli bench model`` (run under ``mpiexec`` by :mod:`rapydli.bench.model`).

One launch trains the bench model (:data:`rapydli.bench.zero3_worker.SIZES`) for one
step in one layout (``--zero 0``: plain data parallelism; ``--zero 3``: fully sharded
parameters), then measures, ``--rounds`` times with the order alternating between
rounds, what a run's end costs for each way of keeping its model:

* ``gather`` (what every run did before the model was kept lazily): the whole model
  assembled on rank 0 (:meth:`~rapydli.trainer.loop.Trainer.full_state_dict`), the state
  ``rd.train`` then shipped to the notebook;
* ``write`` (what ``rd.train`` does now): every rank writes its own pieces to a
  directory (:meth:`~rapydli.trainer.loop.Trainer.save_model`); nothing is gathered;
* ``none`` (a sweep trial, a scaling point): nothing.

For each it records the time on the slowest rank (every rank waits for the collective
end), and the bytes of model tensors each rank handles for it (``gather``: rank 0
receives and assembles the whole model, new memory; ``write``: the pieces each rank
writes, its own tensors on a CPU rank, a host copy of them from a GPU); tensor bytes,
not the process's resident memory. ``assemble_s`` is what
``result.model()`` then costs when asked: the notebook reading and assembling the
written pieces (:func:`rapydli.trainer.checkpoint.read_state_dict`), timed on rank 0.
Rank 0 writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from rapydli.bench.zero3_worker import SIZES

VARIANTS = ("gather", "write", "none")


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure(size_name: str, zero: int, rounds: int) -> list[dict[str, Any]]:
    """Every variant once a round on this rank; rank 0 returns the rows (others an empty list)."""
    import torch
    from mpi4py import MPI

    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.trainer.checkpoint import read_state_dict

    world = MPI.COMM_WORLD
    size = SIZES[size_name]
    torch.set_num_threads(1)
    config = TrainConfig(
        batch_size=max(1, size.global_batch // world.Get_size()),
        max_steps=1,
        epochs=1,
        eval_every=0,
        zero=zero,
        optimizer="adamw",
        lr=3e-4,
        allreduce="mpi",
        seed=0,
    )
    trainer = Trainer(size.model(), None, size.data(1), None, config, comm=world)
    trainer.fit()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-model-") as tmp:
        shared = world.bcast(
            tmp if world.Get_rank() == 0 else None, root=0
        )  # one directory, as a run's model directory is
        for round_ in range(rounds):
            for variant in VARIANTS[:: 1 if round_ % 2 == 0 else -1]:
                directory = Path(shared) / f"r{round_}-{variant}"
                world.Barrier()
                began = time.perf_counter()
                held = 0
                if variant == "gather":
                    state = trainer.full_state_dict()
                    held = _bytes(state.values()) if state is not None else 0
                    del state
                elif variant == "write":
                    held = _bytes(
                        e.value
                        for e in trainer.checkpoints._model_entries(trainer.model, trainer.optimizer)
                        if isinstance(e.value, torch.Tensor)
                    )
                    trainer.save_model(directory)
                world.Barrier()
                seconds = world.allreduce(time.perf_counter() - began, op=MPI.MAX)
                assemble_s = None
                if variant == "write" and world.Get_rank() == 0:
                    began = time.perf_counter()
                    read_state_dict(directory)
                    assemble_s = time.perf_counter() - began
                    shutil.rmtree(directory, ignore_errors=True)
                per_rank = world.gather(held, root=0)
                if world.Get_rank() == 0:
                    rows.append(
                        {
                            "round": round_,
                            "variant": variant,
                            "zero": zero,
                            "ranks": world.Get_size(),
                            "seconds": seconds,
                            "held_bytes": per_rank,
                            "assemble_s": assemble_s,
                            "parameters": size.parameters,
                        }
                    )
    trainer.close()
    return rows


def main() -> None:
    """``python -m rapydli.bench.model_worker --size S --zero Z --rounds R --out PATH`` under mpiexec."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--zero", type=int, choices=(0, 3), required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = measure(args.size, args.zero, args.rounds)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
