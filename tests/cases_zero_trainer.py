"""Rank-side code of the Trainer part of tests/test_parallel_zero.py: TrainConfig(zero=1|2) on every rank."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from mpi4py import MPI
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.memory import training_bytes
from rapydli.trainer import TrainConfig, Trainer
from rapydli.zoo import datasets

WORLD = MPI.COMM_WORLD


def model(hidden: int = 48, depth: int = 1) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(16, hidden), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(hidden, 4))


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def data() -> tuple:
    return datasets.synthetic_features(num_samples=160, in_features=16, num_classes=4)


BASE = dict(
    epochs=1, batch_size=8, lr=0.01, weight_decay=0.1, eval_every=0, allreduce="mpi", max_steps=8, bucket_mb=0.001
)


def main(directory: str) -> None:
    """zero=1 and zero=2 equal plain data parallel (AdamW and SGD-momentum), log their communication, resume exactly."""
    train, val = data()
    for optimizer in ("adamw", "sgd"):
        base = {**BASE, "optimizer": optimizer}
        plain = Trainer(model(), None, train, val, TrainConfig(**base))
        plain.fit()
        reference = params(plain)
        plain.close()
        for stage in (1, 2):
            trainer = Trainer(model(), None, train, val, TrainConfig(**base, zero=stage))
            history = trainer.fit()
            trainer.close()
            worst = max(float((a - b).abs().max()) for a, b in zip(reference, params(trainer)))
            assert worst < 1e-5, (optimizer, stage, worst)
            steps = [row for row in history if row["kind"] == "train"]
            assert all(row["comm_time_s"] > 0 for row in steps), (stage, [row["comm_time_s"] for row in steps])
            # checkpointed after 4 steps, resumed to the end: the same parameters
            where = f"{directory}/{optimizer}-zero{stage}"
            cut = Trainer(
                model(), None, train, val, TrainConfig(**{**base, "max_steps": 4}, zero=stage, checkpoint_dir=where)
            )
            cut.fit()
            cut.close()
            resumed = Trainer(
                model(), None, train, val, TrainConfig(**base, zero=stage, checkpoint_dir=where, resume=True)
            )
            assert resumed.step == 4, resumed.step
            resumed.fit()
            resumed.close()
            worst = max(float((a - b).abs().max()) for a, b in zip(reference, params(resumed)))
            assert worst < 1e-5, ("resumed", optimizer, stage, worst)
    print("OK zero trainer", WORLD.Get_rank(), file=sys.stderr)


def clipped() -> None:
    """grad_clip with zero=1 and zero=2 (two micro-steps a step) equals plain data parallel: the same norms, the same parameters."""
    train, val = data()
    config = TrainConfig(**{**BASE, "max_steps": 4}, grad_clip=0.05, grad_accum=2)
    runs = {}
    for stage in (0, 1, 2):
        trainer = Trainer(model(), None, train, val, config.replace(zero=stage))
        norms = [row["grad_norm"] for row in trainer.fit() if row["kind"] == "train"]
        trainer.close()
        runs[stage] = (norms, params(trainer))
    norms, reference = runs[0]
    assert len(norms) == 4 and min(norms) > 0.05, norms  # every step is clipped
    for stage in (1, 2):
        assert all(abs(a - b) < 1e-5 * a for a, b in zip(norms, runs[stage][0], strict=True)), (
            stage,
            norms,
            runs[stage][0],
        )
        worst = max(float((a - b).abs().max()) for a, b in zip(reference, runs[stage][1]))
        assert worst < 1e-5, (stage, worst)
    print("OK clipped", WORLD.Get_rank(), file=sys.stderr)


def resized(directory: str) -> None:
    """On 3 ranks: ranks 0 and 1 cut a zero=1 run at step 2; it resumes on 1 rank and on 3 and ends as the uninterrupted run.

    The global batch stays 12: 1 rank takes 2 micro-steps of 6 (``on_resize="keep"``), 3
    ranks a batch of 4 each.
    """
    train, val = data()
    config = TrainConfig(**{**BASE, "max_steps": 4, "batch_size": 6}, zero=1, workers=2)
    pair = WORLD.Split(color=0 if WORLD.Get_rank() < 2 else MPI.UNDEFINED, key=WORLD.Get_rank())
    reference = None
    if pair != MPI.COMM_NULL:
        whole = Trainer(model(), None, train, val, config, comm=pair)
        whole.fit()
        whole.close()
        reference = params(whole)
        cut = Trainer(
            model(), None, train, val, config.replace(max_steps=2, checkpoint_dir=f"{directory}/cut"), comm=pair
        )
        cut.fit()
        cut.close()
        pair.Free()
    reference = WORLD.bcast(reference, root=0)
    if WORLD.Get_rank() == 0:
        for copy in ("one", "three"):
            shutil.copytree(f"{directory}/cut", f"{directory}/{copy}")
    WORLD.Barrier()
    for comm, where, batch in ((MPI.COMM_SELF, "one", 6), (WORLD, "three", 4)):
        if comm is WORLD or WORLD.Get_rank() == 0:
            resumed = Trainer(
                model(),
                None,
                train,
                val,
                config.replace(
                    checkpoint_dir=f"{directory}/{where}", resume=True, batch_size=batch, workers=comm.Get_size()
                ),
                comm=comm,
            )
            assert resumed.step == 2 and resumed.config.global_batch(comm.Get_size()) == 12, (
                resumed.step,
                resumed.config,
            )
            resumed.fit()
            resumed.close()
            worst = max(float((a - b).abs().max()) for a, b in zip(reference, params(resumed), strict=True))
            assert worst < 1e-6, (where, worst)
    print("OK resized", WORLD.Get_rank(), file=sys.stderr)


def crash_between_parts(directory: str) -> None:
    """A part that cannot be written: no manifest names its step, the resume falls back to the previous checkpoint."""
    train, val = data()
    config = TrainConfig(**{**BASE, "optimizer": "adamw"}, zero=2, checkpoint_dir=directory, checkpoint_every=2)
    uninterrupted = Trainer(model(), None, train, val, config.replace(checkpoint_dir=None, checkpoint_every=0))
    uninterrupted.fit()
    uninterrupted.close()
    blocker = Path(directory) / "part-s0-t0-d1-step4.pt"  # rank 1's part of step 4 cannot replace a directory

    class Block:  # once the checkpoint of step 2 is complete
        def on_step_end(self, row: dict) -> None:
            if row["step"] == 3:
                blocker.mkdir(exist_ok=True)

    first = Trainer(model(), None, train, val, config, callbacks=[Block()])
    try:
        first.fit()
    except RuntimeError as exc:
        assert "checkpoint of step 4 not written" in str(exc) and "rank 1" in str(exc), exc
    else:
        raise AssertionError("a checkpoint with a part that could not be written was completed")
    first.close()
    WORLD.Barrier()
    if WORLD.Get_rank() == 0:
        blocker.rmdir()
    WORLD.Barrier()
    resumed = Trainer(model(), None, train, val, config.replace(resume=True))
    assert resumed.step == 2, resumed.step  # the last complete checkpoint
    resumed.fit()
    resumed.close()
    worst = max(float((a - b).abs().max()) for a, b in zip(params(uninterrupted), params(resumed)))
    assert worst < 1e-6, worst
    # a manifest that names a part no longer there is refused on every rank
    if WORLD.Get_rank() == 0:
        (Path(directory) / "part-s0-t0-d1-step8.pt").unlink()
    WORLD.Barrier()
    try:
        Trainer(model(), None, train, val, config.replace(resume=True))
    except ConfigError as exc:
        assert "names part-s0-t0-d1-step8.pt (rank 1's part), which is missing" in str(exc), exc
    else:
        raise AssertionError("a checkpoint with a missing part was resumed")
    print("OK crash", WORLD.Get_rank(), file=sys.stderr)


def memory(out: str) -> None:
    """Bytes per rank of parameters, gradients and AdamW state for zero=0, 1, 2, 3 (after two steps) of a 32-layer MLP.

    Buckets of one layer each (0.07 MB; at ZeRO-3 each layer is a block): ZeRO-2 and 3 hold at most three whole buckets
    besides their gradient slices, ZeRO-3 at most two whole layers besides its parameter slices.
    """
    train, val = data()
    rows: dict = {}
    for stage in (0, 1, 2, 3):
        config = TrainConfig(**{**BASE, "max_steps": 2, "optimizer": "adamw", "bucket_mb": 0.07}, zero=stage)
        trainer = Trainer(model(hidden=128, depth=31), None, train, val, config)
        trainer.fit()
        rows[f"zero{stage}"] = training_bytes(trainer.model, trainer.optimizer, trainer.sync)
        trainer.close()
    rows["parameters"] = sum(p.numel() for p in model(hidden=128, depth=31).parameters())
    gathered = WORLD.gather(rows, root=0)
    if WORLD.Get_rank() == 0:
        Path(out).write_text(json.dumps(gathered))
