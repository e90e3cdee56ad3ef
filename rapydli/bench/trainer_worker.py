"""The per-rank half of ``rapydli bench trainer`` (run under ``mpiexec`` by :mod:`rapydli.bench.trainer`).

For each model it times, on every rank and over the same loader: the RaPyDLI
``Trainer`` step, the same step under torch ``DistributedDataParallel`` (gloo), and the
same step with no communication at all. With ``--autotune`` (the default) it also times
``trainer_autotune``: the same ``Trainer`` on the model with its convolutions tuned the
way ``TrainConfig(autotune=True)`` tunes them (rank 0 plans, every rank applies the plan).
The tuning runs once, before the rounds, in a ``Trainer`` built with ``autotune=True``
(its seconds are the row's ``tune_s``); each round then applies that plan to a fresh model
with :func:`rapydli.autotune.apply_plan` instead of tuning again, because ``plan_for``
re-times its whole-model check (10 interleaved rounds of every candidate plan) on every
call, even with every convolution cached (resnet_mini at 1 thread: 8.4-8.7 s a call), and
that check may pick another plan (two cached calls chose planned_1.25x, then planned_1.1x). A model
without convolutions (the MLP) gets an empty plan: its ``trainer_autotune`` is the plain
``Trainer`` again, kept as a noise gauge. Variants are interleaved in rounds so machine
noise hits them alike; each round reports the median step time of its measured steps.
Rank 0 writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from rapydli.comm import Communicator
from rapydli.data.loaders import build_loader
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.loop import Trainer, loss_and_correct
from rapydli.trainer.optim import build_optimizer
from rapydli.zoo import datasets, models

#: Steps between checkpoints while the checkpoint cost is measured: each write has this many steps to overlap.
CHECKPOINT_EVERY = 10

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any]]] = {
    "resnet_mini": (
        lambda: models.resnet_mini(in_channels=3),
        lambda n: datasets.synthetic_images(n, size=32, val_fraction=0.01),
    ),
    "mlp": (
        lambda: models.mlp(in_features=3 * 32 * 32, hidden=512, depth=2),
        lambda n: datasets.synthetic_images(n, size=32, val_fraction=0.01),
    ),
}


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]()


def _plain_steps(model: nn.Module, loader: Any, config: TrainConfig, steps: int, warmup: int) -> list[float]:
    """Time ``steps`` optimizer steps of a plain loop (DDP-wrapped or not) after ``warmup``."""
    optimizer = build_optimizer(model, config)
    loader.set_epoch(0)
    batches = iter(loader)
    times = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        inputs, targets = next(batches)
        optimizer.zero_grad(set_to_none=True)
        loss, _ = loss_and_correct(model(inputs), targets)
        loss.backward()
        optimizer.step()
        loss.item()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return times


def _loader(train: Any, config: TrainConfig, rank: int, size: int) -> Any:
    return build_loader(train, batch_size=config.batch_size, rank=rank, world_size=size, seed=0, epochs=1)


def _tune(name: str, train: Any, config: TrainConfig, comm: Communicator, world: MPI.Comm) -> tuple[Any, float]:
    """The plan of a ``Trainer`` built with ``autotune=True`` (tuned on rank 0, cached on disk) and its seconds."""
    world.Barrier()
    started = time.perf_counter()
    tuner = Trainer(_model(name), None, train, None, config.replace(autotune=True), comm=comm)
    seconds = time.perf_counter() - started
    tuner.close()
    return tuner.autotune_plan, seconds


def _trainer_round(
    model: nn.Module, train: Any, config: TrainConfig, comm: Communicator, warmup: int, stats: dict[str, list[float]]
) -> float:
    """The median step time of one ``Trainer.fit``; its per-step communication figures go to ``stats``."""
    trainer = Trainer(model, None, train, None, config, comm=comm)
    rows = [r for r in trainer.fit() if r["kind"] == "train"][warmup:]
    trainer.close()
    stats["hidden"] += [r["comm_hidden_fraction"] for r in rows]
    stats["wait"] += [r["comm_wait_s"] for r in rows]
    stats["comm"] += [r["comm_time_s"] for r in rows]
    return statistics.median(r["step_time_s"] for r in rows)


def checkpoint_cost(
    name: str, steps: int, warmup: int, every: int, allreduce: str, world: MPI.Comm, directory: str
) -> dict[str, Any]:
    """What checkpoints cost the steps: the save that blocks the step, and the writer thread's toll on the steps after it.

    Runs ``warmup + steps`` steps checkpointing every ``every``. On rank 0 (it copies the
    state and its thread writes it; the other ranks wait for it in the next allreduce) it
    times each ``save_checkpoint`` (the copy in memory) and takes the write's span from the
    :class:`~rapydli.trainer.checkpoint.CheckpointWriter`; the measured steps that overlap a
    write are compared with the median of those that do not: their excess is what the
    thread costs the training. Then one blocking
    :func:`rapydli.trainer.checkpoint.save_atomic` of the same state, for comparison.
    """
    from rapydli.trainer import checkpoint as ckpt

    config = TrainConfig(
        batch_size=32,
        lr=0.01,
        optimizer="sgd",
        allreduce=allreduce,
        max_steps=warmup + steps,
        checkpoint_dir=directory,
        checkpoint_every=every,
    )
    train, _ = MODELS[name][1](config.batch_size * world.Get_size() * (warmup + steps) + 64)
    trainer = Trainer(_model(name), None, train, None, config, comm=world)
    saves: list[float] = []
    save = trainer.save_checkpoint

    def timed() -> Any:
        started = time.perf_counter()
        path = save()
        saves.append(time.perf_counter() - started)
        return path

    trainer.save_checkpoint = timed  # type: ignore[method-assign]
    rows = [r for r in trainer.fit() if r["kind"] == "train"][warmup:]
    writes = trainer.checkpoints.writer.spans
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
    trainer.close()
    started = time.perf_counter()
    ckpt.save_atomic(state, f"{directory}/sync-{world.Get_rank()}.pt")
    sync_s = time.perf_counter() - started

    # each measured step's span, in the writer's clock; the writes that ran while measured steps did
    spans = [
        (trainer._started + r["time_s"] - r["step_time_s"], trainer._started + r["time_s"], r["step_time_s"])
        for r in rows
    ]
    during = [t for a, b, t in spans if any(w0 < b and w1 > a for w0, w1 in writes)]
    clean_s = statistics.median(
        [t for a, b, t in spans if not any(w0 < b and w1 > a for w0, w1 in writes)] or [t for *_, t in spans]
    )
    overlapped = [w for w in writes if any(w[0] < b and w[1] > a for a, b, _ in spans)]
    thread_s = sum(t - clean_s for t in during) / len(overlapped) if overlapped else 0.0
    return {
        "model": name,
        "variant": "checkpoint",
        "ranks": world.Get_size(),
        "every": every,
        "saves": len(saves),
        "step_ms": 1000 * clean_s,
        "save_ms": 1000 * statistics.median(saves) if saves else None,
        "write_ms": 1000 * statistics.median(b - a for a, b in writes) if writes else None,
        "steps_during_write": len(during),
        "step_ms_during_write": 1000 * statistics.median(during) if during else None,
        "thread_ms": 1000 * thread_s,
        "sync_write_ms": 1000 * sync_s,
    }


def measure(
    name: str,
    steps: int,
    warmup: int,
    rounds: int,
    allreduce: str,
    bucket_mb: float,
    world: MPI.Comm,
    autotune: bool = False,
) -> list[dict[str, Any]]:
    rank, size = world.Get_rank(), world.Get_size()
    config = TrainConfig(
        batch_size=32, lr=0.01, optimizer="sgd", allreduce=allreduce, bucket_mb=bucket_mb, max_steps=warmup + steps
    )
    train, _ = MODELS[name][1](config.batch_size * size * (warmup + steps) + 64)
    comm = Communicator(world, algorithm=allreduce)
    params = sum(p.numel() for p in _model(name).parameters())
    trainers = ["trainer", "trainer_autotune"] if autotune else ["trainer"]
    results: dict[str, list[float]] = {v: [] for v in ["trainer", "ddp_gloo", "no_comm", *trainers[1:]]}
    stats: dict[str, dict[str, list[float]]] = {v: {"hidden": [], "wait": [], "comm": []} for v in trainers}
    # tuned once, outside the measured steps (the first run tunes; later runs find the convolutions in the cache)
    plan, tune_s = _tune(name, train, config, comm, world) if autotune else (None, None)
    for _ in range(rounds):
        world.Barrier()
        times = _plain_steps(_model(name), _loader(train, config, rank, size), config, steps, warmup)
        results["no_comm"].append(statistics.median(times))

        world.Barrier()
        ddp = nn.parallel.DistributedDataParallel(_model(name))
        times = _plain_steps(ddp, _loader(train, config, rank, size), config, steps, warmup)
        results["ddp_gloo"].append(statistics.median(times))
        del ddp

        world.Barrier()
        results["trainer"].append(_trainer_round(_model(name), train, config, comm, warmup, stats["trainer"]))

        if autotune:
            from rapydli.autotune import apply_plan

            world.Barrier()  # the same Trainer and config; the model runs the tuned plan (apply_plan shares the parameters)
            assert plan is not None  # tuned above when autotune
            tuned = apply_plan(_model(name), plan)
            results["trainer_autotune"].append(
                _trainer_round(tuned, train, config, comm, warmup, stats["trainer_autotune"])
            )
    comm.close()
    # every rank's medians; the slowest rank sets the pace of a synchronous step
    gathered = world.gather(results, root=0)
    extra = world.gather(stats, root=0)
    if rank != 0:
        return []
    assert gathered is not None and extra is not None  # rank 0 is the root of both gathers
    rows = []
    for variant in results:
        per_round = [max(r[variant][i] for r in gathered) for i in range(rounds)]
        rows.append(
            {
                "model": name,
                "params": params,
                "variant": variant,
                "ranks": size,
                "batch_per_rank": config.batch_size,
                "bucket_mb": bucket_mb if variant in trainers else None,
                "step_ms": 1000 * statistics.median(per_round),
                "step_ms_min": 1000 * min(per_round),
                "step_ms_max": 1000 * max(per_round),
                "rounds_ms": [1000 * seconds for seconds in per_round],
                "samples_per_s": config.batch_size * size / statistics.median(per_round),
            }
        )
    for row in rows:
        if row["variant"] in trainers:
            merged = {
                key: [x for rank_stats in extra for x in rank_stats[row["variant"]][key]]
                for key in ("hidden", "wait", "comm")
            }
            row.update(
                comm_ms=1000 * statistics.median(merged["comm"]),
                comm_wait_ms=1000 * statistics.median(merged["wait"]),
                hidden_fraction=statistics.mean(merged["hidden"]),
            )
        if row["variant"] == "trainer_autotune":
            # tune_s: rank 0's plan_for (cached convolutions are not re-measured) and the plan's broadcast, once
            assert plan is not None  # the autotune variant runs only with a plan
            row.update(tune_s=tune_s, tuned_convs=len(plan.layers), plan=plan.chosen if plan.layers else None)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="resnet_mini,mlp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--allreduce", default="auto")
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument(
        "--autotune", action=argparse.BooleanOptionalAction, default=True, help="also time trainer_autotune"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="also time checkpoints written here")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    port = world.bcast(_free_port() if world.Get_rank() == 0 else None, root=0)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=world.Get_rank(), world_size=world.Get_size()
    )
    rows = []
    for name in args.models.split(","):
        rows += measure(
            name, args.steps, args.warmup, args.rounds, args.allreduce, args.bucket_mb, world, args.autotune
        )
        if args.checkpoint_dir:
            cost = checkpoint_cost(
                name,
                max(args.steps, 4 * CHECKPOINT_EVERY),
                args.warmup,
                CHECKPOINT_EVERY,
                args.allreduce,
                world,
                f"{args.checkpoint_dir}/{name}",
            )
            rows += [cost] if world.Get_rank() == 0 else []
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        with open(args.out, "w") as stream:
            json.dump(rows, stream)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    main()
