"""Shape-only runs of a model's forward: an input made from the model alone, and the context such a run needs.

The layout checks run a model's forward on PyTorch's ``meta`` device (shapes, no memory,
no arithmetic) to learn what it computes where: which parameters it reads before its
layers (:mod:`rapydli.parallel.skipping`), which linear layers form an MLP
(:mod:`rapydli.parallel.dataflow`), whether a split model still runs
(:mod:`rapydli.parallel.tensor_plans`). :func:`sample_call` makes the input from the model
alone (token ids for a model with an embedding, images of its config's size for one whose
forward takes ``pixel_values``), since these checks run before any data is read.
:func:`shape_only` is what such a run is entered in; :func:`unchanged` keeps a real model as it
was through forwards that measure or check it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def sample_call(model: nn.Module) -> Callable[[nn.Module], Any] | None:
    """``call(copy)`` running a shape-only copy of ``model`` on a made-up batch of two; ``None`` when no input can be made.

    Token ids (two sequences of 4) for a model with an ``nn.Embedding`` (also as the
    decoder's inputs when its forward takes ``decoder_input_ids``); images of
    ``config.image_size`` (32 x 32 without one: a convolutional network takes any size)
    with ``config.num_channels`` for a forward whose first parameter is ``pixel_values``.
    """
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    first = next(iter(parameters), None)
    config = getattr(model, "config", None)
    channels = getattr(config, "num_channels", None)
    if first == "pixel_values" and channels is not None:
        size = getattr(config, "image_size", None) or 32
        height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)

        def images(target: nn.Module) -> Any:
            return target(torch.zeros(2, channels, height, width, dtype=dtype, device="meta"))

        return images
    if not any(isinstance(m, nn.Embedding) for m in model.modules()):
        return None

    def tokens(target: nn.Module) -> Any:
        ids = torch.zeros(2, 4, dtype=torch.long, device="meta")
        return target(ids, **({"decoder_input_ids": ids} if "decoder_input_ids" in parameters else {}))

    return tokens


class _ScalarsOfMeta(TorchDispatchMode):
    """A meta tensor's ``.item()`` (a branch on a value, as an expert router's) reads as zero: the run is for shapes only."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return False if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def shape_only() -> Iterator[None]:
    """What a shape-only forward runs in: outside any recording of the model's construction (whose part it is not), a
    mixture of experts' routing (``nonzero``) sending every token to every expert, values read as zero."""
    from torch.fx.experimental import _config as fx_config
    from torch.utils._python_dispatch import _disable_current_modes

    patched = fx_config.patch(meta_nonzero_assume_all_nonzero=True)  # type: ignore[attr-defined]
    with _disable_current_modes(), patched, _ScalarsOfMeta():
        yield


@contextlib.contextmanager
def unchanged(model: nn.Module) -> Iterator[None]:
    """Forwards run inside leave ``model`` as they found it: its buffers (BatchNorm's running statistics) are restored
    afterwards and the random state (dropout) is forked, so a measurement or a check is no training step."""
    saved = [(buffer, buffer.detach().clone()) for buffer in model.buffers() if not buffer.is_meta]
    devices = sorted({b.device.index or 0 for b, _ in saved if b.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
