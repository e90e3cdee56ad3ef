"""The per-rank half of ``rapydli bench parallel``'s memory part (run under ``mpiexec`` by :mod:`rapydli.bench.parallel`).

For each layout given (``--variants``: a JSON list of ``{"name", "config"}``, the
``TrainConfig`` of the layout), every rank trains the bench model for ``--steps`` steps with
the :class:`~rapydli.trainer.loop.Trainer` and measures what it holds:

* right after the optimizer step (parameters, gradients and optimizer state all held,
  activations gone), the storages of the parameters the rank trains, of their gradients
  and of the optimizer's state (``model_state_bytes``, what the ZeRO formula counts), and
  ``total_bytes``: every tensor storage alive in the process, the training and validation
  sets' own left out (found through the garbage collector: every tensor object Python
  holds), each counted
  once however many tensors view it, the other ranks' segments of node-shared gradient
  buckets left out (mapped here, but held by their owners); with ZeRO-2 that includes the
  last whole gradient bucket reduce-scattered and its output, still held after the step
  (``in_flight_bytes``: the most whole buckets held at once during backward);
* ``activation_bytes``: the peak bytes autograd kept for backward during the run
  (:class:`~rapydli.parallel.memory.ActivationMeter`).

Rank 0 writes every rank's rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
from collections.abc import Callable, Iterable
from typing import Any

import torch
from mpi4py import MPI

from rapydli.parallel.memory import ActivationMeter
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.loop import Trainer
from rapydli.zoo import datasets, models

#: The bench's model and data (importable, so engines and ranks build the same).
VOCAB = 256
bench_model: Callable[[], torch.nn.Module] = functools.partial(
    models.tiny_lm, vocab_size=VOCAB, block_size=32, dim=128, layers=4, heads=4
)
bench_data: Callable[[], Any] = functools.partial(
    datasets.synthetic_tokens, num_samples=1024, block_size=32, vocab_size=VOCAB
)
#: The models the step-time part can plan and run (``--model``), as ``(model_fn, data_fn)``: ``tiny_lm`` (the one above),
#: and the GPT-2-style (fused ``c_attn`` Conv1D, tied embedding) and Llama-style (GQA, SwiGLU) models at the ``--peers``
#: bench's ``bench`` size (vocabulary 2048, 64 positions, width 256, 4 blocks).
TIME_MODELS: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any]]] = {
    "tiny_lm": (bench_model, bench_data),
    "gpt2": (
        functools.partial(models.gpt2_style, vocab=2048, positions=64, n_embd=256, n_head=8, n_layer=4),
        functools.partial(datasets.synthetic_tokens, num_samples=1024, block_size=64, vocab_size=2048),
    ),
    "llama": (
        functools.partial(models.llama_style, vocab=2048, hidden=256, heads=8, kv_heads=4, intermediate=704, layers=4),
        functools.partial(datasets.synthetic_tokens, num_samples=1024, block_size=64, vocab_size=2048),
    ),
}


def _storages(tensors: Iterable[Any]) -> dict[int, int]:
    found: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.is_sparse:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr():
            found[storage.data_ptr()] = max(found.get(storage.data_ptr(), 0), storage.nbytes())
    return found


def state_bytes(trainer: Trainer, excluded: set[int]) -> dict[str, int]:
    """Bytes of live tensor storages (see the module's description): in all, and the model states by kind.

    ``parameters``: the storages of the parameters this rank trains; ``gradients``: of their
    ``.grad`` (with ZeRO, also of the gradients of its slices); ``optimizer``: of the optimizer's state (a ZeRO optimizer's own, over its
    shard); ``total``: every live storage but ``excluded`` and the other ranks' segments of
    node-shared buffers (:meth:`rapydli.comm.shm.SharedBuffers.peer_views`: mapped here,
    held in memory by their owners).
    """
    model = trainer.model
    inner: Any = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # a ShardedOptimizer's own
    trained = [
        p for group in inner.param_groups for p in group["params"]
    ]  # ZeRO: views of this rank's slices, their gradients its shard
    kinds = {
        "parameters": _storages(model.parameters()),
        "gradients": _storages(p.grad for p in [*model.parameters(), *trained] if p.grad is not None),
        "optimizer": _storages(value for values in inner.state.values() for value in values.values()),
    }
    from rapydli.comm.shm import SharedBuffers

    objects = gc.get_objects()
    peers = {pointer for o in objects if isinstance(o, SharedBuffers) for pointer in _storages(o.peer_views())}
    everything = {pointer: nbytes for pointer, nbytes in _storages(objects).items() if pointer not in peers}
    for found in kinds.values():
        everything.update(found)
    sizes = {kind: sum(found.values()) for kind, found in kinds.items()}
    sizes["total"] = sum(nbytes for pointer, nbytes in everything.items() if pointer not in excluded)
    return sizes


class PeakAfterStep:
    """Calls the trainer's optimizer step, then records :func:`state_bytes` (those of the largest total in :attr:`peak`)."""

    def __init__(self, trainer: Trainer, excluded: set[int]) -> None:
        self.trainer, self.excluded, self.step = trainer, excluded, trainer.optimizer.step
        self.peak: dict[str, int] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.step(*args, **kwargs)
        sizes = state_bytes(self.trainer, self.excluded)
        if sizes["total"] > self.peak.get("total", -1):
            self.peak = sizes
        return result


def memory_rows(world: Any, variants: list[dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Each variant's measured bytes on this rank, gathered on rank 0."""
    train, val = bench_data()
    excluded = set(
        _storages([*train.tensors, *(val.tensors if val is not None else ())])
    )  # the bench's data, not the layout's
    rows = []
    for variant in variants:
        config = TrainConfig.from_dict({**variant["config"], "max_steps": steps, "epochs": steps, "eval_every": 0})
        gc.collect()
        torch.manual_seed(config.seed)
        trainer = Trainer(bench_model(), None, train, None, config, comm=world)
        peak = PeakAfterStep(trainer, excluded)
        trainer.optimizer.step = peak  # type: ignore[method-assign]
        try:
            with ActivationMeter(trainer.model.parameters()) as meter:
                trainer.fit()
        finally:
            trainer.close()
        parameters = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        sizes = peak.peak
        in_flight = getattr(
            trainer.optimizer, "peak_gradient_buffer_bytes", 0
        )  # ZeRO-2: the most whole buckets held during backward
        rows.append(
            {
                "part": "memory",
                "variant": variant["name"],
                "rank": world.Get_rank(),
                "total_bytes": sizes["total"],
                "in_flight_bytes": in_flight,
                "model_state_bytes": sizes["parameters"] + sizes["gradients"] + sizes["optimizer"],
                "gradient_bytes": sizes["gradients"],
                "optimizer_bytes": sizes["optimizer"],
                "activation_bytes": meter.peak,
                "parameter_bytes": parameters,
            }
        )
        del trainer, meter, peak
    gathered = world.gather(rows, root=0)
    return [row for part in gathered for row in part] if world.Get_rank() == 0 else []


def main() -> None:
    """Parse the arguments, measure, write rank 0's rows."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True, help="JSON list of {name, config}")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rows = memory_rows(world, json.loads(args.variants), args.steps)
    if world.Get_rank() == 0:
        with open(args.out, "w") as stream:
            json.dump(rows, stream)


if __name__ == "__main__":
    main()
