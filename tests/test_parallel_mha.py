"""PyTorch's nn.MultiheadAttention split by heads (rapydli.parallel.mha): what the whole module computes, on real ranks."""

from __future__ import annotations

import fnmatch

import pytest
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.mha import split_multihead_attention

RANKS_CODE = """
import torch
from mpi4py import MPI
from torch import nn
from rapydli.parallel.mha import split_multihead_attention
from rapydli.parallel.tensor import TensorGroup

torch.set_default_dtype(torch.float64)
comm = MPI.COMM_WORLD
group = TensorGroup(comm)
rows = lambda t, n: torch.cat([c[group.rank * n // group.size:(group.rank + 1) * n // group.size] for c in t.chunk(3)])
checked = 0
for batch_first in (True, False):
    torch.manual_seed(0)
    dense = nn.MultiheadAttention(8, 4, batch_first=batch_first)
    split = split_multihead_attention(dense, group, "attn")
    L, S, B = 5, 6, 3
    shape = (lambda n: (B, n, 8)) if batch_first else (lambda n: (n, B, 8))
    q, kv = torch.randn(*shape(L)), torch.randn(*shape(S))
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    padding = torch.zeros(B, S, dtype=torch.bool); padding[0, -2:] = True
    per_head = torch.randn(B * 4, L, S)
    calls = [
        dict(query=q, key=q, value=q, need_weights=False),
        dict(query=q, key=q, value=q, attn_mask=causal, need_weights=True),
        dict(query=q, key=q, value=q, attn_mask=nn.Transformer.generate_square_subsequent_mask(L), is_causal=True, need_weights=False),
        dict(query=q, key=kv, value=kv, key_padding_mask=padding, need_weights=True),
        dict(query=q, key=kv, value=kv, attn_mask=per_head, need_weights=True, average_attn_weights=False),
        dict(query=q, key=kv, value=kv, attn_mask=torch.randn(L, S), key_padding_mask=padding, need_weights=False),
    ]
    for kwargs in calls:
        dense.zero_grad(); split.zero_grad()
        inputs = {k: (v.clone().requires_grad_() if k in ("query", "key", "value") else v) for k, v in kwargs.items()}
        mine = {k: (v.clone().requires_grad_() if k in ("query", "key", "value") else v) for k, v in kwargs.items()}
        if mine["key"] is not None and kwargs["key"] is kwargs["query"]:
            mine["key"] = mine["value"] = mine["query"]; inputs["key"] = inputs["value"] = inputs["query"]
        elif kwargs["key"] is kwargs["value"]:
            mine["value"] = mine["key"]; inputs["value"] = inputs["key"]
        out, weights = dense(**inputs)
        got, got_weights = split(**mine)
        assert torch.allclose(out, got, atol=1e-12), (kwargs.keys(), (out - got).abs().max())
        if weights is not None:
            assert torch.allclose(weights, got_weights, atol=1e-12)
        (out.square().sum() + (weights.sum() if weights is not None else 0)).backward()
        (got.square().sum() + (got_weights.sum() if got_weights is not None else 0)).backward()
        assert torch.allclose(inputs["query"].grad, mine["query"].grad, atol=1e-12)
        assert torch.allclose(rows(dense.in_proj_weight.grad, 8), split.in_proj_weight.grad, atol=1e-12)
        assert torch.allclose(dense.out_proj.bias.grad, split.out_proj.bias.grad, atol=1e-12)
        checked += 1
counts = comm.gather(checked, root=0)
if group.rank == 0:
    print("OK", sum(counts))
"""


@pytest.mark.mpi
def test_its_heads_on_two_ranks_compute_what_the_whole_module_computes(run_mpi) -> None:
    """Self- and cross-attention, bool and float masks, causal, key padding, per-head masks, averaged and per-head weights,
    batch first or not: outputs, weights and gradients equal the whole module's (its slice of the parameters' gradients)."""
    assert "OK 24" in run_mpi(RANKS_CODE, n=2, timeout=180).stdout


class _One:
    rank, size = 0, 2


@pytest.mark.parametrize(
    ("module", "named"),
    [
        (nn.MultiheadAttention(8, 4, kdim=6, vdim=6), "separate kdim/vdim"),
        (nn.MultiheadAttention(8, 4, add_bias_kv=True), "add_bias_kv"),
        (nn.MultiheadAttention(9, 3), "3 heads do not split"),
    ],
    ids=["kdim", "bias-kv", "heads"],
)
def test_what_it_cannot_split_is_refused_naming_it(module: nn.MultiheadAttention, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        split_multihead_attention(module, _One(), "attn")


def test_the_built_in_plan_splits_multihead_attention_in_pytorchs_transformer_layers() -> None:
    from rapydli.parallel.tensor_plans import plan_for

    layer = nn.TransformerEncoderLayer(8, 4, 16, batch_first=True)
    model = nn.Sequential(nn.Embedding(10, 8), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    plan = plan_for(model, 2)
    assert [style for pattern, style in plan.items() if fnmatch.fnmatchcase("1.layers.0.self_attn", pattern)] == [
        "heads"
    ], plan
