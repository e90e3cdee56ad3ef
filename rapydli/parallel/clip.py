"""Clipping the gradient by the global norm of a model spread over pipeline stages, tensor shards and ZeRO-2 slices.

The norm is that of the whole model's gradient: every rank adds the squares of the
gradients it holds, each element counted once: a tensor-parallel shard on every tensor
rank (each holds a different part), a parameter every tensor rank holds whole (norms,
embeddings, a row-parallel bias) only on tensor rank 0, and a parameter several stages
hold (tied embeddings, :mod:`rapydli.parallel.shared`) only on the first of them. Without ZeRO-2 the ranks of a
replica (``grid.model``) sum their squares; the replicas hold the same averaged gradients,
so they compute the same norm without talking. With ZeRO-2 a rank holds only its slices
of the averaged gradients (:meth:`~rapydli.parallel.zero.ShardedOptimizer.gradient_pieces`),
and the squares are summed over every rank (``grid.world``, or the data-parallel group
without a grid), where the replicas' slices add up to each gradient once.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from rapydli.parallel.tensor import sharded_parameters


def clip_grad_norm_(model: nn.Module, max_norm: float, grid: Any = None, zero: Any = None) -> float:
    """Scale the gradients in place so their global norm is at most ``max_norm``; returns the norm before.

    ``grid`` and ``zero`` ``None``: :func:`torch.nn.utils.clip_grad_norm_` over ``model``
    (it is whole on this rank). ``zero``: a stage-2
    :class:`~rapydli.parallel.zero.ShardedOptimizer` holding the gradients, after its
    ``wait()``. Otherwise, and with ``zero``, collective over the ranks that hold parts of
    the gradient.
    """
    if grid is None and zero is None:
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
    if zero is not None:
        grads = zero.gradient_pieces()
        group = grid.world if grid is not None else zero.comm
    else:
        grads = [(p, p.grad) for p in model.parameters() if p.grad is not None]
        group = grid.model
    sharded = sharded_parameters(model)
    elsewhere: frozenset[int] = getattr(
        model, "counted_elsewhere", frozenset()
    )  # a pipeline Stage's copies of an earlier stage's parameters
    counted = [
        g for p, g in grads if (grid is None or id(p) in sharded or grid.tensor_rank == 0) and id(p) not in elsewhere
    ]
    local = sum(float(g.detach().double().pow(2).sum()) for g in counted)
    total = math.sqrt(group.allreduce(local))
    factor = max_norm / (total + 1e-6)
    if factor < 1.0:
        for _, g in grads:
            g.detach().mul_(factor)
    return total
