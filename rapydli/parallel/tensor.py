"""Tensor parallelism, Megatron style: linear layers split across the ranks of a group.

A :class:`ColumnParallelLinear` keeps ``out_features / size`` rows of the weight: its
input passes through ``f`` (identity forward, allreduce of the input gradient backward)
and its output stays split along the last dimension. A :class:`RowParallelLinear` keeps
``in_features / size`` columns: it takes the split input, and ``g`` (allreduce forward,
identity backward) sums the partial outputs before the bias. A column layer followed by a
row layer (an MLP, or attention's fused ``qkv`` and output projection with the heads
split) costs one allreduce forward and one backward.

:func:`parallelize` swaps the layers of a dense model in place, in the spirit of torch's
``parallelize_module``: a plan maps module names (glob patterns) to ``"column"``,
``"row"`` or ``"heads"``. A linear layer is an ``nn.Linear`` or Hugging Face's ``Conv1D``
(weight stored ``(in, out)``; :func:`linear_weight`). ``"heads"`` splits an attention
module into whole heads per rank: a fused ``qkv``/``c_attn`` projection per head (q, k
and v blocks each), or separate ``q_proj``/``k_proj``/``v_proj`` with grouped-query
attention (each rank keeps ``heads / size`` query heads and the ``kv_heads / size``
key/value heads they read), the output projection row-parallel, and the module's head
counts (and ``split_size``) divided. Each rank keeps its slice of the dense weights, so a
parallelized model computes what the dense one does. Built-in plans by model structure
and the shape-only check of a plan are in :mod:`rapydli.parallel.tensor_plans`.

Examples
--------
On every rank of a 2-rank group::

    group = TensorGroup(MPI.COMM_WORLD)
    block = parallelize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), {"0": "column", "2": "row"}, group)
    y = block(x)                      # equals the dense block's output on every rank

Training reaches this through ``TrainConfig(tensor_parallel=2, tensor_plan=...)``: the
Trainer calls :func:`shard_model` with the tensor-parallel communicator of its
:class:`~rapydli.parallel.grid.ProcessGrid`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from rapydli.errors import ConfigError
from rapydli.parallel.config import TENSOR_STYLES as STYLES


class TensorGroup:
    """The ranks that share one layer's weights, over an mpi4py communicator.

    Attributes
    ----------
    rank, size
        This rank in the group and the group's size.
    allreduces
        ``{"forward": n, "backward": n}``: the allreduces done so far in each direction.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.allreduces = {"forward": 0, "backward": 0}

    def allreduce(self, tensor: torch.Tensor, direction: str) -> torch.Tensor:
        """The sum of ``tensor`` over the group (a new tensor), counted under ``direction``."""
        self.allreduces[direction] += 1
        if self.size == 1:
            return tensor
        summed = tensor.detach().contiguous().cpu().clone()
        self.comm.Allreduce(MPI.IN_PLACE, summed.numpy(), op=MPI.SUM)
        return summed.to(tensor.device)


class _CopyToGroup(torch.autograd.Function):
    """``f``: identity forward; the input gradient is summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.allreduce(grad, "backward"), None


class _ReduceFromGroup(torch.autograd.Function):
    """``g``: the partial outputs are summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        return group.allreduce(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ConfigError(f"{what}={size} does not split over tensor_parallel={parts}: it must be a multiple of {parts}")
    return size // parts


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight as (out, in), bias)`` of a linear layer, or ``None`` if ``module`` is not one.

    A linear layer is an ``nn.Linear`` or Hugging Face's ``Conv1D`` (GPT-2), which stores
    its weight transposed, ``(in, out)``, and computes ``x @ W + b``.
    """
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(weight, torch.Tensor) and weight.ndim == 2 and getattr(module, "nf", None) == weight.shape[1]:
        return weight.t(), getattr(module, "bias", None)
    return None


class ColumnParallelLinear(nn.Module):
    """``y[..., shard] = x @ W[shard].T + b[shard]``: this rank's slice of the output features.

    ``chunks`` > 1 splits each of that many equal blocks of the output features (a fused
    ``qkv`` projection: every rank keeps its heads of q, of k and of v). The weight is
    kept ``(out, in)`` whatever the dense layer stored.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TensorGroup, chunks: int = 1) -> None:
        super().__init__()
        self.group, self.chunks = group, chunks
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Module, group: TensorGroup, chunks: int = 1, name: str = "") -> ColumnParallelLinear:
        """This rank's rows of ``linear``'s weight (and bias); ``linear`` as :func:`linear_weight` reads it."""
        weight, bias = _dense(linear, name, "column")
        block = _split(weight.shape[0], chunks, f"{name or 'the layer'}: out_features / chunks")
        rows = _split(block, group.size, f"{name or 'the layer'}: out_features")
        index = torch.cat([torch.arange(c * block + group.rank * rows, c * block + (group.rank + 1) * rows) for c in range(chunks)])
        kept = bias.detach()[index].clone() if bias is not None else None
        return cls(weight.detach()[index].clone(), kept, group, chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x[..., shard] @ W[:, shard].T``, plus the (whole) bias once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TensorGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Module, group: TensorGroup, name: str = "") -> RowParallelLinear:
        """This rank's columns of ``linear``'s weight; the bias is kept whole."""
        weight, bias = _dense(linear, name, "row")
        columns = _split(weight.shape[1], group.size, f"{name or 'the layer'}: in_features")
        kept = weight.detach()[:, group.rank * columns : (group.rank + 1) * columns].clone()
        return cls(kept, bias.detach().clone() if bias is not None else None, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


#: What each style splits, for messages.
ALLOWED = (
    "'column' / 'row' for a linear layer (nn.Linear, Hugging Face's Conv1D); 'heads' for an attention module with a "
    "fused qkv / c_attn and proj / c_proj, or q_proj, k_proj, v_proj, o_proj (wq, wk, wv, wo), and a head count "
    "attribute (heads, n_head, num_heads)"
)
#: Attention layouts ``heads`` splits: fused (one q/k/v projection, output projection) or separate (q, k, v, output).
FUSED_ATTENTION = (("qkv", "proj"), ("c_attn", "c_proj"))
SEPARATE_ATTENTION = (("q_proj", "k_proj", "v_proj", "o_proj"), ("wq", "wk", "wv", "wo"))
#: Attributes holding an attention module's query-head and key/value-head counts, and widths its forward splits by (all divided by the group's size).
HEAD_COUNTS = ("heads", "n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_heads", "kv_heads", "n_kv_head")
SPLIT_WIDTHS = ("split_size",)


def _dense(module: nn.Module, name: str, style: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    found = linear_weight(module)
    if found is None:
        weight = getattr(module, "weight", None)
        shape = f" (weight {tuple(weight.shape)})" if isinstance(weight, torch.Tensor) else ""
        raise ConfigError(f"tensor plan {name!r}: {style!r} cannot split a {type(module).__name__}{shape}; allowed: {ALLOWED}")
    return found


def _is_linear(module: Any) -> bool:
    return isinstance(module, nn.Module) and linear_weight(module) is not None


def attention_layout(module: nn.Module) -> tuple[tuple[str, ...], str] | None:
    """``((q/k/v projection names...), output projection name)`` of an attention module ``heads`` can split, else ``None``."""
    if not any(isinstance(getattr(module, a, None), int) for a in HEAD_COUNTS):
        return None
    for qkv, proj in FUSED_ATTENTION:
        if _is_linear(getattr(module, qkv, None)) and _is_linear(getattr(module, proj, None)):
            return (qkv,), proj
    for names in SEPARATE_ATTENTION:
        if all(_is_linear(getattr(module, n, None)) for n in names):
            return names[:3], names[3]
    return None


def _split_attention(module: nn.Module, group: TensorGroup, name: str) -> None:
    """Whole heads across ranks: q/k/v projections column-parallel per head, the output projection row-parallel."""
    layout = attention_layout(module)
    if layout is None:
        raise ConfigError(f"tensor plan {name!r}: 'heads' cannot split a {type(module).__name__}, which is not an attention module; allowed: {ALLOWED}")
    projections, proj = layout
    heads_attr = next(a for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int))
    kv_attr = next((a for a in KV_HEAD_COUNTS if isinstance(getattr(module, a, None), int)), None)
    heads = getattr(module, heads_attr)
    kv_heads = getattr(module, kv_attr) if kv_attr else heads
    first = getattr(module, projections[0])
    what = f"{name!r} ({type(module).__name__}: {heads} query heads, {kv_heads} key/value heads, {projections[0]} weight {tuple(first.weight.shape)})"
    for count, kind in ((heads, "query"), (kv_heads, "key/value")):
        if count % group.size:
            raise ConfigError(
                f"tensor plan {what}: {count} {kind} heads do not split over tensor_parallel={group.size} into whole heads; "
                f"use a tensor_parallel that divides {count}, or leave {name!r} out of the plan (dense)"
            )
    if len(projections) == 1:
        outputs = linear_weight(first)[0].shape[0]  # type: ignore[index]
        if outputs % (3 * heads):
            raise ConfigError(f"tensor plan {what}: a fused projection of {outputs} outputs is not q, k and v of {heads} heads each")
        setattr(module, projections[0], ColumnParallelLinear.from_dense(first, group, chunks=3, name=f"{name}.{projections[0]}"))
    else:
        for projection in projections:
            setattr(module, projection, ColumnParallelLinear.from_dense(getattr(module, projection), group, name=f"{name}.{projection}"))
    setattr(module, proj, RowParallelLinear.from_dense(getattr(module, proj), group, name=f"{name}.{proj}"))
    widths = [a for a in SPLIT_WIDTHS if isinstance(getattr(module, a, None), int)]
    for attr in (heads_attr, *([kv_attr] if kv_attr else []), *widths):
        setattr(module, attr, getattr(module, attr) // group.size)


def parallelize(model: nn.Module, plan: Mapping[str, str], group: TensorGroup) -> nn.Module:
    """Split the layers ``plan`` names across ``group`` (in place); returns ``model``.

    Parameters
    ----------
    model
        A dense model; every rank of the group passes the same weights.
    plan
        ``{module name or glob: "column" | "row" | "heads"}``; a ``"column"`` or ``"row"``
        module must be a linear layer (:func:`linear_weight`), a ``"heads"`` module an
        attention module (:func:`attention_layout`).
    group
        The tensor-parallel group.

    Raises
    ------
    ConfigError
        An unknown style, a pattern that names no module, a module of the wrong kind, or
        features or heads that do not divide by the group size; the message names the
        module, its shape and the allowed styles.
    """
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tensor plan {pattern!r}: {style!r} is not a style; allowed: {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if _is_linear(m)]
            raise ConfigError(f"tensor plan {pattern!r} names no module of the model; its linear layers are {', '.join(linears)}")
        for name in names:
            module = modules[name]
            if style == "heads":
                _split_attention(module, group, name)
                continue
            if style == "column":
                replacement: nn.Module = ColumnParallelLinear.from_dense(module, group, name=name)
            else:
                replacement = RowParallelLinear.from_dense(module, group, name=name)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    return model


def sharded_parameters(model: nn.Module) -> set[int]:
    """``id``s of the parameters that hold a different slice on each tensor rank (the others are replicated)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):
            ids.add(id(module.weight))
    return ids


def shard_model(model: nn.Module, plan: Mapping[str, str] | None, comm: Any) -> nn.Module:
    """Split ``model`` over the tensor-parallel communicator ``comm`` (in place); returns it.

    The dense parameters and buffers of the group's rank 0 are broadcast first, so every
    rank cuts its slice from the same weights. ``plan`` ``None``: :func:`plan_for`. The
    plan is first tried on a shape-only copy (:func:`~rapydli.parallel.tensor_plans.check_plan`),
    so a module it cannot split is refused before any weight moves.
    """
    from rapydli.parallel.tensor_plans import check_plan

    size = comm.Get_size()
    plan = plan_for(model, size) if plan is None else plan
    check_plan(model, plan, size)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            host = tensor.detach().cpu().contiguous()
            comm.Bcast(host.numpy(), root=0)
            tensor.copy_(host)
    return parallelize(model, plan, TensorGroup(comm))


def plan_for(model: nn.Module, size: int = 2) -> dict[str, str]:
    """The built-in plan of ``model`` for ``size`` tensor ranks (:func:`rapydli.parallel.tensor_plans.plan_for`)."""
    from rapydli.parallel.tensor_plans import plan_for as built_in

    return built_in(model, size)
