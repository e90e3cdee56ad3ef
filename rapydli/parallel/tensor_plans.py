"""Which layers of a model to split, and whether a plan can split them: built-in plans by structure, checked on shapes.

:func:`plan_for` reads a model's structure, not its class, so the shapes people bring
need no hand-written plan:

* attention modules :func:`~rapydli.parallel.attention.find_attention` recognises by
  structure (fused or separate q/k/v projections, an output projection, a head count from an
  attribute, the module's config or the projections' shapes; grouped-query too), and PyTorch's
  ``nn.MultiheadAttention`` (:mod:`rapydli.parallel.mha`): ``"heads"``;
* BERT's ``attention.self`` (``query``/``key``/``value``, returning the heads' context):
  ``"heads"``, with its sibling ``attention.output.dense`` ``"row"``;
* MLPs by what the forward computes (:mod:`rapydli.parallel.dataflow`, on a shape-only run
  of a sample the model's config gives: :mod:`rapydli.parallel.sample`): a linear layer whose
  output reaches another only through pointwise operations is column-parallel, the other
  row-parallel (GPT-2's ``c_fc``/``c_proj``, Llama's gate and up then down, BERT's
  ``intermediate``/``output``, ``nn.TransformerEncoderLayer``'s ``linear1``/``linear2``);
* only where the forward cannot run shape-only, by their layers' names: ``c_fc``/``c_proj``,
  ``fc1``/``fc2``, ``intermediate.dense``/``output.dense``, ``dense_h_to_4h``/``dense_4h_to_h``,
  ``wi``/``wo``, ``lin1``/``lin2``, ``gate_proj``/``up_proj``/``down_proj``, ``w1``/``w3``/``w2``,
  and consecutive linear layers of an ``nn.Sequential`` with only elementwise modules between.

Embeddings, norms and the LM head stay whole (replicated), so tied embeddings stay tied;
a plan may split them by vocabulary rows (``{"transformer.wte": "vocab", "lm_head": "vocab"}``),
tied or not.
Names that differ only in layer indices become one glob (``"transformer.h.*.attn"``).

:func:`check_plan` applies a plan to a shape-only copy of the model (PyTorch's ``meta``
device: no memory, no arithmetic) with the group's size, and runs each split attention
module once: a module whose ``forward`` cannot run on whole heads per rank (nanoGPT's
``CausalSelfAttention`` reads its width from its input, ``x.size()``, and splits by it) is
refused before training, naming the module, its shape and what to do. :func:`plan_for`
leaves such modules dense.
"""

from __future__ import annotations

import copy
import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.dataflow import mlp_pairs
from rapydli.parallel.sample import sample_call, shape_only
from rapydli.parallel.tensor import TensorGroup, attention_layout, linear_weight, parallelize

#: Modules that act elementwise: a column-parallel layer's split output may pass through them to a row-parallel one.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Dropout, nn.Identity)
#: MLP layer names: (column-parallel layers, row-parallel layer).
MLP_LAYOUTS = ((("c_fc",), "c_proj"), (("gate_proj", "up_proj"), "down_proj"), (("w1", "w3"), "w2"), (("fc1",), "fc2"),
               (("intermediate.dense",), "output.dense"), (("dense_h_to_4h",), "dense_4h_to_h"), (("wi",), "wo"), (("lin1",), "lin2"))  # fmt: skip
#: Where an attention module that ends at its heads' context (BERT's ``attention.self``) finds its output projection: the parent's.
CONTEXT_OUTPUT = "output.dense"


class _ShapeGroup(TensorGroup):
    """A group of ``size`` ranks seen from rank 0, on shape-only tensors: its sums are the tensor itself."""

    def __init__(self, size: int) -> None:
        self.comm, self.rank, self.size = None, 0, size
        self.allreduces = {"forward": 0, "backward": 0}

    def allreduce(self, tensor: torch.Tensor, direction: str) -> torch.Tensor:
        return tensor

    def maximum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor] * self.size, dim=-1)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (tied ones stay tied); the weights are not copied."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def _width(module: nn.Module) -> tuple[int, torch.dtype] | None:
    """The input width and dtype of an attention module (its q/k/v projection's), or ``None``."""
    layout = attention_layout(module)
    if layout is None:
        return None
    weight = linear_weight(getattr(module, layout[0][0]))[0]  # type: ignore[index]
    return int(weight.shape[1]), weight.dtype


def _runs(module: nn.Module, width: tuple[int, torch.dtype]) -> bool:
    """Whether ``module`` runs forward on a (2, 2, width) shape-only input (outside any recording, as :func:`_model_runs`)."""
    return _model_runs(module, lambda m: m(torch.empty(2, 2, width[0], dtype=width[1], device="meta")))


def check_plan(model: nn.Module, plan: Mapping[str, str], size: int) -> None:
    """Raise :class:`ConfigError` if ``plan`` cannot split ``model`` over ``size`` tensor ranks.

    Everything :func:`~rapydli.parallel.tensor.parallelize` refuses (unknown style,
    pattern naming no module, a module of the wrong kind, features or heads that do not
    divide), found on a shape-only copy; a module holding a parameter tied to another
    module's (the split would untie them); and a ``"heads"`` module whose forward runs
    dense but not with its heads split.
    """
    shadow = meta_copy(model)
    modules = dict(shadow.named_modules())
    _check_ties(shadow, plan)
    heads = [
        n
        for pattern, style in plan.items()
        if style == "heads"
        for n in modules
        if n and fnmatch.fnmatchcase(n, pattern)
    ]
    widths = {n: _width(modules[n]) for n in heads}
    dense_runs = {n: w is not None and _runs(modules[n], w) for n, w in widths.items()}
    call = sample_call(model)
    runs_dense = call is not None and _model_runs(meta_copy(model), call)
    parallelize(shadow, plan, _ShapeGroup(size))
    for name in heads:
        if dense_runs[name] and not _runs(modules[name], widths[name]):  # type: ignore[arg-type]
            module = modules[name]
            raise ConfigError(
                f"tensor plan {name!r}: 'heads' cannot split this {type(module).__name__} (input width {widths[name][0]}): "  # type: ignore[index]
                f"its forward fails with its heads split over tensor_parallel={size}, as when it reads its width from "
                "its input (x.size()) instead of from its head count. Leave it out of the plan (dense), or compute widths from "
                "the head attributes (n_head * head_dim)"
            )
    if runs_dense and not _model_runs(shadow, call):
        obstacle = next((p for p in plan if not _model_runs(_split_copy(model, {p: plan[p]}, size), call)), None)
        named = f"{obstacle!r} ({plan[obstacle]!r})" if obstacle else "the plan's modules together"
        raise ConfigError(
            f"tensor plan: {type(model).__name__}'s forward runs whole but fails with {named} split over tensor_parallel={size}: "
            "something outside the split modules is made for every head or every feature (ALiBi's biases, a relative position bias "
            "computed once for all layers). Leave it out of the plan (dense)"
        )


def _model_runs(model: nn.Module, call: Any) -> bool:
    """Whether ``call(model)`` runs (shapes only: :func:`~rapydli.parallel.sample.shape_only`)."""
    try:
        with torch.no_grad(), shape_only():
            call(model)
    except Exception:  # noqa: BLE001 - any failure means: this forward cannot run so
        return False
    return True


def _split_copy(model: nn.Module, plan: Mapping[str, str], size: int) -> nn.Module:
    """A shape-only copy of ``model`` split by ``plan`` as ``size`` ranks would split it."""
    shadow = meta_copy(model)
    parallelize(shadow, plan, _ShapeGroup(size))
    return shadow


def _style_of(module_name: str, plan: Mapping[str, str]) -> str | None:
    """The style the plan gives ``module_name`` (its first matching pattern), or ``None``."""
    return next((style for pattern, style in plan.items() if fnmatch.fnmatchcase(module_name, pattern)), None)


def _check_ties(model: nn.Module, plan: Mapping[str, str]) -> None:
    """Refuse a plan that splits a module holding a parameter another module shares (tied weights would come untied).

    An embedding and an LM head tied to it may both be ``"vocab"``: each rank keeps the
    same rows of the one weight, which stays one parameter.
    """
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    for module_name, module in model.named_modules():
        style = _style_of(module_name, plan) if module_name else None
        if style is None:
            continue
        for p in module.parameters(recurse=False) if style == "vocab" else module.parameters():
            tied = [n for n in names[id(p)] if not n.startswith(module_name + ".")]
            owners = [n.rpartition(".")[0] for n in tied]
            if tied and not (style == "vocab" and all(_style_of(o, plan) == "vocab" for o in owners)):
                mine = next(n for n in names[id(p)] if n.startswith(module_name + "."))
                raise ConfigError(
                    f"tensor plan {module_name!r} would split {mine}, which is tied to {', '.join(tied)} (one parameter): each would "
                    f"train its own tensor. Leave {module_name!r} out of the plan (it stays whole on every tensor rank), or, for a "
                    f"tied embedding and LM head, give both 'vocab' (each rank keeps the same rows of the one weight)"
                )


def plan_for(model: nn.Module, size: int = 2) -> dict[str, str]:
    """The built-in plan of ``model`` for ``size`` tensor ranks, read from its structure (rules in the module docstring).

    Attention modules whose heads do not divide by ``size``, or whose forward cannot run
    split (:func:`check_plan`), and layers whose features do not divide, stay dense.

    Raises
    ------
    ConfigError
        Nothing in the model can be split; the message says how to pass a plan.
    """
    own = getattr(model, "tensor_plan", None)
    if callable(own):  # a model may give its own plan (the zoo's tiny_lm does), as pipeline_blocks() gives its blocks
        return dict(own())
    exact: dict[str, str] = {}
    attention: set[str] = set()  # the entries that split attention heads (and BERT's row after them)
    shadow = meta_copy(model)
    call = sample_call(model)
    flow = mlp_pairs(meta_copy(model), call) if call is not None else None  # None: no shape-only forward, MLPs by names
    for name, module in shadow.named_modules():
        if any(name == n or name.startswith(n + ".") for n in exact if n):
            continue  # inside a module already planned
        if isinstance(module, nn.MultiheadAttention) and name:  # PyTorch's own attention (rapydli.parallel.mha)
            if _splits(shadow, {name: "heads"}, size):
                exact[name] = "heads"
                attention.add(name)
            continue
        layout = attention_layout(module)
        if layout is not None and name:
            if layout[1] is None:  # BERT: the context goes to the parent's output.dense, split row-parallel with it
                output = f"{name.rpartition('.')[0]}.{CONTEXT_OUTPUT}".lstrip(".")
                if _is_module(shadow, output) and _splits(shadow, {name: "heads", output: "row"}, size):
                    exact.update({name: "heads", output: "row"})
                    attention.update({name, output})
            elif _splits(shadow, {name: "heads"}, size):
                exact[name] = "heads"
                attention.add(name)
            continue
        if flow is not None:
            continue
        found = _mlp(module, name, size)
        if found:
            exact.update(found)
            continue
        if isinstance(module, nn.Sequential):
            exact.update(_sequential_pairs(module, name, size))
    for columns, row in flow or ():
        modules = dict(shadow.named_modules())
        layers = (*columns, row)
        if any(n == a or n.startswith(a + ".") for n in layers for a in exact):
            continue  # inside attention already split by heads
        if all(_divides(modules[c], size, 0) for c in columns) and _divides(modules[row], size, 1):
            exact.update({**{c: "column" for c in columns}, row: "row"})
    if (
        exact
        and call is not None
        and _model_runs(meta_copy(model), call)
        and not _model_runs(_split_copy(model, exact, size), call)
    ):
        # a tensor made for every head outside the attention modules (ALiBi's biases, T5's relative position bias) meets split heads
        exact = {n: style for n, style in exact.items() if n not in attention}
        if exact and not _model_runs(_split_copy(model, exact, size), call):
            exact = {}
    if exact:
        return _globbed(model, exact)
    linears = [n for n, m in model.named_modules() if linear_weight(m) is not None]
    raise ConfigError(
        f"no built-in tensor plan for {type(model).__name__}: pass TrainConfig(tensor_plan={{module glob: 'column' | 'row' | 'heads'}}), "
        f"a column layer followed by a row layer; its linear layers are {', '.join(linears) or 'none'}"
    )


def _is_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def _splits(shadow: nn.Module, plan: dict[str, str], size: int) -> bool:
    try:
        check_plan(shadow, plan, size)
    except ConfigError:
        return False
    return True


def _divides(module: nn.Module, size: int, dim: int) -> bool:
    found = linear_weight(module)
    return found is not None and found[0].shape[dim] % size == 0


def _mlp(module: nn.Module, name: str, size: int) -> dict[str, str]:
    prefix = f"{name}." if name else ""
    for columns, row in MLP_LAYOUTS:
        layers = [module.get_submodule(n) if _is_module(module, n) else None for n in (*columns, row)]
        if all(isinstance(m, nn.Module) and linear_weight(m) is not None for m in layers):
            if all(_divides(m, size, 0) for m in layers[:-1]) and _divides(layers[-1], size, 1):  # type: ignore[arg-type]
                return {**{prefix + c: "column" for c in columns}, prefix + row: "row"}
            return {}
    return {}


def _sequential_pairs(sequential: nn.Sequential, name: str, size: int) -> dict[str, str]:
    """Consecutive linear layers of ``sequential`` with only elementwise modules between them: column then row."""
    from rapydli.parallel.split import _expand

    prefix = f"{name}." if name else ""
    plan: dict[str, str] = {}
    column: str | None = None
    for child, block in _expand(sequential, ""):
        if linear_weight(block) is not None:
            if column is None:
                column = child if _divides(block, size, 0) else None
            else:
                if _divides(block, size, 1):
                    plan[prefix + column], plan[prefix + child] = "column", "row"
                column = None
        elif not isinstance(block, ELEMENTWISE):
            column = None
    return plan


def _globbed(model: nn.Module, exact: dict[str, str]) -> dict[str, str]:
    """``exact`` with layer indices turned into ``*`` where the glob names only modules planned the same way."""
    names = [n for n, _ in model.named_modules() if n]
    plan: dict[str, str] = {}
    for name, style in exact.items():
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                pattern = ".".join([*parts[:i], "*", *parts[i + 1 :]])
                if all(exact.get(n) == style for n in names if fnmatch.fnmatchcase(n, pattern)):
                    parts[i] = "*"
        plan[".".join(parts)] = style
    return plan
