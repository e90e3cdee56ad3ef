"""Activation checkpointing: blocks whose activations are recomputed in backward instead of kept.

``TrainConfig(activation_checkpointing=...)``:

* ``None``: every activation backward needs is kept from the forward (the default);
* ``"blocks"``: every block of the model (:func:`rapydli.parallel.split.model_blocks`: a
  transformer's layers, an ``nn.Sequential``'s items) keeps only its inputs; its forward
  runs again in backward;
* ``"every_k:N"``: blocks ``0, N, 2N, ...`` are recomputed, the others keep their
  activations (torchtitan's selective checkpointing "every N layers"); blocks are counted
  from the model's first (GPT-2-style: ``h.0``; Llama-style: ``embed_tokens``).

A chosen block's forward runs under :func:`torch.utils.checkpoint.checkpoint` with
``use_reentrant=False`` and ``preserve_rng_state=True``: the recomputation draws the same
random numbers as the first forward (dropout masks are the same), and BatchNorm layers in
the block normalise with the batch's statistics again without updating their running
statistics a second time (their running statistics are put back as they were after the recomputation),
so gradients, parameters and buffers are bit-equal to not recomputing. Under
``torch.no_grad`` (evaluation) the block runs as it is. Composes with every layout: pipeline stages share the model's blocks,
tensor-parallel layers are replaced inside them, and ZeRO-3 gathers a block before its
backward (which is when it is recomputed).

Examples
--------
>>> from rapydli.parallel.config import checkpoint_interval
>>> checkpoint_interval("every_k:3"), checkpoint_interval("blocks"), checkpoint_interval(None)
(3, 1, None)
>>> checkpoint_interval("every_k:0")
Traceback (most recent call last):
...
rapydli.errors.ConfigError: TrainConfig.activation_checkpointing='every_k:0' is invalid: must be None, 'blocks' or 'every_k:N' with N a positive integer
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rapydli.parallel.config import checkpoint_interval


def checkpoint_blocks(model: nn.Module, value: str | None) -> list[str]:
    """Make the blocks ``value`` chooses recompute their activations in backward; the names of those blocks.

    Idempotent: a block already recomputed is left as it is.
    """
    from rapydli.parallel.split import model_blocks

    every = checkpoint_interval(value)
    if every is None:
        return []
    chosen = [(name, block) for index, (name, block) in enumerate(model_blocks(model)) if index % every == 0]
    for _, block in chosen:
        if getattr(block.forward, "__func__", None) is not _recomputed_forward:
            block.forward = types.MethodType(_recomputed_forward, block)  # a bound method: a deep copy of the model rebinds it
    return [name for name, _ in chosen]


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, run under a non-reentrant checkpoint while autograd records."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    contexts = functools.partial(_contexts, self)
    return checkpoint(forward, self, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)


def _contexts(module: nn.Module) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
    """What the first forward runs in (nothing) and what the recomputation runs in (running statistics left alone)."""
    return contextlib.nullcontext(), _statistics_kept(module)


@contextlib.contextmanager
def _statistics_kept(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``module`` keep the running statistics they had (the first forward updated them already)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None] for m in norms]
    try:
        yield
    finally:
        for norm, saved in zip(norms, kept):
            for buffer, value in zip([b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None], saved):
                buffer.copy_(value)
