"""Checks of a layout against the model, on the client, before any engine works.

A pipelined or tensor-parallel config can be wrong for a model in ways the config alone
does not show: the model computes its own loss inside ``forward`` (a pipeline never calls
that ``forward``), its split points do not exist, a tied weight cannot stay one
parameter, a tensor plan names no module or cannot split one. The ranks find each of
these too, but after the cluster started and once per rank; :func:`check_layout` builds
the model once on PyTorch's ``meta`` device (shapes only, no memory, no arithmetic) and
raises the same :class:`~rapydli.errors.ConfigError` here, once.

A ``model_fn`` that moves its model to a device (``.to("cuda")``, ``.cuda()``, a tensor
made with ``device="cuda"``) is built on the meta device all the same, and the device it
asked for is recorded (:func:`meta_build`: the memory check counts an offloaded optimizer
as off a GPU). One that cannot build on the meta device (it loads weights, reads data) is
not checked here; the ranks check it as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rapydli.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.parallel.layout import Layout
    from rapydli.parallel.settings import LayoutSettings


@dataclass(frozen=True)
class MetaBuild:
    """A model built on the meta device, and the device its ``model_fn`` put it on (``cpu`` if it did not move it)."""

    model: nn.Module
    device: torch.device


class _KeptOnMeta(TorchFunctionMode):
    """Keeps a ``model_fn``'s tensors on the meta device through its moves, and records the last device it asked for.

    ``Tensor.to(device, ...)`` and ``Tensor.cuda()`` (what ``Module.to`` and
    ``Module.cuda`` call for each tensor) return the meta tensor, converted to a dtype
    asked for; a ``device=`` argument of a tensor factory is replaced by ``meta``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.device = torch.device("cpu")

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            index = args[1] if len(args) > 1 else kwargs.get("device")
            self.device = (
                torch.device("cuda")
                if index is None
                else torch.device("cuda", index)
                if isinstance(index, int)
                else torch.device(index)
            )
            return args[0]
        if func is torch.Tensor.to:
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type != "meta":
                self.device = device
            return args[0] if dtype is None or dtype == args[0].dtype else func(args[0], dtype)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "meta":
            self.device = torch.device(kwargs["device"])
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def meta_build(model_fn: Callable[[], Any]) -> MetaBuild | None:
    """``model_fn()`` built on the meta device (the caller's random state untouched) and the device it asked for, or ``None`` if it cannot be."""
    moves = _KeptOnMeta()
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"), moves:
            model = model_fn()
    except Exception:  # noqa: BLE001 - any model_fn the meta device cannot run is checked on the ranks instead
        return None
    return MetaBuild(model, moves.device) if isinstance(model, nn.Module) else None


def meta_model(model_fn: Callable[[], Any]) -> nn.Module | None:
    """``model_fn()`` built on the meta device (see :func:`meta_build`), or ``None`` if it cannot be."""
    built = meta_build(model_fn)
    return None if built is None else built.model


def check_layout(
    model_fn: Callable[[], Any], config: LayoutSettings, loss_fn: Any = None, *, layout: Layout | None = None
) -> None:
    """Raise :class:`ConfigError` if ``config``'s pipeline or tensor layout cannot train ``model_fn``'s model.

    Checks, in order: a model that takes its targets in ``forward`` with no ``loss_fn``
    under ``pipeline_stages > 1`` (the message names the ``loss_fn`` to pass); BatchNorm
    with micro-batches (:func:`check_batch_norm`); the model
    can be split and an explicit ``pipeline_split`` names its blocks; parameters shared
    across those stages can stay one parameter (:func:`~rapydli.parallel.shared.check_honoured`);
    the tensor plan (given, or the built-in one) splits the model. Does nothing for a
    data-parallel config or a model that cannot be built on the meta device. The degrees
    are ``layout``'s, the run's (default: made from ``config`` for the ranks one replica needs).
    """
    from rapydli.parallel.layout import Layout

    layout = layout or Layout.of(config, config.workers or config.pipeline_stages * config.tensor_parallel)
    if not (layout.uses_pipeline or layout.uses_tensor_parallel):
        return
    model = meta_model(model_fn)
    if model is None:
        return
    if layout.uses_pipeline:
        check_own_loss(model, layout.pipeline_stages, loss_fn)
        check_batch_norm(model, layout.pipeline_stages, config.microbatches)
    plan = None
    if layout.uses_tensor_parallel:
        from rapydli.parallel.config import tensor_plan
        from rapydli.parallel.tensor_plans import check_plan, plan_for

        plan = tensor_plan(config.tensor_plan) or plan_for(model, layout.tensor_parallel)
        check_plan(model, plan, layout.tensor_parallel)
    if layout.uses_pipeline:
        from rapydli.objective import target_parameter
        from rapydli.parallel import split
        from rapydli.parallel.config import split_names
        from rapydli.parallel.shared import check_honoured, find_shared

        split.pipeline_blocks(
            model, target_parameter(model) if loss_fn is None else None
        )  # a model that cannot be split says so
        points = split_names(config.pipeline_split)
        if points != "auto":
            bounds = split.boundaries(model, points, layout.pipeline_stages)
            check_honoured(find_shared(model, bounds), model, layout.zero, plan)
        else:  # balanced on the engines; whether every stage can hold parameters is known here
            split.check_stage_count(split.holds_parameters(model), layout.pipeline_stages)
            blocks = len(split.pipeline_blocks(model, target_parameter(model) if loss_fn is None else None))
            try:  # a parameter two blocks share may fall on two stages, wherever the engines cut
                check_honoured(find_shared(model, list(range(blocks + 1))), model, layout.zero, plan)
            except ConfigError as exc:
                raise ConfigError(
                    f"with pipeline_split='auto' (the stages are cut on the engines; stage numbers below count blocks): {exc}"
                ) from None


def check_own_loss(model: nn.Module, stages: int, loss_fn: Any) -> None:
    """Raise :class:`ConfigError` for a model that computes its own loss from its targets, pipelined where it cannot be.

    A model that lists its blocks (``pipeline_blocks()``) never runs its ``forward`` in a
    pipeline, so the loss written there cannot run; the message gives the one-line fix
    (:meth:`rapydli.objective.Objective.check_pipelined`). A traced model keeps its loss
    in its last block.
    """
    from rapydli.objective import Objective
    from rapydli.parallel.split import lists_blocks

    Objective(model, loss_fn).check_pipelined(model, stages, traced=not lists_blocks(model))


def check_batch_norm(model: nn.Module, stages: int, microbatches: int) -> None:
    """Raise :class:`ConfigError` for BatchNorm in a pipeline that cuts the batch into micro-batches.

    A pipeline runs each micro-batch through the stages separately, so BatchNorm would
    normalise over ``batch_size / microbatches`` samples where data parallelism (and one
    process) normalises over the replica's batch. With ``microbatches=1`` it sees the
    replica's batch, and its statistics are averaged over the replicas as without a
    pipeline; tensor parallelism keeps norms whole on every tensor rank, which see the
    same activations.
    """
    if microbatches == 1:
        return
    norms = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if norms:
        more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
        raise ConfigError(
            f"{type(model).__name__} has BatchNorm ({norms[0]!r}{more}): with pipeline_stages={stages} and microbatches={microbatches} it "
            f"would normalise each micro-batch (batch_size / {microbatches} samples), not the replica's batch as data parallelism does. "
            "Set microbatches=1, or use GroupNorm / LayerNorm"
        )
