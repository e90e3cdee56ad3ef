"""Sharded optimizer state (ZeRO stages 1 and 2) over the data-parallel group.

Every rank keeps the whole model but only ``1 / N`` of the optimizer state: the
parameters are laid end to end in one flat vector per dtype, rank ``r`` owns the ``r``-th
equal slice, and its optimizer is built over that slice alone. A step:

1. gradients: stage 1 takes the gradients already averaged over the group (the
   ``GradientSynchronizer``'s allreduce) and keeps its slice; stage 2 reduce-scatters the
   flat gradient (``MPI.Reduce_scatter_block``), so each rank only ever holds the sum of
   its own slice;
2. the optimizer updates the owned slice (Adam's moments, SGD's momentum: elementwise,
   so a slice updates exactly as the same elements of the whole would);
3. the updated slices are allgathered into every rank's parameters.

Optimizer-state bytes per rank are the unsharded ones divided by ``N`` (plus at most one
element of padding per rank). Gradient clipping by global norm is the caller's, before
:meth:`ShardedOptimizer.step`.

Examples
--------
On every rank::

    optimizer = ShardedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), MPI.COMM_WORLD, stage=2)
    loss.backward()          # no synchronizer at stage 2: step() reduce-scatters
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from rapydli.errors import ConfigError

STAGES = (1, 2)


class _Flat:
    """Parameters of one dtype laid end to end, padded to a multiple of the group size."""

    def __init__(self, params: list[nn.Parameter], size: int, rank: int) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // size)  # elements per rank
        self.start = rank * self.shard
        dtype = params[0].dtype
        self.values = torch.zeros(self.shard * size, dtype=dtype)
        self.grads = torch.zeros(self.shard * size, dtype=dtype)
        self.gather_values()
        self.owned = nn.Parameter(self.values[self.start : self.start + self.shard].clone())

    def gather_values(self) -> None:
        torch.cat([p.detach().reshape(-1).cpu() for p in self.params], out=self.values[: self.numel])

    def gather_grads(self) -> None:
        parts = [p.grad.reshape(-1).cpu() if p.grad is not None else torch.zeros(p.numel(), dtype=p.dtype) for p in self.params]
        torch.cat(parts, out=self.grads[: self.numel])

    def scatter_values(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(self.values[offset : offset + p.numel()].view_as(p))
                offset += p.numel()


class ShardedOptimizer:
    """An optimizer whose state is split across the ranks of ``comm`` (ZeRO stage 1 or 2).

    Parameters
    ----------
    params
        The model's parameters (the same on every rank).
    build
        ``build(params) -> torch.optim.Optimizer``: the optimizer to run on this rank's slice
        (``lambda ps: torch.optim.AdamW(ps, lr=...)``); one parameter group.
    comm
        The data-parallel group (mpi4py).
    stage
        1: gradients come in averaged (keep using the synchronizer); 2: :meth:`step`
        reduce-scatters the ranks' gradients itself (no synchronizer).

    Attributes
    ----------
    optimizer
        The inner optimizer over this rank's slices; ``param_groups`` is its groups, so a
        learning-rate schedule sets ``lr`` as for any optimizer.
    """

    def __init__(self, params: Iterable[nn.Parameter], build: Callable[[list[nn.Parameter]], torch.optim.Optimizer], comm: Any,
                 stage: int = 1) -> None:  # fmt: skip
        if stage not in STAGES:
            raise ConfigError(f"zero={stage!r} is invalid: one of {', '.join(map(str, STAGES))}")
        self.comm, self.stage = comm, stage
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            if p.requires_grad:
                by_dtype.setdefault(p.dtype, []).append(p)
        self.flats = [_Flat(group, self.size, self.rank) for group in by_dtype.values()]
        self.optimizer = build([flat.owned for flat in self.flats])
        self.param_groups = self.optimizer.param_groups

    def step(self) -> None:
        """Reduce (stage 2) or take (stage 1) this rank's gradient slice, update it, allgather the parameters."""
        for flat in self.flats:
            flat.gather_grads()
            mine = torch.empty(flat.shard, dtype=flat.grads.dtype)
            if self.stage == 2:
                self.comm.Reduce_scatter_block(flat.grads.numpy(), mine.numpy(), op=MPI.SUM)
                mine /= self.size
            else:
                mine.copy_(flat.grads[flat.start : flat.start + flat.shard])
            flat.owned.grad = mine
        self.optimizer.step()
        for flat in self.flats:
            self.comm.Allgather(flat.owned.detach().numpy(), flat.values.numpy())
            flat.scatter_values()

    def refresh(self) -> None:
        """Take the parameters' current values into this rank's slices (after the model was loaded or broadcast)."""
        with torch.no_grad():
            for flat in self.flats:
                flat.gather_values()
                flat.owned.copy_(flat.values[flat.start : flat.start + flat.shard])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the slices')."""
        for flat in self.flats:
            flat.owned.grad = None
            for p in flat.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments, momentum buffers, step counters)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, with the layout it belongs to (a sharded checkpoint)."""
        return {"zero": self.stage, "world_size": self.size, "rank": self.rank, "numel": [f.numel for f in self.flats],
                "optimizer": self.optimizer.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a shard written by :meth:`state_dict` on the same number of ranks (refused otherwise)."""
        if state["world_size"] != self.size or state["numel"] != [f.numel for f in self.flats]:
            raise ConfigError(
                f"this sharded optimizer state was written by {state['world_size']} ranks over {state['numel']} elements; "
                f"this run has {self.size} ranks over {[f.numel for f in self.flats]}: resume a zero={state['zero']} "
                "checkpoint on the same number of ranks and the same model"
            )
        self.optimizer.load_state_dict(state["optimizer"])
