"""The per-rank half of ``rapydli bench parallel --zero 3`` (run under ``mpiexec`` by :mod:`rapydli.bench.parallel`).

One launch trains one *variant* in fresh processes: ``--impl rapydli`` (the
:class:`~rapydli.trainer.loop.Trainer` with ``TrainConfig(zero=3)``) or ``--impl fsdp2``
(PyTorch's ``fully_shard`` over gloo, set up as torchtitan does: each block of
``transformer.h`` sharded, then the root; every block but the last resharded after
forward; the root kept until backward), each with or without activation checkpointing
of every block (``--checkpointing``: ``TrainConfig(activation_checkpointing="blocks")``;
FSDP2: ``checkpoint_wrapper(..., CheckpointImpl.NO_REENTRANT)`` around each block before
it is sharded; both run :func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False``, through :func:`rapydli.parallel.recompute.recomputed_call` as
``checkpoint_fn`` on FSDP2's side, so the activation meter counts what both checkpoints hold). Both sides build the same model (:data:`SIZES`) from the same
seed, read the same batches (:func:`rapydli.data.loaders.build_loader` with the
Trainer's seed and shard), take the mean cross-entropy over every position, and step the
same AdamW (``lr`` :data:`LR`, betas ``(0.9, 0.999)``, no weight decay) for ``--steps``
steps.

What each rank measures:

* ``step_s``: the time of each step (batch fetch, forward, backward, gradient
  reduce-scatter, optimizer step, zero_grad), as the Trainer's history records it;
* ``loss``: each step's loss of the global batch (the mean over the ranks);
* ``peak_bytes``: the peak resident memory of the process while it trains, less what it
  held before the model was built (``VmHWM - VmRSS`` of ``/proc/self/status``): the
  high-water mark is reset (``/proc/self/clear_refs``) and freed memory handed back
  (glibc's ``malloc_trim``) once the model is sharded and the optimizer built, so the
  unsharded model both sides build first and then drop is not counted. Memory as the
  operating system sees it: parameters, gradients, optimizer state, activations,
  communication buffers and the allocator's overhead, whoever allocated them on
  whichever thread; the same measure for both sides. Every allocation of 1 MiB or more is
  mapped on its own and unmapped when freed (:func:`_mmap_large`, on both sides and for
  the timed steps too), so the resident memory follows the bytes held rather than what
  glibc's heaps kept; and before the baseline is taken each launch trains the ``tiny``
  size for a step on the same code path, so the modules either side imports lazily
  (FSDP2 brings in ``torch._dynamo``, about 100 MB) are not counted as training memory;
* ``after_bytes``: the resident memory after the last step, less the same baseline (what
  a rank keeps between steps);
* ``activation_bytes``: the peak bytes autograd kept for backward
  (:class:`SavedActivations`: parameters, and views of them, are not activations).

Rank 0 writes every rank's row as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rapydli.parallel.memory import ActivationMeter, _Held
from rapydli.zoo import datasets, models

IMPLEMENTATIONS = ("rapydli", "fsdp2")
LR = 3e-4
SEED = 0
#: glibc's ``mallopt`` parameter, and the size from which every allocation is mapped on its own (:func:`_mmap_large`).
M_MMAP_THRESHOLD, MMAP_BYTES = -3, 1 << 20


@dataclass(frozen=True)
class Size:
    """A bench size: the model's shape (:func:`rapydli.zoo.models.gpt2_style`) and the global batch."""

    vocab: int
    positions: int
    n_embd: int
    n_head: int
    n_layer: int
    global_batch: int

    @property
    def parameters(self) -> int:
        """Parameters of the model (the tied embedding once; the formula of :class:`~rapydli.zoo.models.GPT2Style`)."""
        n, layers = self.n_embd, self.n_layer
        return 12 * layers * n * n + 13 * layers * n + (self.vocab + self.positions + 2) * n

    def model(self) -> nn.Module:
        """The model, from :data:`SEED` (the same on every rank and both sides)."""
        torch.manual_seed(SEED)
        return models.gpt2_style(self.vocab, self.positions, self.n_embd, self.n_head, self.n_layer)

    def data(self, steps: int) -> Any:
        """The training set: ``steps`` global batches of token sequences as long as the model's positions."""
        samples = -(-steps * self.global_batch * 5 // 4) + self.global_batch  # 20 % goes to the validation split
        train, _ = datasets.synthetic_tokens(
            num_samples=samples, block_size=self.positions, vocab_size=self.vocab, seed=SEED
        )
        return train


#: The bench sizes, by name: ``gpt2-63m`` (63.0 M parameters, 4 sequences of 64 tokens a step) and ``tiny`` (for tests).
SIZES = {
    "gpt2-63m": Size(vocab=8192, positions=64, n_embd=768, n_head=12, n_layer=8, global_batch=4),
    "tiny": Size(vocab=256, positions=32, n_embd=64, n_head=4, n_layer=3, global_batch=8),
}


class SavedActivations(ActivationMeter):
    """:class:`~rapydli.parallel.memory.ActivationMeter` for sharded models: a saved parameter is known by its type.

    Sharded parameters live in different storages while a block is gathered (rapydli's
    whole buffers, FSDP2's unsharded parameters), so a parameter, or a view of one (a
    linear layer saves ``weight.t()``), is recognised when it is saved rather than by the
    storages the model had when the meter was built.
    """

    def _pack(self, tensor: torch.Tensor) -> _Held:
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
            return _Held(tensor, self, None)
        return super()._pack(tensor)


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as stream:
        for line in stream:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _settle() -> None:
    """Hand freed memory back to the system and start a new high-water mark (Linux, glibc)."""
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc:
        trim = getattr(ctypes.CDLL(libc), "malloc_trim", None)
        if trim is not None:
            trim(0)
    with open("/proc/self/clear_refs", "w") as stream:
        stream.write("5")


def _mmap_large() -> None:
    """Make glibc map every allocation of :data:`MMAP_BYTES` or more on its own (and unmap it when freed).

    Without it glibc raises its threshold as large blocks are freed and keeps later ones
    in its heaps, which it does not hand back: the resident memory would then say as much
    about its heuristics as about the bytes either side holds.
    """
    libc = ctypes.util.find_library("c")
    mallopt = getattr(ctypes.CDLL(libc), "mallopt", None) if libc else None
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)


def _loader(train: Any, batch: int, world: Any, epochs: int) -> Any:
    """This rank's batches, as the Trainer reads them (its default loader, seed and shard)."""
    from rapydli.data.loaders import build_loader

    return build_loader(
        train, batch_size=batch, rank=world.Get_rank(), world_size=world.Get_size(), seed=SEED, epochs=epochs
    )


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The Trainer's loss on logits: mean cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def run_rapydli(size: Size, steps: int, checkpointing: bool, world: Any) -> dict[str, Any]:
    """Train with ``TrainConfig(zero=3)``; the measurements of this rank."""
    from rapydli.trainer.config import TrainConfig
    from rapydli.trainer.loop import Trainer

    train = size.data(steps)
    config = TrainConfig(
        batch_size=size.global_batch // world.Get_size(),
        optimizer="adamw",
        lr=LR,
        momentum=0.9,
        zero=3,
        allreduce="mpi",
        activation_checkpointing="blocks" if checkpointing else None,
        max_steps=steps,
        epochs=1,
        eval_every=0,
        seed=SEED,
    )
    _settle()
    baseline = _status("VmRSS")
    trainer = Trainer(size.model(), None, train, None, config, comm=world)
    try:
        _settle()
        with SavedActivations() as meter:
            history = trainer.fit()
        peak = _status("VmHWM")
        after = _status("VmRSS")
        units = len(getattr(trainer.optimizer, "units", []))
    finally:
        trainer.close()
    rows = [row for row in history if row["kind"] == "train"]
    return {
        "step_s": [row["step_time_s"] for row in rows],
        "loss": [row["loss"] for row in rows],
        "peak_bytes": peak - baseline,
        "after_bytes": after - baseline,
        "activation_bytes": meter.peak,
        "units": units,
    }


def fsdp2_model(size: Size, checkpointing: bool) -> nn.Module:
    """The model sharded with ``fully_shard`` as torchtitan shards a transformer (see the module's description)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    from rapydli.parallel.recompute import recomputed_call

    model: Any = size.model()
    blocks = model.transformer.h
    for index, block in enumerate(list(blocks)):
        if checkpointing:
            block = blocks[index] = checkpoint_wrapper(
                block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=recomputed_call
            )
        fully_shard(block, reshard_after_forward=index < len(blocks) - 1)
    fully_shard(model)
    return model


def run_fsdp2(size: Size, steps: int, checkpointing: bool, world: Any) -> dict[str, Any]:
    """Train with FSDP2 over gloo (the process group is set up); the measurements of this rank."""
    train = size.data(steps)
    loader = _loader(train, size.global_batch // world.Get_size(), world, epochs=1)
    _settle()
    baseline = _status("VmRSS")
    model = fsdp2_model(size, checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), weight_decay=0.0)
    loader.set_epoch(0)
    batches = iter(loader)
    times, losses = [], []
    _settle()
    with SavedActivations() as meter:
        for _ in range(steps):
            started = time.perf_counter()
            inputs, targets = next(batches)
            loss = _lm_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - started)
            losses.append(world.allreduce(loss.item()) / world.Get_size())
    peak, after = _status("VmHWM"), _status("VmRSS")
    units = sum(1 for module in model.modules() if type(module).__name__.startswith("FSDP"))
    return {
        "step_s": times,
        "loss": losses,
        "peak_bytes": peak - baseline,
        "after_bytes": after - baseline,
        "activation_bytes": meter.peak,
        "units": units,
    }


def measure(impl: str, size: Size, steps: int, checkpointing: bool, world: Any) -> list[dict[str, Any]]:
    """Train one variant on every rank of ``world``; every rank's row, gathered on rank 0."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r}: one of {', '.join(IMPLEMENTATIONS)}")
    run = run_rapydli if impl == "rapydli" else run_fsdp2
    if impl == "fsdp2":
        from rapydli.comm.torchdist import process_group

        process_group(world, "gloo")
    run(
        SIZES["tiny"], 1, checkpointing, world
    )  # the code path's imports and one-time set-up, before any baseline is taken
    row = {
        "impl": impl,
        "checkpointing": checkpointing,
        "ranks": world.Get_size(),
        "rank": world.Get_rank(),
        **run(size, steps, checkpointing, world),
    }
    if impl == "fsdp2":
        import torch.distributed as dist

        dist.destroy_process_group()
    gathered = world.gather(row, root=0)
    return list(gathered) if world.Get_rank() == 0 else []


def main() -> None:
    """Parse the arguments, measure, write rank 0's rows."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=IMPLEMENTATIONS, required=True)
    parser.add_argument("--size", choices=sorted(SIZES), required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from mpi4py import MPI

    torch.set_num_threads(1)
    _mmap_large()
    world = MPI.COMM_WORLD
    rows = measure(args.impl, SIZES[args.size], args.steps, args.checkpointing, world)
    if world.Get_rank() == 0:
        with open(args.out, "w") as stream:
            json.dump(rows, stream)


if __name__ == "__main__":
    main()
