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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from rapydli.parallel.config import checkpoint_interval
from rapydli.parallel.memory import CheckpointedBlock, current_meter


def checkpoint_blocks(model: nn.Module, value: str | None) -> list[str]:
    """Make the blocks ``value`` chooses recompute their activations in backward; the names of those blocks.

    Idempotent: a block already recomputed is left as it is.
    """
    from rapydli.parallel.split import model_blocks

    every = checkpoint_interval(value)
    if every is None:
        return []
    chosen = [(name, block) for index, (name, block) in enumerate(model_blocks(model)) if index % every == 0]
    _no_cache(model)
    for _, block in chosen:
        if getattr(block.forward, "__func__", None) is not _recomputed_forward:
            block.forward = types.MethodType(
                _recomputed_forward, block
            )  # a bound method: a deep copy of the model rebinds it
    return [name for name, _ in chosen]


def _no_cache(model: nn.Module) -> None:
    """Turn off a ``transformers`` model's key/value cache (``config.use_cache``), as its own ``gradient_checkpointing_enable`` does.

    The cache is appended to by every forward of a block, so a recomputed block would see
    twice the keys it saw the first time (a shape error, or other values). Training never
    reads it; generation after training turns it back on with ``model.config.use_cache = True``.
    """
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False  # type: ignore[union-attr]


def _recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward, run under a non-reentrant checkpoint while autograd records."""
    forward = type(self).forward
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    return recomputed_call(forward, self, *args, recompute_context=functools.partial(_statistics_kept, self), **kwargs)


def recomputed_call(
    function: Callable[..., Any],
    *args: Any,
    recompute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """``function(*args, **kwargs)`` under :func:`torch.utils.checkpoint.checkpoint` (``use_reentrant=False``,
    ``preserve_rng_state=True``), its recomputation inside ``recompute_context()``; while an
    :class:`~rapydli.parallel.memory.ActivationMeter` is entered, it counts what the checkpoint holds
    (the inputs, and what the recomputation saves). Also a ``checkpoint_fn`` for PyTorch's ``checkpoint_wrapper``."""
    kwargs.pop("use_reentrant", None)  # checkpoint_wrapper passes its own; only the non-reentrant kind is counted
    meter = current_meter()
    counted = meter.checkpointed([*args, *kwargs.values()]) if meter is not None else None
    contexts = functools.partial(_contexts, recompute_context, counted)
    output = checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)
    if counted is not None:
        counted.held_until_backward(output)
    return output


def _contexts(
    recompute_context: Callable[[], contextlib.AbstractContextManager[Any]] | None, counted: CheckpointedBlock | None
) -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """What the first forward and the recomputation run in: ``recompute_context()`` for the recomputation,
    and the meter's counting of both when one is entered."""
    again = recompute_context() if recompute_context is not None else contextlib.nullcontext()
    if counted is None:
        return contextlib.nullcontext(), again
    return counted.first_forward(), _both(counted.recomputation(), again)


@contextlib.contextmanager
def _both(
    first: contextlib.AbstractContextManager[None], second: contextlib.AbstractContextManager[None]
) -> Iterator[None]:
    with first, second:
        yield


@contextlib.contextmanager
def _statistics_kept(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``module`` keep the running statistics they had (the first forward updated them already)."""
    norms = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    kept = [[b.clone() for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None] for m in norms]
    try:
        yield
    finally:
        for norm, saved in zip(norms, kept):
            for buffer, value in zip(
                [b for b in (norm.running_mean, norm.running_var, norm.num_batches_tracked) if b is not None], saved
            ):
                buffer.copy_(value)
