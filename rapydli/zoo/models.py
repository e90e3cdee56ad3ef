"""Reference models for demos, tests and benchmarks: an MLP, a small ResNet, a tiny LM.

Each builder is a plain importable function (``rapydli.zoo.models:resnet_mini``), so a
run records it as ``"module:qualname"`` and can be repeated. All models return logits;
the trainer applies cross-entropy (for the LM over every position).

Examples
--------
>>> import torch
>>> resnet_mini(num_classes=10, in_channels=1)(torch.zeros(2, 1, 8, 8)).shape
torch.Size([2, 10])
>>> tiny_lm(vocab_size=32, block_size=16)(torch.zeros(2, 16, dtype=torch.long)).shape
torch.Size([2, 16, 32])
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


def mlp(in_features: int = 64, hidden: int = 128, num_classes: int = 10, depth: int = 2) -> nn.Module:
    """A ReLU MLP over flattened inputs (``depth`` hidden layers of width ``hidden``)."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """Two 3x3 conv-BN layers with a residual connection (projection when the shape changes)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNetMini(nn.Module):
    """A small ResNet: a 3x3 stem and three stages of basic blocks (widths w, 2w, 4w).

    Works on any input size >= 8x8 (global average pooling at the end): 32x32 images
    (CIFAR-like) and sklearn's 8x8 digits alike. ``width=16, blocks=(2, 2, 2)`` has about
    0.17 M parameters.
    """

    def __init__(
        self, num_classes: int = 10, in_channels: int = 3, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2)
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        stages: list[nn.Module] = []
        channels = width
        for index, count in enumerate(blocks):
            out = width * 2**index
            for block in range(count):
                stages.append(BasicBlock(channels, out, stride=2 if index > 0 and block == 0 else 1))
                channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet_mini(
    num_classes: int = 10, in_channels: int = 3, width: int = 16, blocks: tuple[int, ...] = (2, 2, 2)
) -> nn.Module:
    """Build :class:`ResNetMini` (``in_channels=1`` for digits)."""
    return ResNetMini(num_classes, in_channels, width, blocks)


def resnet_digits() -> nn.Module:
    """:func:`resnet_mini` for sklearn's 1x8x8 digits (10 classes)."""
    return ResNetMini(num_classes=10, in_channels=1, width=16, blocks=(1, 1, 1))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention (``scaled_dot_product_attention``)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(causal_attention(self.qkv(x), self.heads))


def causal_attention(fused: torch.Tensor, heads: int) -> torch.Tensor:
    """Causal attention over a fused q/k/v projection ``(batch, length, 3 * heads * head_dim)``: ``(batch, length, heads * head_dim)``.

    The width is read from ``fused`` (fewer heads' worth when the projection is split over tensor ranks).
    """
    batch, length, _ = fused.shape
    q, k, v = fused.chunk(3, dim=2)
    head_dim = q.shape[-1] // heads
    q, k, v = (t.view(batch, length, heads, head_dim).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return y.transpose(1, 2).reshape(batch, length, heads * head_dim)


class TransformerBlock(nn.Module):
    """Pre-norm attention + MLP block, as in GPT-2."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A tiny GPT-style causal language model: tokens ``(B, T)`` -> logits ``(B, T, vocab)``."""

    def __init__(
        self, vocab_size: int = 64, block_size: int = 32, dim: int = 64, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Embedding(block_size, dim)
        blocks = [TransformerBlock(dim, heads) for _ in range(layers)]
        self.blocks = nn.Sequential(*blocks)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        for block in blocks:
            nn.init.normal_(block.attn.proj.weight, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(tokens))
        return self.head(self.ln(x))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings ``(B, T, dim)``."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """The forward as a chain of blocks, for pipeline stages (:mod:`rapydli.parallel.split`)."""
        blocks = [(f"blocks.{i}", block) for i, block in enumerate(self.blocks)]
        return [("embed", _Call(self.embed, self.tok, self.pos)), *blocks, ("head", nn.Sequential(self.ln, self.head))]

    def tensor_plan(self) -> dict[str, str]:
        """How tensor parallelism splits it (:func:`rapydli.parallel.tensor.plan_for`): heads, then each MLP column then row."""
        return {"blocks.*.attn": "heads", "blocks.*.mlp.0": "column", "blocks.*.mlp.2": "row"}


class _Call(nn.Module):
    """A block that calls ``function`` and owns the modules it uses (their parameters move with it)."""

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor], *modules: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(modules)
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


def tiny_lm(vocab_size: int = 64, block_size: int = 32, dim: int = 64, layers: int = 2, heads: int = 4) -> nn.Module:
    """Build :class:`TinyLM`."""
    return TinyLM(vocab_size, block_size, dim, layers, heads)


class ResNet18Like(nn.Module):
    """A ResNet-18-shaped network (torchvision's layout, written here: no torchvision needed).

    A 7x7 stride-2 stem with 3x3 max pooling, four stages of two :class:`BasicBlock` (widths
    64, 128, 256, 512; stride 2 and a 1x1 projection at the start of stages 2-4), global
    average pooling and a linear head: 20 bias-free convolutions, 11.2 M parameters at
    ``width=64``.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 7, 2, 3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        stages: list[nn.Module] = []
        channels = width
        for index in range(4):
            out = width * 2**index
            stages.append(nn.Sequential(BasicBlock(channels, out, stride=1 if index == 0 else 2), BasicBlock(out, out)))
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def resnet18_like(num_classes: int = 10, in_channels: int = 3, width: int = 64) -> nn.Module:
    """Build :class:`ResNet18Like` (``width=16`` for a quick, small variant of the same shape)."""
    return ResNet18Like(num_classes, in_channels, width)


class GPT2Attention(nn.Module):
    """GPT-2's attention: one fused ``c_attn`` projection to q, k, v, causal attention, ``c_proj`` back."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(causal_attention(self.c_attn(x), self.n_head))


class GPT2MLP(nn.Module):
    """GPT-2's MLP: ``c_fc`` to 4x the width, tanh-approximated GELU, ``c_proj`` back."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    """GPT-2's pre-norm block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = GPT2Attention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPT2MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    """GPT-2's ``transformer``: token and position embeddings ``wte`` and ``wpe``, the blocks ``h``, the final norm ``ln_f``."""

    def __init__(self, blocks: list[GPT2Block], vocab: int, positions: int, n_embd: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(positions, n_embd)
        self.h = nn.ModuleList(blocks)
        self.ln_f = nn.LayerNorm(n_embd)


class GPT2Style(nn.Module):
    """A GPT-2-shaped causal LM with Hugging Face's module names: tokens ``(B, T)`` -> logits ``(B, T, vocab)``.

    ``transformer.{wte, wpe, h, ln_f}`` and an ``lm_head`` tied to ``wte`` (one parameter);
    the blocks are the ``transformer.h`` ``ModuleList``, which ZeRO-3 shards and activation
    checkpointing recomputes one by one (:func:`rapydli.parallel.split.model_blocks`); the
    embeddings, ``ln_f`` and the tied head are the rest. GPT-2's initialisation (normal,
    std 0.02; the residual projections' scaled by ``1 / sqrt(2 n_layer)``); no dropout.
    Parameters: ``12 n_layer n_embd^2 + 13 n_layer n_embd + (vocab + positions + 2) n_embd``.
    """

    def __init__(
        self, vocab: int = 8192, positions: int = 64, n_embd: int = 768, n_head: int = 12, n_layer: int = 8
    ) -> None:
        super().__init__()
        blocks = [GPT2Block(n_embd, n_head) for _ in range(n_layer)]
        self.transformer = GPT2Transformer(blocks, vocab, positions, n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in blocks:
            for projection in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(projection.weight, std=0.02 / math.sqrt(2 * n_layer))
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.transformer.h:
            x = block(x)
        return self.head(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings ``(B, T, n_embd)``."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.transformer.wte(input_ids) + self.transformer.wpe(positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the tied LM head: the logits."""
        return self.lm_head(self.transformer.ln_f(x))

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """The forward as a chain of blocks (:mod:`rapydli.parallel.split`): embeddings, ``h.0`` ... ``h.N-1``, head."""
        t = self.transformer
        blocks = [(f"h.{i}", block) for i, block in enumerate(t.h)]
        return [("embed", _Call(self.embed, t.wte, t.wpe)), *blocks, ("head", _Call(self.head, t.ln_f, self.lm_head))]


def gpt2_style(
    vocab: int = 8192, positions: int = 64, n_embd: int = 768, n_head: int = 12, n_layer: int = 8
) -> nn.Module:
    """Build :class:`GPT2Style` (the defaults: 63.0 M parameters, the tied embedding counted once).

    >>> model = gpt2_style(vocab=64, positions=16, n_embd=32, n_head=4, n_layer=2)
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape, model.lm_head.weight is model.transformer.wte.weight
    (torch.Size([2, 16, 64]), True)
    """
    return GPT2Style(vocab, positions, n_embd, n_head, n_layer)


class RMSNorm(nn.Module):
    """Llama's norm: ``weight * x / sqrt(mean(x^2) + eps)``, no bias, no mean subtracted."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``(batch, heads, length, head_dim)`` (the halves rotated, as Hugging Face's Llama)."""
    length, dim = x.shape[-2], x.shape[-1]
    inverse = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim))
    angles = torch.outer(torch.arange(length, dtype=x.dtype, device=x.device), inverse)
    angles = torch.cat((angles, angles), dim=-1)
    half = dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * angles.cos() + rotated * angles.sin()


class LlamaAttention(nn.Module):
    """Separate ``q_proj``/``k_proj``/``v_proj``/``o_proj``, rotary, grouped-query attention (fewer key/value heads).

    The head counts are read from the projections' widths (``head_dim`` is fixed), so the
    module runs unchanged on a tensor rank holding whole heads of each.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads, self.num_key_value_heads = heads, kv_heads  # Hugging Face's names (what a tensor plan reads)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = (
            p(x).view(batch, length, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        q, k = rotary(q), rotary(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm: ``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(hidden), RMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    """Llama's ``model``: ``embed_tokens``, the ``layers``, the final ``norm``."""

    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)


class LlamaStyle(nn.Module):
    """A Llama-shaped causal LM with Hugging Face's module names: tokens ``(B, T)`` -> logits ``(B, T, vocab)``.

    ``model.{embed_tokens, layers, norm}`` and an untied ``lm_head``; RMSNorm, rotary
    embeddings, grouped-query attention, SwiGLU. No ``pipeline_blocks()``: a pipeline reads
    its blocks from ``forward`` (:mod:`rapydli.parallel.traced`). Weights normal with std
    0.02, as Llama's ``initializer_range``.
    """

    def __init__(
        self,
        vocab: int = 8192,
        hidden: int = 512,
        heads: int = 8,
        kv_heads: int = 4,
        intermediate: int = 1376,
        layers: int = 8,
    ) -> None:
        super().__init__()
        self.model = LlamaBody(vocab, hidden, heads, kv_heads, intermediate, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(self.model.norm(x))


def llama_style(
    vocab: int = 8192, hidden: int = 512, heads: int = 8, kv_heads: int = 4, intermediate: int = 1376, layers: int = 8
) -> nn.Module:
    """Build :class:`LlamaStyle`.

    >>> model = llama_style(vocab=64, hidden=32, heads=4, kv_heads=2, intermediate=48, layers=2)
    >>> model(torch.zeros(2, 16, dtype=torch.long)).shape
    torch.Size([2, 16, 64])
    """
    return LlamaStyle(vocab, hidden, heads, kv_heads, intermediate, layers)
