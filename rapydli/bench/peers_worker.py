"""The per-rank half of ``rapydli bench parallel --peers`` (run under ``mpiexec`` by :mod:`rapydli.bench.parallel`).

One launch trains one *variant* on 2 fresh ranks: a model (``--model``: ``gpt2``,
:func:`rapydli.zoo.models.gpt2_style`, fused ``c_attn`` and an LM head tied to the token
embedding; ``llama``, :func:`rapydli.zoo.models.llama_style`, separate q/k/v/o with
grouped-query attention, SwiGLU, RMSNorm, rotary), a layout (``--layout``) and a side
(``--impl``):

* ``tp2``, 2-way tensor parallelism. ``rapydli``: :func:`rapydli.parallel.tensor.shard_model`
  with the built-in plan (:func:`rapydli.parallel.tensor_plans.plan_for`: each attention's
  whole heads per rank, the MLP column then row) over the tensor communicator of
  ``Layout(world.Get_size(), 1, 2).grid(world)``. ``torch``: ``parallelize_module`` on a gloo
  ``DeviceMesh("cpu", [0, 1])``, as torchtitan sets up a block: the q/k/v projections
  (GPT-2: the fused ``c_attn``) and the MLP's first layers (``c_fc``; ``gate_proj``,
  ``up_proj``) ``ColwiseParallel``, the output projections (``c_proj``, ``o_proj``,
  ``down_proj``) ``RowwiseParallel``; embeddings, norms and the LM head stay whole. For
  GPT-2's fused ``c_attn`` the peer first permutes the weight's rows and the bias, so that
  each rank's contiguous chunk is its own heads' ``[q; k; v]``, and sets each attention's
  ``n_head`` to its local head count (Llama's attention reads its head counts from its
  projections' widths).
* ``pp2``, a pipeline of 2 stages, 1F1B with :data:`MICROBATCHES` micro-batches, the
  blocks (:func:`rapydli.parallel.split.pipeline_blocks`; Llama's read from its traced
  ``forward``) cut where :func:`rapydli.parallel.split.balance` cuts equal costs.
  ``rapydli``: :class:`rapydli.parallel.executor.PipelineExecutor`, and for GPT-2's tied
  embedding the gradient sum over the two stages that hold it
  (:class:`rapydli.parallel.shared.SharedGradients`), as training does. ``torch``:
  ``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B`` over gloo on
  the same stage modules; it keeps the tied weight as two copies, one a stage, each
  trained on its own stage's gradient.

Both sides build the model from :data:`SEED`, train on the same synthetic batches
(:meth:`Shape.batches`: random tokens, the targets the next token), take the mean
cross-entropy over every position and step AdamW (``lr`` :data:`LR`, no weight decay).
Each step is timed between two barriers: ``zero_grad``, forward, backward (the pipeline's
schedule) and the optimizer step; the first :data:`WARMUP` steps are not counted.

Rank 0 writes one row as JSON to ``--out``: ``step_ms`` (the slowest rank's median step
after the warm-up), ``step_ms_per_rank``, ``losses`` (each step's loss of the batch) and
the torch version.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rapydli.zoo import models

IMPLEMENTATIONS = ("rapydli", "torch")
LAYOUTS = ("tp2", "pp2")
MICROBATCHES, WARMUP = 4, 2
LR, SEED = 3e-4, 0
#: What one step does: trains on batch ``index`` and returns its loss where this rank knows it (else ``None``).
Step = Callable[[int], "float | None"]


@dataclass(frozen=True)
class Shape:
    """A bench size: both models' shapes and the batch (every rank trains on the whole batch).

    ``width``, ``heads`` and ``layers`` are GPT-2's ``n_embd``, ``n_head``, ``n_layer`` and
    Llama's ``hidden``, ``heads``, ``layers``; ``kv_heads`` and ``intermediate`` are Llama's.
    """

    vocab: int
    positions: int
    width: int
    heads: int
    kv_heads: int
    intermediate: int
    layers: int
    batch: int

    def model(self, name: str) -> nn.Module:
        """Model ``name`` (:data:`MODELS`) from :data:`SEED`: the same on every rank and both sides."""
        torch.manual_seed(SEED)
        return MODELS[name](self)

    def batches(self, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``steps`` batches of ``(tokens, next tokens)``, each ``(batch, positions)``, from :data:`SEED`."""
        generator = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, self.vocab, (steps, self.batch, self.positions + 1), generator=generator)
        return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


#: The bench sizes, by name: ``bench`` (a training step of either whole model takes about 250 ms on one thread of a 2-core VM) and
#: ``tiny`` (for tests).
SHAPES = {
    "bench": Shape(vocab=2048, positions=64, width=256, heads=8, kv_heads=4, intermediate=704, layers=4, batch=4),
    "tiny": Shape(vocab=256, positions=32, width=64, heads=4, kv_heads=2, intermediate=128, layers=2, batch=4),
}
#: The models, by name, built to a :class:`Shape`.
MODELS: dict[str, Callable[[Shape], nn.Module]] = {
    "gpt2": lambda s: models.gpt2_style(s.vocab, s.positions, s.width, s.heads, s.layers),
    "llama": lambda s: models.llama_style(s.vocab, s.width, s.heads, s.kv_heads, s.intermediate, s.layers),
}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _adamw(parameters: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=LR, weight_decay=0.0)


def _whole_model_step(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Step:
    """A step of a model every rank runs whole (tensor parallel): the batch's loss on every rank."""
    optimizer = _adamw(model.parameters())

    def step(index: int) -> float:
        inputs, targets = batches[index]
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def rapydli_tp(name: str, shape: Shape, batches: list[tuple[torch.Tensor, torch.Tensor]], world: Any) -> Step:
    """RaPyDLI's tensor parallelism: the built-in plan, over the grid's tensor communicator."""
    from rapydli.parallel.layout import Layout
    from rapydli.parallel.tensor import shard_model
    from rapydli.parallel.tensor_plans import plan_for

    model = shape.model(name)
    grid = Layout(world.Get_size(), 1, world.Get_size()).grid(world)
    shard_model(model, plan_for(model, grid.layout.tensor_parallel), grid.tensor)
    return _whole_model_step(model, batches)


def _fused_heads_first(linear: nn.Linear, ranks: int) -> None:
    """Permute a fused q/k/v projection's rows (and bias) so that rank ``r``'s contiguous chunk is its heads' ``[q; k; v]``."""
    width = linear.out_features // 3
    local = width // ranks
    order = torch.cat(
        [
            torch.arange(part * width + rank * local, part * width + (rank + 1) * local)
            for rank in range(ranks)
            for part in range(3)
        ]
    )
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        if linear.bias is not None:
            linear.bias.copy_(linear.bias[order])


def torch_tp(name: str, shape: Shape, batches: list[tuple[torch.Tensor, torch.Tensor]], world: Any) -> Step:
    """PyTorch's tensor parallelism: ``parallelize_module`` of every block on a gloo mesh (see the module's description)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    ranks = world.Get_size()
    mesh = DeviceMesh("cpu", list(range(ranks)))
    model: Any = shape.model(name)
    if name == "gpt2":
        for block in model.transformer.h:
            _fused_heads_first(block.attn.c_attn, ranks)
            block.attn.n_head //= ranks  # the heads this rank computes, as torchtitan sets local head counts
            parallelize_module(
                block,
                mesh,
                {
                    "attn.c_attn": ColwiseParallel(),
                    "attn.c_proj": RowwiseParallel(),
                    "mlp.c_fc": ColwiseParallel(),
                    "mlp.c_proj": RowwiseParallel(),
                },
            )
    else:
        for layer in model.model.layers:
            plan = {f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"} | {"self_attn.o_proj": RowwiseParallel()}
            plan |= {
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            }
            parallelize_module(layer, mesh, plan)  # type: ignore[arg-type]
    return _whole_model_step(model, batches)


def _stage(name: str, shape: Shape, stage: int, stages: int) -> tuple[nn.Module, list[int], nn.Module]:
    """The whole model, where its stages begin and this stage of it: the blocks cut at equal costs, the same on both sides."""
    from rapydli.parallel import split

    model = shape.model(name)
    bounds = split.balance([1.0] * len(split.pipeline_blocks(model)), stages)
    return model, bounds, split.stage_module(model, bounds, stage)[0]


def rapydli_pp(name: str, shape: Shape, batches: list[tuple[torch.Tensor, torch.Tensor]], world: Any) -> Step:
    """RaPyDLI's pipeline: the executor's 1F1B, and the tied weight's gradient summed over the stages that hold it."""
    from rapydli.parallel.executor import PipelineExecutor
    from rapydli.parallel.layout import Layout
    from rapydli.parallel.shared import SharedGradients, find_shared

    grid = Layout(world.Get_size(), world.Get_size()).grid(world)
    model, bounds, stage = _stage(name, shape, grid.stage, grid.layout.pipeline_stages)
    shared = SharedGradients(find_shared(model, bounds), stage, grid.pipeline)
    shared.broadcast()
    executor = PipelineExecutor(stage, grid.pipeline, "1f1b", MICROBATCHES, lm_loss)
    optimizer = _adamw(stage.parameters())

    def step(index: int) -> float:
        inputs, targets = batches[index]
        optimizer.zero_grad()
        loss = executor.train_step(inputs, targets)
        shared.sum_gradients()
        optimizer.step()
        return loss

    return step


def torch_pp(name: str, shape: Shape, batches: list[tuple[torch.Tensor, torch.Tensor]], world: Any) -> Step:
    """PyTorch's pipeline: ``PipelineStage`` and ``Schedule1F1B`` on the same stage modules (the tied weight two copies)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    rank, ranks = world.Get_rank(), world.Get_size()
    _, _, stage = _stage(name, shape, rank, ranks)
    schedule = Schedule1F1B(PipelineStage(stage, rank, ranks, torch.device("cpu")), MICROBATCHES, loss_fn=lm_loss)
    optimizer = _adamw(stage.parameters())

    def step(index: int) -> float | None:
        inputs, targets = batches[index]
        optimizer.zero_grad()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(inputs)
        elif rank == ranks - 1:
            schedule.step(target=targets, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        return (
            float(torch.stack(losses).detach().mean()) if losses else None
        )  # equal micro-batches: their mean is the batch's

    return step


#: How each side sets up each layout, by ``(impl, layout)``.
RUNNERS: dict[tuple[str, str], Callable[[str, Shape, list[tuple[torch.Tensor, torch.Tensor]], Any], Step]] = {
    ("rapydli", "tp2"): rapydli_tp, ("torch", "tp2"): torch_tp, ("rapydli", "pp2"): rapydli_pp, ("torch", "pp2"): torch_pp,
}  # fmt: skip


def measure(impl: str, name: str, layout: str, shape: Shape, steps: int, world: Any) -> dict[str, Any] | None:
    """Train the variant for ``steps`` steps on every rank of ``world``; rank 0's row (``None`` on the others)."""
    if steps <= WARMUP:
        raise ValueError(f"steps={steps}: more than the {WARMUP} warm-up steps")
    if impl == "torch":
        from rapydli.comm.torchdist import process_group

        process_group(world, "gloo")
    batches = shape.batches(steps)
    step = RUNNERS[impl, layout](name, shape, batches, world)
    times, losses = [], []
    for index in range(steps):
        world.Barrier()
        started = time.perf_counter()
        losses.append(step(index))
        world.Barrier()
        times.append(time.perf_counter() - started)
    if impl == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    medians = world.gather(1e3 * statistics.median(times[WARMUP:]), root=0)
    known = world.bcast(losses, root=world.Get_size() - 1)  # the last rank computes the loss in every layout
    if world.Get_rank() != 0:
        return None
    return {
        "impl": impl,
        "model": name,
        "layout": layout,
        "ranks": world.Get_size(),
        "step_ms": max(medians),
        "step_ms_per_rank": [round(m, 3) for m in medians],
        "losses": known,
        "torch": torch.__version__,
    }


def main() -> None:
    """Parse the arguments, measure, write rank 0's row."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--layout", choices=LAYOUTS, required=True)
    parser.add_argument("--size", choices=sorted(SHAPES), required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from mpi4py import MPI

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    row = measure(args.impl, args.model, args.layout, SHAPES[args.size], args.steps, world)
    if row is not None:
        with open(args.out, "w") as stream:
            json.dump(row, stream)


if __name__ == "__main__":
    main()
