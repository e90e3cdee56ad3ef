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
``"row"`` or ``"heads"`` (an attention module: fused ``qkv`` split per head, ``proj``
row-parallel, its ``heads`` divided). Each rank keeps its slice of the dense weights, so a
parallelized model computes what the dense one does.

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


class ColumnParallelLinear(nn.Module):
    """``y[..., shard] = x @ W[shard].T + b[shard]``: this rank's slice of the output features.

    ``chunks`` > 1 splits each of that many equal blocks of the output features (a fused
    ``qkv`` projection: every rank keeps its heads of q, of k and of v).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TensorGroup, chunks: int = 1) -> None:
        super().__init__()
        self.group, self.chunks = group, chunks
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: TensorGroup, chunks: int = 1) -> ColumnParallelLinear:
        """This rank's rows of ``linear``'s weight (and bias)."""
        block = _split(linear.out_features, chunks, "out_features / chunks")
        rows = _split(block, group.size, "out_features")
        index = torch.cat([torch.arange(c * block + group.rank * rows, c * block + (group.rank + 1) * rows) for c in range(chunks)])
        bias = linear.bias.detach()[index].clone() if linear.bias is not None else None
        return cls(linear.weight.detach()[index].clone(), bias, group, chunks)

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
    def from_dense(cls, linear: nn.Linear, group: TensorGroup) -> RowParallelLinear:
        """This rank's columns of ``linear``'s weight; the bias is kept whole."""
        columns = _split(linear.in_features, group.size, "in_features")
        weight = linear.weight.detach()[:, group.rank * columns : (group.rank + 1) * columns].clone()
        return cls(weight, linear.bias.detach().clone() if linear.bias is not None else None, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


def _split_attention(module: nn.Module, group: TensorGroup, name: str) -> None:
    """Heads across ranks: the fused q/k/v projection column-parallel per head, the output projection row-parallel."""
    layout = next(((q, p, h) for q, p, h in (("qkv", "proj", "heads"), ("c_attn", "c_proj", "n_head")) if hasattr(module, q)), None)
    if layout is None or not isinstance(getattr(module, layout[0]), nn.Linear):
        raise ConfigError(
            f"{name!r} is not an attention module that 'heads' can split: "
            "it needs a fused qkv (or c_attn) nn.Linear, proj (or c_proj) and heads (or n_head)"
        )
    qkv, proj, heads = layout
    setattr(module, heads, _split(getattr(module, heads), group.size, f"{name}.{heads}"))
    setattr(module, qkv, ColumnParallelLinear.from_dense(getattr(module, qkv), group, chunks=3))
    setattr(module, proj, RowParallelLinear.from_dense(getattr(module, proj), group))


def parallelize(model: nn.Module, plan: Mapping[str, str], group: TensorGroup) -> nn.Module:
    """Split the layers ``plan`` names across ``group`` (in place); returns ``model``.

    Parameters
    ----------
    model
        A dense model; every rank of the group passes the same weights.
    plan
        ``{module name or glob: "column" | "row" | "heads"}``; a ``"column"`` or ``"row"``
        module must be an ``nn.Linear``.
    group
        The tensor-parallel group.

    Raises
    ------
    ConfigError
        An unknown style, a pattern that names no module, a module of the wrong kind, or
        features that do not divide by the group size.
    """
    modules = dict(model.named_modules())
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tensor plan {pattern!r}: {style!r} is not a style; allowed: {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
            raise ConfigError(f"tensor plan {pattern!r} names no module of the model; its linear layers are {', '.join(linears)}")
        for name in names:
            module = modules[name]
            if style == "heads":
                _split_attention(module, group, name)
                continue
            if not isinstance(module, nn.Linear):
                raise ConfigError(f"tensor plan {name!r}: {style!r} needs an nn.Linear, not a {type(module).__name__}")
            replacement = ColumnParallelLinear.from_dense(module, group) if style == "column" else RowParallelLinear.from_dense(module, group)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    return model


#: Modules that act elementwise: a column-parallel layer's split output may pass through them to a row-parallel one.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Dropout, nn.Identity)


def plan_for(model: nn.Module) -> dict[str, str]:
    """The built-in plan of a model, read from the model itself (``parallel`` knows no model class).

    A model with a ``tensor_plan()`` method (the zoo's ``tiny_lm``: attention split by
    heads, each MLP column then row) gives its own plan, as ``pipeline_blocks()`` gives its
    pipeline blocks. An ``nn.Sequential`` MLP (the zoo's ``mlp``): consecutive linear
    layers with only elementwise modules between them paired column then row; a linear
    layer left without a partner (the classifier of an odd count) stays dense.

    Raises
    ------
    ConfigError
        The model has no built-in plan; the message says how to pass one.
    """
    from rapydli.parallel.split import pipeline_blocks

    own = getattr(model, "tensor_plan", None)
    if callable(own):
        return dict(own())
    plan: dict[str, str] = {}
    if isinstance(model, nn.Sequential):
        column: str | None = None
        for name, block in pipeline_blocks(model):
            if isinstance(block, nn.Linear):
                if column is None:
                    column = name
                else:
                    plan[column], plan[name], column = "column", "row", None
            elif not isinstance(block, ELEMENTWISE):
                column = None
    if plan:
        return plan
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    raise ConfigError(
        f"no built-in tensor plan for {type(model).__name__}: pass TrainConfig(tensor_plan={{module glob: 'column' | 'row' | 'heads'}}), "
        f"a column layer followed by a row layer; its linear layers are {', '.join(linears) or 'none'}"
    )


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
    rank cuts its slice from the same weights. ``plan`` ``None``: :func:`plan_for`.
    """
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            host = tensor.detach().cpu().contiguous()
            comm.Bcast(host.numpy(), root=0)
            tensor.copy_(host)
    return parallelize(model, plan_for(model) if plan is None else plan, TensorGroup(comm))
