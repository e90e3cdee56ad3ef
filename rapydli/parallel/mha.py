"""PyTorch's ``nn.MultiheadAttention`` split by heads over a tensor-parallel group.

``nn.MultiheadAttention`` keeps its q, k and v projections in one parameter,
``in_proj_weight`` (all queries' rows, then the keys', then the values'), and its output
projection in ``out_proj``. :class:`HeadParallelMultiheadAttention` keeps this rank's heads:
its rows of each third of ``in_proj_weight``/``in_proj_bias`` (the same names, so a
one-process state dict maps onto it part by part) and the matching columns of ``out_proj``
(row-parallel: the partial outputs are summed over the group, the bias added once). Its
``forward`` takes the module's arguments (``key_padding_mask``, ``attn_mask``,
``need_weights``, ``is_causal``, batch first or not) and computes what the whole module
computes, through ``scaled_dot_product_attention`` on the local heads.

What it does not split (refused by :func:`split_multihead_attention` with a
:class:`~rapydli.errors.ConfigError`, so a built-in plan leaves the module dense): separate
``kdim``/``vdim`` projections, ``add_bias_kv``, ``add_zero_attn``, heads that do not divide.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rapydli.errors import ConfigError


class HeadParallelMultiheadAttention(nn.Module):
    """This rank's heads of an ``nn.MultiheadAttention`` (see the module); build it with :func:`split_multihead_attention`."""

    #: ``in_proj_weight``/``in_proj_bias`` keep one block of rows per third (q, k, v), as a column-parallel layer with 3 chunks.
    chunks = 3

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        out_proj: nn.Module,
        heads: int,
        total_heads: int,
        batch_first: bool,
        dropout: float,
        group: Any,
    ) -> None:
        super().__init__()
        self.in_proj_weight = nn.Parameter(weight)
        self.in_proj_bias = nn.Parameter(bias) if bias is not None else None
        self.out_proj = out_proj
        self.num_heads, self.total_heads = heads, total_heads
        self.head_dim = weight.shape[0] // (3 * heads)
        self.batch_first, self.dropout, self.group = batch_first, dropout, group
        self.embed_dim = weight.shape[1]
        self._qkv_same_embed_dim = (
            True  # what nn.TransformerEncoderLayer's fast path asks; it declines on training and no bias
        )
        self.bias_k = self.bias_v = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from rapydli.parallel.tensor import _entering, _GatherFromGroup, _ReduceFromGroup

        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        if self.batch_first or not batched:
            query, key, value = (t.transpose(0, 1) if self.batch_first else t for t in (query, key, value))
        # (length, batch, embed) from here, as nn.MultiheadAttention computes
        w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(_entering(query, self.group), w_q, b_q)
        k = F.linear(_entering(key, self.group), w_k, b_k)
        v = F.linear(_entering(value, self.group), w_v, b_v)
        length, batch, source = q.shape[0], q.shape[1], k.shape[0]
        q, k, v = (t.reshape(t.shape[0], batch * self.num_heads, self.head_dim).transpose(0, 1) for t in (q, k, v))
        mask = _mask(attn_mask, key_padding_mask, batch, self.total_heads, length, source, q.dtype)
        if mask is not None:  # this rank's heads of a per-head mask
            mask = mask.view(batch, self.total_heads, -1, source)[:, self._heads()] if mask.dim() == 3 else mask
        q, k, v = (t.view(batch, self.num_heads, -1, self.head_dim) for t in (q, k, v))
        if mask is not None and mask.dim() == 2:
            mask = mask.view(1, 1, length, source)
        dropout = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal and mask is None
        )
        out = out.permute(2, 0, 1, 3).reshape(length, batch, self.num_heads * self.head_dim)
        out = self.out_proj(out)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        elif not batched:
            out = out.squeeze(1)
        weights = None
        if need_weights:  # every head's weights, summed over the group, as the whole module averages (or returns) them
            scores = (q @ k.transpose(-2, -1)) / self.head_dim**0.5
            if mask is not None:
                scores = scores + mask
            elif is_causal:
                scores = scores.masked_fill(
                    torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1), float("-inf")
                )
            local = scores.softmax(-1)
            if average_attn_weights:
                weights = _ReduceFromGroup.apply(local.sum(1), self.group) / self.total_heads
            else:  # every rank's heads, in order: gathered along the last dimension and moved back
                weights = _GatherFromGroup.apply(local.permute(0, 2, 3, 1).contiguous(), self.group).permute(0, 3, 1, 2)
            if not batched:
                weights = weights.squeeze(0)
        return out, weights

    def _heads(self) -> slice:
        return slice(self.group.rank * self.num_heads, (self.group.rank + 1) * self.num_heads)


def _mask(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    batch: int,
    heads: int,
    length: int,
    source: int,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """One additive float mask from ``attn_mask`` ((L, S) or (B*heads, L, S)) and ``key_padding_mask`` ((B, S)), as the whole module merges them."""
    merged = None
    if attn_mask is not None:
        merged = (
            torch.zeros_like(attn_mask, dtype=dtype).masked_fill(attn_mask, float("-inf"))
            if attn_mask.dtype == torch.bool
            else attn_mask.to(dtype)
        )
    if key_padding_mask is not None:
        padding = (
            torch.zeros_like(key_padding_mask, dtype=dtype).masked_fill(key_padding_mask, float("-inf"))
            if key_padding_mask.dtype == torch.bool
            else key_padding_mask.to(dtype)
        )
        padding = padding.view(batch, 1, 1, source).expand(batch, heads, 1, source).reshape(batch * heads, 1, source)
        merged = (
            padding
            if merged is None
            else (merged.view(-1, length, source) if merged.dim() == 3 else merged.unsqueeze(0)) + padding
        )
    return merged


def split_multihead_attention(module: nn.MultiheadAttention, group: Any, name: str) -> HeadParallelMultiheadAttention:
    """This rank's heads of ``module`` (``group``: the tensor-parallel group); raises :class:`ConfigError` for what it cannot split."""
    from rapydli.parallel.tensor import RowParallelLinear

    what = f"tensor plan {name!r} (nn.MultiheadAttention: {module.num_heads} heads, embed_dim {module.embed_dim})"
    if not module._qkv_same_embed_dim or module.in_proj_weight is None:
        raise ConfigError(f"{what}: separate kdim/vdim projections are not split; leave it out of the plan (dense)")
    if module.bias_k is not None or module.add_zero_attn:
        raise ConfigError(f"{what}: add_bias_kv / add_zero_attn are not split; leave it out of the plan (dense)")
    if module.num_heads % group.size:
        raise ConfigError(
            f"{what}: {module.num_heads} heads do not split over tensor_parallel={group.size} into whole heads; "
            f"use a tensor_parallel that divides {module.num_heads}, or leave {name!r} out of the plan (dense)"
        )
    heads = module.num_heads // group.size
    block, rows = module.embed_dim, module.embed_dim // group.size
    index = torch.cat(
        [torch.arange(c * block + group.rank * rows, c * block + (group.rank + 1) * rows) for c in range(3)]
    )
    weight = module.in_proj_weight.detach()[index].clone()
    bias = module.in_proj_bias.detach()[index].clone() if module.in_proj_bias is not None else None
    out_proj = RowParallelLinear.from_dense(module.out_proj, group, name=f"{name}.out_proj")
    return HeadParallelMultiheadAttention(
        weight, bias, out_proj, heads, module.num_heads, module.batch_first, module.dropout, group
    )
