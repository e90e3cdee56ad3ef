"""The per-rank half of ``rapydli bench pipeline`` (run under ``mpiexec`` by :mod:`rapydli.bench.pipeline`).

Parts, one per launch (``--part``):

* ``bubble``: every stage is a block that sleeps ``--forward-ms`` in forward and twice
  that in backward (the sleeps are the calibrated work, so ranks sharing cores do not
  distort the timeline); for each schedule and ``m`` the executor runs ``--steps`` steps
  and rank 0 computes the idle fraction of every rank over each step's span, all ranks'
  spans on one clock (``perf_counter`` is the system-wide monotonic clock on Linux).
* ``memory``: peak bytes autograd keeps for backward on each rank
  (:class:`rapydli.parallel.memory.ActivationMeter`) for GPipe, 1F1B and plain data
  parallelism on the same MLP and global batch, p = the launch's ranks, and the theory of
  each pipelined row (live micro-batches x one micro-batch's bytes on the rank's stage).
* ``rapydli`` / ``torch``: step time of 1F1B on 2 ranks with the same split and ``m``,
  RaPyDLI's executor or ``torch.distributed.pipelining.Schedule1F1B`` over gloo.

Rank 0 writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from rapydli.parallel import schedules, split
from rapydli.parallel.executor import PipelineExecutor
from rapydli.parallel.layout import Layout
from rapydli.parallel.memory import ActivationMeter
from rapydli.parallel.timeline import Recorder, bubble

WARMUP = 2


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.seconds)
        return grad, None


class SleepingBlock(nn.Module):
    """A stage whose forward sleeps ``seconds`` and backward ``2 * seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.scale, self.seconds)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, target)


def bubble_rows(world: Any, forward_ms: float, steps: int) -> list[dict[str, Any]]:
    """Measured idle fraction against ``(p - 1) / (m + p - 1)`` for p = world size."""
    p = world.Get_size()
    grid = Layout(world.Get_size(), p).grid(world)
    rows = []
    for schedule in schedules.SCHEDULES:
        for m in (1, 2, 4, 8):
            recorder = Recorder(keep=steps + WARMUP)
            executor = PipelineExecutor(
                SleepingBlock(forward_ms / 1e3), grid.pipeline, schedule, m, _loss, recorder=recorder
            )
            x, y = torch.randn(4 * m, 8), torch.randint(0, 8, (4 * m,))
            for _ in range(steps + WARMUP):
                world.Barrier()
                executor.train_step(x, y)
            spans = world.gather([recorder.of_step(s) for s in range(WARMUP, steps + WARMUP)], root=0)
            if world.Get_rank() == 0:
                measured = [bubble([spans[r][i] for r in range(p)]) for i in range(steps)]
                overall = statistics.median(b for b, _ in measured)
                theory = schedules.bubble_fraction(p, m)
                rows.append(
                    {
                        "part": "bubble",
                        "schedule": schedule,
                        "stages": p,
                        "microbatches": m,
                        "bubble_measured": overall,
                        "bubble_theory": theory,
                        "relative_error": abs(overall - theory) / theory if theory else 0.0,
                        "per_rank": [statistics.median(r[k] for _, r in measured) for k in range(p)],
                    }
                )
    grid.free()
    return rows


def mlp(depth: int = 8, width: int = 256) -> nn.Sequential:
    """The real-compute model of the memory and throughput parts."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, width)]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def memory_rows(world: Any, batch: int, microbatches: list[int]) -> list[dict[str, Any]]:
    """Peak saved-activation bytes per rank: GPipe and 1F1B (p = world size) for each m, data parallel.

    Each pipelined row carries its theory: the micro-batches the schedule keeps alive on the
    rank (:func:`rapydli.parallel.schedules.peak_live`) times the bytes one micro-batch of
    ``batch / m`` samples holds on the rank's stage (measured alone, with m = 1). The
    batch itself is not counted (it is there whatever the schedule); activations received
    from the previous stage are.
    """
    p, rank = world.Get_size(), world.Get_rank()
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    rows: list[dict[str, Any]] = []
    grid = Layout(world.Get_size(), p).grid(world)
    model = mlp()
    bounds = split.balance([1.0] * len(split.pipeline_blocks(model)), p)
    stage, _ = split.stage_module(model, bounds, grid.stage)
    for m in microbatches:
        single = PipelineExecutor(stage, grid.pipeline, "gpipe", 1, _loss)
        with ActivationMeter([*stage.parameters(), x]) as meter:  # one micro-batch of batch / m samples, alone
            single.train_step(x[: batch // m], y[: batch // m])
        one = meter.peak
        for schedule in schedules.SCHEDULES:
            executor = PipelineExecutor(stage, grid.pipeline, schedule, m, _loss)
            with ActivationMeter([*stage.parameters(), x]) as meter:
                executor.train_step(x, y)
            live = schedules.peak_live(executor.actions)
            measured = world.gather((meter.peak, live, one), root=0)
            rows += [
                {
                    "part": "memory",
                    "variant": schedule,
                    "rank": r,
                    "ranks": p,
                    "stages": p,
                    "microbatches": m,
                    "peak_activation_bytes": b,
                    "live_microbatches": n,
                    "microbatch_bytes": o,
                    "theory_bytes": n * o,
                }
                for r, (b, n, o) in enumerate(measured or [])
            ]
    # data parallel: every rank the whole model on its share of the batch
    whole = mlp()
    mine = slice(rank * batch // p, (rank + 1) * batch // p)
    with ActivationMeter([*whole.parameters(), x]) as meter:
        _loss(whole(x[mine]), y[mine]).backward()
    peaks = world.gather(meter.peak, root=0)
    rows += [
        {
            "part": "memory",
            "variant": "data_parallel",
            "rank": r,
            "ranks": p,
            "stages": 1,
            "microbatches": 1,
            "peak_activation_bytes": b,
        }
        for r, b in enumerate(peaks or [])
    ]
    grid.free()
    return rows


def throughput_rows(world: Any, peer: str, batch: int, m: int, steps: int) -> list[dict[str, Any]]:
    """Median 1F1B step time on 2 ranks, RaPyDLI's executor or torch.distributed.pipelining's."""
    p, rank = world.Get_size(), world.Get_rank()
    model = mlp(depth=12, width=512)
    bounds = split.balance([1.0] * len(split.pipeline_blocks(model)), p)
    stage, _ = split.stage_module(model, bounds, rank)
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    if peer == "rapydli":
        grid = Layout(world.Get_size(), p).grid(world)
        executor = PipelineExecutor(stage, grid.pipeline, "1f1b", m, _loss)

        def step() -> None:
            executor.train_step(x, y)
    else:
        import torch.distributed as dist
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        from rapydli.comm.torchdist import process_group

        process_group(world, "gloo")
        torch_stage = PipelineStage(stage, rank, p, torch.device("cpu"))
        schedule = Schedule1F1B(torch_stage, m, loss_fn=lambda out, target: F.cross_entropy(out, target))

        def step() -> None:
            if rank == 0:
                schedule.step(x)
            elif rank == p - 1:
                schedule.step(target=y, losses=[])
            else:
                schedule.step()

    times = []
    for i in range(steps + WARMUP):
        world.Barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        step()
        optimizer.step()
        world.Barrier()
        if i >= WARMUP:
            times.append(time.perf_counter() - started)
    if peer == "torch":
        dist.destroy_process_group()
    row = {"part": "throughput", "variant": peer, "stages": p, "microbatches": m, "batch": batch, "step_ms": statistics.median(times) * 1e3,
           "torch": torch.__version__}  # fmt: skip
    return [row] if rank == 0 else []


def main() -> None:
    """Parse the arguments, run one part, write rank 0's rows."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--part", choices=("bubble", "memory", "rapydli", "torch"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--forward-ms", type=float, default=10.0)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    if args.part == "bubble":
        rows = bubble_rows(world, args.forward_ms, args.steps)
    elif args.part == "memory":
        rows = memory_rows(world, args.batch, [2, 4, 8])
    else:
        rows = throughput_rows(world, args.part, args.batch, args.microbatches, args.steps)
    if world.Get_rank() == 0:
        with open(args.out, "w") as stream:
            json.dump(rows, stream)


if __name__ == "__main__":
    main()
