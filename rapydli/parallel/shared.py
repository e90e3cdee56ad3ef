"""Parameters that several pipeline stages hold: tied weights stay one parameter.

A model may use one ``nn.Parameter`` in modules that land on different stages: tied
input and output embeddings (nanoGPT's ``wte.weight = lm_head.weight``, Hugging Face's
``tie_word_embeddings``), or any weight shared by identity. Each stage that holds it
trains a copy; to train the model one process trains, the copies' gradients are summed
over the stages that hold them (each stage's gradient is that of its own uses) after the
data-parallel average and before clipping and the step, so every copy gets the same
update and the copies stay bit-equal, as Megatron-LM's embedding group does. Grad-norm
clipping counts such a parameter once (on the first stage that holds it).

:func:`find_shared` reads the sharing from the model and the stage bounds, before the
model is split; :class:`SharedGradients` holds one communicator per set of stages that
share something (a sub-communicator of the pipeline) and sums the gradients.
:func:`check_honoured` refuses what cannot be honoured (ZeRO-2, whose gradients are
slices of a flat buffer that differs per stage; a tensor plan that splits the shared
parameter's module, unless every module holding it is split by vocabulary rows, so each
stage keeps the same rows), naming the parameter and the stages.

Examples
--------
>>> from torch import nn
>>> emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
>>> head.weight = emb.weight
>>> model = nn.Sequential(emb, nn.Tanh(), head)
>>> [(s.names, s.stages) for s in find_shared(model, [0, 2, 3])]
[(['0.weight', '2.weight'], [0, 1])]
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.split import pipeline_blocks


@dataclass
class SharedParameter:
    """One parameter that more than one stage holds.

    Attributes
    ----------
    names
        Every name the parameter has in the model (``"transformer.wte.weight"``,
        ``"lm_head.weight"``), in the order the model's modules list it.
    stages
        The stages that hold it, ascending (two or more).
    parameter
        The parameter itself (the whole model's, on this rank).
    """

    names: list[str]
    stages: list[int]
    parameter: nn.Parameter

    def describe(self) -> dict[str, Any]:
        """``{"parameter": first name, "names": [...], "stages": [...], "shape": [...]}`` (for the timeline and the run record)."""
        return {
            "parameter": self.names[0],
            "names": list(self.names),
            "stages": list(self.stages),
            "shape": list(self.parameter.shape),
        }


def find_shared(model: nn.Module, bounds: Sequence[int]) -> list[SharedParameter]:
    """The parameters that blocks of more than one stage hold (by identity), in the model's order.

    ``bounds`` are the stage boundaries over :func:`~rapydli.parallel.split.pipeline_blocks`
    (``[0, b1, ..., len(blocks)]``). Names are the block-qualified names
    (``"<block>.<parameter>"``) where the model's own ``named_parameters`` does not list
    the parameter under several names.
    """
    blocks = pipeline_blocks(model)
    stages_of: dict[int, set[int]] = {}
    by_id: dict[int, nn.Parameter] = {}
    for stage in range(len(bounds) - 1):
        for _, block in blocks[bounds[stage] : bounds[stage + 1]]:
            for p in block.parameters():
                stages_of.setdefault(id(p), set()).add(stage)
                by_id[id(p)] = p
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for block_name, block in blocks:  # parameters the blocks hold that the model does not list (blocks made on the fly)
        for name, p in block.named_parameters(remove_duplicate=False):
            if id(p) not in names:
                names.setdefault(id(p), []).append(f"{block_name}.{name}")
    order = {pid: i for i, pid in enumerate(names)}
    shared = [SharedParameter(names[pid], sorted(st), by_id[pid]) for pid, st in stages_of.items() if len(st) > 1]
    return sorted(shared, key=lambda s: order.get(id(s.parameter), len(order)))


def check_honoured(
    shared: Sequence[SharedParameter], model: nn.Module, zero: int, plan: Mapping[str, str] | None
) -> None:
    """Raise :class:`ConfigError` if a shared parameter cannot stay one parameter in this layout.

    ZeRO-2 and 3 average gradients into per-stage slices of a flat buffer, where the copies
    on two stages cannot be summed; a tensor plan that splits a module holding the parameter
    would give each stage a different tensor. ``plan`` is the tensor plan in use (``None``:
    no tensor parallelism).
    """
    for item in shared:
        where = f"{item.names[0]} (also {', '.join(item.names[1:])})" if len(item.names) > 1 else item.names[0]
        stages = ", ".join(map(str, item.stages))
        if zero >= 2:
            raise ConfigError(
                f"parameter {where} is shared by pipeline stages {stages} (tied weights), which zero={zero} cannot keep one parameter: "
                "its gradient lives in per-stage slices; use zero=1 or 0, or untie it in the model"
            )
        if plan is None:
            continue
        split = _modules_splitting(model, item.parameter, plan)
        if split and not all(style == "vocab" for _, style in split):
            raise ConfigError(
                f"parameter {where} is shared by pipeline stages {stages} (tied weights), and the tensor plan splits "
                f"{', '.join(name for name, _ in split)} which holds it: the stages would train different tensors. Leave that "
                "module out of tensor_plan, or, for a tied embedding and LM head, give both 'vocab' (every stage keeps the same rows)"
            )


def _modules_splitting(model: nn.Module, parameter: nn.Parameter, plan: Mapping[str, str]) -> list[tuple[str, str]]:
    """``(name, style)`` of the modules the plan names that hold ``parameter``."""
    found = []
    for name, module in model.named_modules():
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None) if name else None
        if style is not None and any(p is parameter for p in module.parameters()):
            found.append((name, style))
    return found


class SharedGradients:
    """Sums the gradients of this rank's shared parameters over the stages that hold them.

    Parameters
    ----------
    shared
        :func:`find_shared`'s answer (the same on every rank).
    module
        This rank's stage (its parameters are the model's).
    pipeline
        The pipeline communicator (rank = stage). Construction is collective over it: one
        sub-communicator per distinct set of sharing stages (``Comm.Split``); this rank
        is in those that include its stage.

    Attributes
    ----------
    counted_elsewhere
        ``id``s of this rank's shared parameters that an earlier stage also holds: a
        global gradient norm counts them there.
    """

    def __init__(self, shared: Sequence[SharedParameter], module: nn.Module, pipeline: Any) -> None:
        from mpi4py import MPI

        stage = pipeline.Get_rank()
        mine = {id(p) for p in module.parameters()}
        self.groups: list[tuple[Any, list[nn.Parameter]]] = []
        self.counted_elsewhere: set[int] = set()
        for stages in sorted({tuple(s.stages) for s in shared}):
            comm = pipeline.Split(color=0 if stage in stages else MPI.UNDEFINED, key=stage)
            if comm == MPI.COMM_NULL:
                continue
            params = [s.parameter for s in shared if tuple(s.stages) == stages and id(s.parameter) in mine]
            self.groups.append((comm, params))
            if stage != stages[0]:
                self.counted_elsewhere.update(id(p) for p in params)

    def broadcast(self) -> None:
        """Give every stage the first stage's values (so the copies start bit-equal).

        A parameter still on the meta device (a model never built whole,
        :mod:`rapydli.parallel.deferred`) is skipped: every stage computes its value from the
        same recording, so the copies start equal without it.
        """
        with torch.no_grad():
            for comm, params in self.groups:
                for p in params:
                    if p.is_meta:
                        continue
                    host = p.detach().cpu().contiguous()
                    comm.Bcast(host.numpy(), root=0)
                    p.copy_(host)

    def adopt(self, made: Mapping[int, torch.Tensor]) -> None:
        """Point at the tensors that replaced meta parameters (``made``: by the meta ones' ``id``)."""
        self.groups = [(comm, [made.get(id(p), p) for p in params]) for comm, params in self.groups]  # type: ignore[misc]
        self.counted_elsewhere = {id(made[i]) if i in made else i for i in self.counted_elsewhere}

    def sum_gradients(self) -> None:
        """Replace each shared parameter's gradient by its sum over the stages that hold it (collective over them).

        A stage whose copy got no gradient adds zeros (and then holds the sum).
        """
        from mpi4py import MPI

        for comm, params in self.groups:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                host = p.grad.detach().cpu().contiguous().clone()
                comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
                p.grad.copy_(host)

    def free(self) -> None:
        """Release the sub-communicators."""
        for comm, _ in self.groups:
            comm.Free()
        self.groups = []
