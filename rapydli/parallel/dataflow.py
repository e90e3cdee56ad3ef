"""MLPs found by what the forward computes: a linear layer whose output reaches another only through elementwise operations.

Tensor parallelism splits an MLP as Megatron-LM does: its first layers by output features
(column-parallel), its last by input features (row-parallel), so nothing is exchanged
between them, only the row layer's partial sums are added. That is exact only where every
operation between them acts on each feature alone (an activation, a gate's product, a
dropout, a dtype conversion): a reshape, a split along the features or a reduction over
them would read features another rank holds. Names cannot tell (``dense_h_to_4h`` is an
MLP in GPT-NeoX; a fused ``query_key_value`` followed by a reshape is not).

:func:`mlp_pairs` runs the model's forward once on a shape-only copy (PyTorch's ``meta``
device) and follows the data: every linear layer's output is marked with the layer; a
*pointwise* operation (an ATen op tagged ``pointwise``, and conversions and dropout) passes
the marks of its inputs on, unless it also reads an unmarked tensor as wide as its
output (a residual, a full-width bias), which a column split would cut; any other
operation on a marked tensor means that layer's output is used whole, so the layer cannot
be split by columns. A linear layer called on a marked input is a row layer, and every
layer marking its input a column layer of it, when the widths match and each column
layer's output goes to no other use.

Examples
--------
>>> import torch
>>> from torch import nn
>>> class Block(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.gate, self.up, self.down = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 4)
...     def forward(self, x):
...         return x + self.down(nn.functional.silu(self.gate(x)) * self.up(x))
>>> mlp_pairs(Block().to("meta"), lambda m: m(torch.zeros(2, 4, device="meta")))
[(('gate', 'up'), 'down')]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: Operations that act on each element alone besides those ATen tags ``pointwise``.
_ELEMENTWISE = {torch.ops.aten._to_copy.default, torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default,
                torch.ops.aten.alias.default, torch.ops.aten.detach.default}  # fmt: skip
_MARKS = "_rapydli_linear_marks"


def _marks(t: Any) -> frozenset[str]:
    return getattr(t, _MARKS, frozenset()) if isinstance(t, torch.Tensor) else frozenset()


class _Follow(TorchDispatchMode):
    """Passes the marks of linear layers' outputs through pointwise operations; records what else reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0  # > 0 inside a linear layer's own forward
        self.escaped: set[str] = set()  # layers whose output something other than a pointwise op reads

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.inside:
            return result
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        marked = frozenset().union(*(_marks(t) for t in inputs))
        if not marked:
            return result
        outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
        if func in _ELEMENTWISE or torch.Tag.pointwise in func.tags:
            width = outputs[0].shape[-1] if outputs and outputs[0].dim() else 1
            whole = [t for t in inputs if not _marks(t) and t.dim() and t.shape[-1] == width and width != 1]
            if whole:  # an unsplit tensor of the full width (a residual) meets the split features
                self.escaped |= marked
                return result
            for t in outputs:
                setattr(t, _MARKS, marked)
            return result
        self.escaped |= marked
        return result


def mlp_pairs(model: nn.Module, call: Callable[[nn.Module], Any]) -> list[tuple[tuple[str, ...], str]] | None:
    """The MLPs of ``model`` (a shape-only copy: its tensors on ``meta``) as ``(column layers, row layer)`` names, found by
    running ``call(model)``; ``None`` when that forward does not run.

    Layers are modules with a linear weight (:func:`rapydli.parallel.tensor.linear_weight`:
    ``nn.Linear``, Hugging Face's ``Conv1D``).
    """
    from rapydli.parallel.sample import shape_only
    from rapydli.parallel.tensor import linear_weight

    follow = _Follow()
    names = {id(m): n for n, m in model.named_modules() if linear_weight(m) is not None}
    rows: dict[str, frozenset[str]] = {}
    widths: dict[str, tuple[int, int]] = {}  # (in, out) features
    handles = []

    def before(module: nn.Module, args: Any) -> None:
        marked = frozenset().union(*(_marks(a) for a in args))
        if marked and not follow.inside:
            rows[names[id(module)]] = rows.get(names[id(module)], frozenset()) | marked
        follow.inside += 1

    def after(module: nn.Module, args: Any, output: Any) -> None:
        follow.inside -= 1
        if not follow.inside and isinstance(output, torch.Tensor):
            name = names[id(module)]
            setattr(output, _MARKS, frozenset({name}))
            widths[name] = (
                (int(args[0].shape[-1]), int(output.shape[-1]))
                if args and isinstance(args[0], torch.Tensor)
                else (0, 0)
            )

    for module in model.modules():
        if id(module) in names:
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        with shape_only(), torch.no_grad(), follow:
            call(model)
    except Exception:  # noqa: BLE001 - a forward that cannot run shape-only shows no dataflow
        return None
    finally:
        for handle in handles:
            handle.remove()
    pairs = []
    for row, columns in rows.items():
        if columns & follow.escaped or row in columns or columns & rows.keys():
            continue  # a column layer's output used whole, or layers chained through several splits
        if all(widths[c][1] == widths[row][0] for c in columns):
            pairs.append((tuple(sorted(columns)), row))
    return pairs
