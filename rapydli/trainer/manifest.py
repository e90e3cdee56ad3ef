"""The layout-free form of a checkpoint: every tensor named by its full parameter and the slice of it a part holds.

A rank of a run holds pieces of the whole model: a pipeline stage's parameters, a
tensor-parallel slice of a layer (:class:`~rapydli.parallel.tensor.ColumnParallelLinear`
keeps rows, :class:`~rapydli.parallel.tensor.RowParallelLinear` columns), and with ZeRO a
flat range of each parameter's optimizer state. :class:`Placement` says where a tensor a
rank holds sits in the full tensor of the unsplit model, named as the unsplit model names
it (``"blocks.0.attn.qkv.weight"``). A checkpoint part is a list of :class:`Entry`: a
parameter, a buffer or one optimizer state of a parameter (``"optim.exp_avg"``), with its
placement and value. Reading assembles full tensors from the entries (:func:`assemble`)
and cuts them again for the reader's layout (:meth:`Placement.cut`), as DeepSpeed's
universal checkpoints do: a checkpoint written under any data x pipeline x tensor x ZeRO
layout resumes under any other.

Examples
--------
>>> import torch
>>> full = torch.arange(12.0).reshape(4, 3)
>>> rows = Placement((4, 3), dim=0, ranges=((2, 4),))
>>> piece = Placement((4, 3), dim=0, ranges=((2, 4),), flat=(1, 4))
>>> rows.cut(full).tolist(), piece.cut(full).tolist()
([[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]], [7.0, 8.0, 9.0])
>>> assemble([Entry("w", "param", rows, rows.cut(full)), Entry("w", "param", Placement((4, 3), 0, ((0, 2),)), full[:2])]).equal(full)
True
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """Where a tensor a rank holds sits in the full tensor.

    Attributes
    ----------
    shape
        The full tensor's shape.
    dim, ranges
        Tensor parallelism: the local tensor is the full one's ``ranges`` along ``dim``,
        concatenated in order (a fused ``qkv`` keeps one range of each of q, k and v);
        ``dim=None``: the whole tensor.
    flat
        ZeRO: the local tensor is elements ``[a, b)`` of the (tensor-parallel) slice above,
        flattened; ``None``: the whole slice.
    transposed
        The rank holds the slice transposed (before ``flat``): a split layer keeps its
        weight ``(out, in)``, while the full model's Hugging Face ``Conv1D`` stores
        ``(in, out)``. The full tensor is always in the full model's own orientation.
    """

    shape: tuple[int, ...]
    dim: int | None = None
    ranges: tuple[tuple[int, int], ...] = ()
    flat: tuple[int, int] | None = None
    transposed: bool = False

    @property
    def slice_shape(self) -> tuple[int, ...]:
        """The shape of the tensor-parallel slice (before ``flat``)."""
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = sum(b - a for a, b in self.ranges)
        return tuple(shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor the rank holds, before ``flat`` (the slice, transposed where ``transposed``)."""
        shape = self.slice_shape
        return (shape[1], shape[0]) if self.transposed else shape

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """The piece of ``full`` this placement names (a view of ``full`` where it can be: copy it to keep it)."""
        if self.dim is None:
            local = full
        elif len(self.ranges) == 1:
            ((a, b),) = self.ranges
            local = full.narrow(self.dim, a, b - a)
        else:
            local = torch.cat([full.narrow(self.dim, a, b - a) for a, b in self.ranges], self.dim)
        if self.transposed:
            local = local.t()
        if self.flat is not None:
            local = local.reshape(-1)[self.flat[0] : self.flat[1]]
        return local

    def sharded(self, flat: tuple[int, int]) -> Placement:
        """This placement narrowed to elements ``flat`` of its slice (a ZeRO piece)."""
        return Placement(self.shape, self.dim, self.ranges, flat, self.transposed)


@dataclass
class Entry:
    """One tensor of a checkpoint part: ``field`` (``"param"``, ``"buffer"``, ``"optim.<state>"``) of the full ``name``.

    ``value`` is the tensor (or, for an optimizer state that is not a tensor, the object
    itself); ``placement`` is ``None`` for a value stored whole that is not sliced (a
    step counter).
    """

    name: str
    field: str
    placement: Placement | None
    value: Any

    @property
    def key(self) -> tuple[str, str]:
        """``(name, field)``: what the entries of one full tensor share."""
        return self.name, self.field


def placements(whole: nn.Module, held: nn.Module) -> dict[int, tuple[str, Placement]]:
    """``id(tensor) -> (full name, placement)`` of every parameter and buffer of ``held``.

    ``whole`` is the whole model this rank built (split in place by tensor parallelism:
    its names are the unsplit model's); ``held`` is what this rank trains of it (itself,
    or its pipeline stage, which shares its modules).
    """
    from rapydli.parallel.tensor import ROW_BLOCKS, RowParallelLinear

    names: dict[int, str] = {}
    for n, t in (*whole.named_parameters(remove_duplicate=False), *whole.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), n)  # a tied tensor goes by its first name, as state_dict's first entry
    split: dict[int, Placement] = {}
    for module in whole.modules():
        transposed = getattr(module, "dense_transposed", False)  # split from a Conv1D, which stores (in, out)
        if isinstance(module, ROW_BLOCKS):
            size, rank, chunks = module.group.size, module.group.rank, module.chunks
            for short, sliced in module.named_parameters(recurse=False):
                rows = sliced.shape[0] // chunks  # this rank's rows of each chunk
                block = rows * size
                ranges = tuple((c * block + rank * rows, c * block + (rank + 1) * rows) for c in range(chunks))
                shape = (sliced.shape[0] * size, *sliced.shape[1:])
                if transposed and short == "weight":
                    split[id(sliced)] = Placement((shape[1], shape[0]), 1, ranges, transposed=True)
                else:
                    split[id(sliced)] = Placement(shape, 0, ranges)
        elif isinstance(module, RowParallelLinear):
            size, rank, columns = module.group.size, module.group.rank, module.weight.shape[1]
            ranges = ((rank * columns, (rank + 1) * columns),)
            if transposed:
                split[id(module.weight)] = Placement(
                    (columns * size, module.weight.shape[0]), 0, ranges, transposed=True
                )
            else:
                split[id(module.weight)] = Placement((module.weight.shape[0], columns * size), 1, ranges)
    out: dict[int, tuple[str, Placement]] = {}
    held_tensors: list[tuple[str, torch.Tensor]] = [*held.named_parameters(), *held.named_buffers()]
    for local_name, tensor in held_tensors:
        name = names.get(id(tensor), local_name)
        if id(tensor) in split:
            out[id(tensor)] = (name, split[id(tensor)])
        else:
            out[id(tensor)] = (name, Placement(tuple(tensor.shape)))
    return out


def optimizer_slots(optimizer: Any, where: dict[int, tuple[str, Placement]]) -> Iterator[tuple[str, Placement, Any]]:
    """``(full name, placement, tensor the optimizer keys its state by)`` of every parameter (or ZeRO piece) it updates.

    ``optimizer`` is a ``torch.optim.Optimizer`` or a
    :class:`~rapydli.parallel.zero.ShardedOptimizer` (its pieces are flat ranges of the
    parameters ``where`` places).
    """
    buckets = getattr(optimizer, "buckets", None)
    if buckets is not None:
        for bucket in buckets:
            for (i, a, b), piece in zip(bucket.pieces, bucket.owned, strict=True):
                name, placement = where[id(bucket.params[i])]
                yield name, placement.sharded((a, b)), piece
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name, placement = where[id(param)]
            yield name, placement, param


def state_key(optimizer: Any, slot: torch.Tensor) -> torch.Tensor:
    """The tensor ``optimizer``'s inner optimizer keys ``slot``'s state by: ``slot``, or an offloaded ZeRO piece's host copy."""
    stepped = getattr(optimizer, "stepped", None)
    return stepped(slot) if stepped is not None else slot


def entries(
    whole: nn.Module, held: nn.Module, optimizer: Any, *, model: bool, split_only: bool, state: bool = True
) -> list[Entry]:
    """The entries this rank writes: its parameters and buffers (``model``) and its optimizer state (``optimizer``, or ``None``).

    ``split_only``: only tensors that are tensor-parallel slices (another tensor rank
    writes the whole ones). With a ZeRO-3 ``optimizer``
    (:class:`~rapydli.parallel.zero3.FullyShardedOptimizer`) every rank writes the pieces
    of the parameters it keeps (``"param"`` entries placed like its optimizer state), and
    ``model`` only the rest (buffers, frozen parameters). ``state=False``: no optimizer
    state (the model's pieces only).
    """
    where = placements(whole, held)
    inner = getattr(optimizer, "optimizer", optimizer)
    sharded = optimizer.sharded_ids() if hasattr(optimizer, "sharded_ids") else frozenset()
    out: list[Entry] = []
    if model:
        for kind, tensors in (("param", held.parameters()), ("buffer", held.buffers())):
            for tensor in tensors:
                name, placement = where[id(tensor)]
                if (not split_only or placement.dim is not None) and id(tensor) not in sharded:
                    out.append(Entry(name, kind, placement, tensor.detach().cpu()))
    if sharded:
        pieces = {id(piece): param for param, piece in optimizer.parameter_pieces()}
        for name, placement, piece in optimizer_slots(optimizer, where):
            if id(piece) in pieces and (not split_only or placement.dim is not None):
                out.append(Entry(name, "param", placement, piece.detach().cpu()))
    for name, placement, param in optimizer_slots(optimizer, where) if optimizer is not None and state else ():
        if split_only and placement.dim is None:
            continue
        for state, value in inner.state.get(state_key(optimizer, param), {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.shape:
                out.append(Entry(name, f"optim.{state}", placement, value.detach().cpu()))
            else:
                out.append(Entry(name, f"optim.{state}", None, value))
    return out


def assemble(found: Iterable[Entry]) -> Any:
    """The full tensor of entries of one ``(name, field)`` (or the value of an unsliced one).

    Raises
    ------
    ConfigError
        The entries do not cover the full tensor (a part is missing).
    """
    found = list(found)
    whole = [e for e in found if e.placement is None]
    if whole:
        return whole[0].value
    first = found[0]
    assert first.placement is not None
    if first.placement.dim is None and first.placement.flat is None:  # one entry holds it whole: no copy
        return first.value
    shape = first.placement.shape
    slices: dict[tuple[Any, ...], list[Entry]] = {}
    for entry in found:
        assert entry.placement is not None
        slices.setdefault((entry.placement.dim, entry.placement.ranges), []).append(entry)
    full = (
        torch.empty(shape, dtype=first.value.dtype)
        if len(slices) > 1 or first.placement.dim is not None
        else torch.empty(0)
    )
    covered = 0
    for (dim, ranges), pieces in slices.items():
        placement = pieces[0].placement
        assert placement is not None
        local_shape = placement.local_shape
        if any(p.placement.flat is not None for p in pieces):  # type: ignore[union-attr]
            flat = torch.empty(math.prod(local_shape), dtype=first.value.dtype)
            spans = {p.placement.flat: p.value for p in pieces}  # type: ignore[union-attr]
            for (a, b), value in spans.items():  # type: ignore[misc]
                flat[a:b] = value.reshape(-1)
            filled = sum(b - a for a, b in spans)  # type: ignore[misc]
            if filled != flat.numel():
                raise ConfigError(
                    f"the checkpoint holds {filled} of the {flat.numel()} elements of {first.name} ({first.field}): a part is missing"
                )
            local = flat.reshape(local_shape)
        else:
            local = pieces[0].value.reshape(local_shape)
        if placement.transposed:
            local = local.t()
        if dim is None and len(slices) == 1:  # the whole tensor already: no second copy
            return local
        if dim is None:
            full.copy_(local)
        else:
            offset = 0
            for a, b in ranges:
                full.narrow(dim, a, b - a).copy_(local.narrow(dim, offset, b - a))
                offset += b - a
        covered += local.numel()
    if covered != full.numel():
        raise ConfigError(
            f"the checkpoint holds {covered} of the {full.numel()} elements of {first.name} ({first.field}): a part is missing"
        )
    return full
