"""Comparing what a layout trained with what one process trained, parameter by parameter.

After the same steps on the same global batch, every parameter a rank holds must equal
its part of the one-process model's: the whole parameter, or the slice a tensor-parallel
layer keeps (:func:`dense_slice`). :func:`differences` measures that on one rank;
``rd.verify_layout`` (:mod:`rapydli.experiments.verify`) runs both trainings on the
engines and merges the ranks' answers.
"""

from __future__ import annotations

import torch
from torch import nn

from rapydli.parallel.tensor import ROW_BLOCKS, RowParallelLinear, linear_weight


def dense_slice(
    dense: torch.Tensor, dense_module: nn.Module, module: nn.Module, name: str, local: torch.Tensor, tensor_rank: int
) -> torch.Tensor:
    """The part of the one-process parameter ``dense`` that ``local`` (parameter ``name`` of ``module`` on tensor rank ``tensor_rank``) holds.

    ``dense_module`` is the one-process module that owns ``dense`` (a ``Conv1D`` weight is
    stored ``(in, out)``; the split layer keeps ``(out, in)``).
    """
    if not isinstance(module, (*ROW_BLOCKS, RowParallelLinear)):
        return dense
    if name == "weight" and linear_weight(dense_module) is not None and not isinstance(dense_module, nn.Linear):
        dense = dense.t()
    if isinstance(module, ROW_BLOCKS):
        rows, block = local.shape[0] // module.chunks, dense.shape[0] // module.chunks
        index = torch.cat(
            [
                torch.arange(c * block + tensor_rank * rows, c * block + (tensor_rank + 1) * rows)
                for c in range(module.chunks)
            ]
        )
        return dense[index]
    if name == "weight":
        columns = local.shape[1]
        return dense[:, tensor_rank * columns : (tensor_rank + 1) * columns]
    return dense


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    owners = {}
    for module_name, module in model.named_modules():
        for short, _ in module.named_parameters(recurse=False):
            owners[f"{module_name}.{short}" if module_name else short] = (module, short)
    return owners


def differences(
    model: nn.Module, held: nn.Module, reference: nn.Module, tensor_rank: int = 0
) -> dict[str, tuple[float, float]]:
    """``{name: (largest |difference|, largest |one-process value|)}`` over the parameters and buffers this rank holds.

    A buffer (BatchNorm's running statistics, a rotary table) is compared whole; one a
    split layer holds in another shape than the one-process model's is left out.

    Parameters
    ----------
    model
        The whole model this rank built and the layout split (tensor-parallel layers swapped in).
    held
        What this rank trained (its pipeline stage, or ``model``).
    reference
        The one-process model after the same steps; names are its ``named_parameters``.
    tensor_rank
        This rank's index in its tensor-parallel group.
    """
    mine = {id(p) for p in held.parameters()}
    found, dense_owners = _owners(model), _owners(reference)
    out: dict[str, tuple[float, float]] = {}
    for name, dense in reference.named_parameters():
        if name not in found:
            continue
        module, short = found[name]
        local = getattr(module, short)
        if id(local) not in mine:
            continue
        expected = dense_slice(dense.detach(), dense_owners[name][0], module, short, local, tensor_rank)
        difference = float((expected.double() - local.detach().double()).abs().max()) if local.numel() else 0.0
        out[name] = (difference, float(dense.detach().abs().max()) if dense.numel() else 0.0)
    mine_buffers = {id(b) for b in held.buffers()}
    buffers = dict(model.named_buffers())
    for name, dense_buffer in reference.named_buffers():
        local = buffers.get(name)
        if (
            local is None
            or id(local) not in mine_buffers
            or local.shape != dense_buffer.shape
            or not dense_buffer.is_floating_point()
        ):
            continue
        difference = float((dense_buffer.double() - local.double()).abs().max()) if local.numel() else 0.0
        out[name] = (difference, float(dense_buffer.abs().max()) if dense_buffer.numel() else 0.0)
    return out


def untied(model: nn.Module, held: nn.Module, reference: nn.Module) -> list[str]:
    """Names of parameters, one tensor in the one-process ``reference``, that this rank trains (``held``, part of ``model``) as separate tensors."""
    groups: dict[int, list[str]] = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    mine = {id(p) for p in held.parameters()}
    found = {n: p for n, p in model.named_parameters(remove_duplicate=False) if id(p) in mine}
    apart: list[str] = []
    for names in groups.values():
        kept = [n for n in names if n in found]
        if len({id(found[n]) for n in kept}) > 1:
            apart.extend(kept)
    return apart
