"""Attention modules recognised by what they hold: projections, an output projection and a head count.

:func:`find_attention` reads a module's structure, not its class, so the attention of every
library a user brings is found the same way:

* **projections**: one fused q/k/v projection and an output projection (GPT-2's
  ``c_attn``/``c_proj``, nanoGPT's ``qkv``/``proj``, Megatron's ``query_key_value``/``dense``
  as GPT-NeoX, Bloom and Falcon have it), or separate q, k, v and output projections
  (``q_proj k_proj v_proj`` with ``o_proj``, ``out_proj`` or ``dense``; T5's ``q k v o``;
  DistilBERT's ``q_lin k_lin v_lin out_lin``; ``wq wk wv wo``), or BERT's ``query key value``
  ending at the heads' context (its output projection is a sibling's ``output.dense``);
* **fused layouts**: ``c_attn``/``qkv`` hold all queries, then all keys, then all values
  (``"blockwise"``: each rank takes its heads from each third); ``query_key_value`` holds q,
  k and v head after head (``"headwise"``: each rank takes a contiguous run of heads);
* **the head count**: an attribute (``num_heads``, ``n_head``...); else the module's
  ``config`` (transformers 5 keeps ``num_attention_heads`` and ``num_key_value_heads``
  there, not on the module); else its head width (``head_dim``, ``head_size``,
  ``attention_head_size``, ``key_value_proj_dim``) and the query projection's outputs.
  Key/value heads likewise, or from the key projection's outputs (grouped-query attention),
  or one for a multi-query fused projection.

Examples
--------
>>> from torch import nn
>>> class Attn(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.head_dim = 8
...         self.q_proj, self.k_proj, self.v_proj, self.o_proj = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)
>>> found = find_attention(Attn())
>>> found.heads, found.kv_heads, found.projections
(4, 2, ('q_proj', 'k_proj', 'v_proj'))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

#: Fused layouts: (fused q/k/v projection, output projection, how q, k and v lie in it).
FUSED_ATTENTION = (
    ("qkv", "proj", "blockwise"),
    ("c_attn", "c_proj", "blockwise"),
    ("query_key_value", "dense", "headwise"),
)
#: Separate q, k, v and output projections.
SEPARATE_ATTENTION = (
    ("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "k_proj", "v_proj", "out_proj"), ("q_proj", "k_proj", "v_proj", "dense"),
    ("wq", "wk", "wv", "wo"), ("q", "k", "v", "o"), ("q_lin", "k_lin", "v_lin", "out_lin"),
)  # fmt: skip
#: Attention modules that end at the heads' context, their output projection a sibling's (BERT's ``attention.self``).
CONTEXT_ATTENTION = (("query", "key", "value"),)
#: Attributes holding the query-head and key/value-head counts, and widths the forward splits by: all divided by the group's size.
HEAD_COUNTS = ("heads", "n_head", "num_heads", "n_heads", "num_attention_heads")
KV_HEAD_COUNTS = ("num_key_value_heads", "n_kv_heads", "kv_heads", "n_kv_head")
SPLIT_WIDTHS = ("split_size", "all_head_size", "inner_dim", "embed_dim")
#: Attributes holding the width of one head.
HEAD_WIDTHS = ("head_dim", "head_size", "attention_head_size", "key_value_proj_dim")


@dataclass(frozen=True)
class Attention:
    """What :func:`find_attention` found in a module.

    Attributes
    ----------
    projections
        The q/k/v projection names (one if fused).
    output
        The output projection's name, ``None`` when the module returns its heads' context.
    heads, kv_heads
        Query and key/value head counts.
    fused
        ``None`` (separate projections), ``"blockwise"`` or ``"headwise"`` (see the module).
    counts
        The module's integer attributes that count heads or widths its forward splits by.
    """

    projections: tuple[str, ...]
    output: str | None
    heads: int
    kv_heads: int
    fused: str | None
    counts: tuple[str, ...]


def _outputs(module: nn.Module, name: str) -> int | None:
    from rapydli.parallel.tensor import linear_weight

    child = getattr(module, name, None)
    found = linear_weight(child) if isinstance(child, nn.Module) else None
    return int(found[0].shape[0]) if found is not None else None


def _int(owner: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return name, value
    return None


def _projections(module: nn.Module) -> tuple[tuple[str, ...], str | None, str | None] | None:
    for qkv, proj, fused in FUSED_ATTENTION:
        if _outputs(module, qkv) is not None and _outputs(module, proj) is not None:
            return (qkv,), proj, fused
    for names in SEPARATE_ATTENTION:
        if all(_outputs(module, n) is not None for n in names):
            return names[:3], names[3], None
    for context in CONTEXT_ATTENTION:
        if all(_outputs(module, n) is not None for n in context):
            return context, None, None
    return None


def find_attention(module: nn.Module) -> Attention | None:
    """The attention :func:`rapydli.parallel.tensor` can split by heads in ``module``, or ``None`` (rules in the module docstring)."""
    found = _projections(module)
    if found is None:
        return None
    projections, output, fused = found
    config = getattr(module, "config", None)
    query_rows = _outputs(module, projections[0]) or 0
    width = _int(module, HEAD_WIDTHS)
    heads = _int(module, HEAD_COUNTS) or _int(config, ("num_attention_heads", "n_head", "num_heads"))
    if heads is None and width is not None and fused is None and query_rows % width[1] == 0:
        heads = ("", query_rows // width[1])
    if heads is None:
        return None
    kv = _int(module, KV_HEAD_COUNTS) or _int(config, ("num_key_value_heads", "n_head_kv", "num_kv_heads"))
    if (
        kv is not None
        and config is not None
        and kv[0] not in KV_HEAD_COUNTS
        and getattr(config, "multi_query", False) is True
    ):
        kv = ("", 1)
    if kv is None and getattr(config, "multi_query", False) is True and fused is not None:
        kv = ("", 1)
    if kv is None and fused is None and width is not None:
        key_rows = _outputs(module, projections[1]) or 0
        kv = ("", key_rows // width[1]) if key_rows % width[1] == 0 and key_rows else None
    counts = tuple(n for n in (*HEAD_COUNTS, *KV_HEAD_COUNTS, *SPLIT_WIDTHS) if _int(module, (n,)) is not None)
    return Attention(projections, output, heads[1], kv[1] if kv is not None else heads[1], fused, counts)
