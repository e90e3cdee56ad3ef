"""Clipping the gradient by the global norm of a model spread over pipeline stages and tensor shards.

The norm is that of the whole model's gradient: every rank of a replica (``grid.model``)
adds the squares of the gradients it holds, each element counted once: a tensor-parallel
shard on every tensor rank (each holds a different part), a parameter every tensor rank
holds whole (norms, embeddings, a row-parallel bias) only on tensor rank 0. The replicas
hold the same averaged gradients, so they compute the same norm without talking.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rapydli.parallel.tensor import sharded_parameters


def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Any = None) -> float:
    """Scale ``model``'s gradients in place so their global norm is at most ``max_norm``; returns the norm before.

    ``grid`` ``None``: :func:`torch.nn.utils.clip_grad_norm_` over ``model`` (it is whole
    on this rank). Otherwise collective over ``grid.model``.
    """
    if grid is None:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    sharded = sharded_parameters(model)
    grads = [(id(p), p.grad) for p in model.parameters() if p.grad is not None]
    local = sum(float(g.detach().double().pow(2).sum()) for key, g in grads if key in sharded or grid.tensor_rank == 0)
    total = math.sqrt(grid.model.allreduce(local))
    factor = max_norm / (total + 1e-6)
    if factor < 1.0:
        for _, g in grads:
            g.detach().mul_(factor)
    return total
