"""Small models written the way the codebases users bring write them (Hugging Face GPT-2, Llama).

Not imported from ``transformers``: these are short copies of the shapes that matter to
the parallel layouts (module names, fused or separate projections, ``Conv1D``'s transposed
weight, tied or untied embeddings, ``forward(input_ids, labels=None)`` returning a
``ModelOutput``-like mapping), each with the ``pipeline_blocks()`` a user may add to pipeline it;
:func:`as_written` gives each class without it, as its codebase has it (pipelined by tracing).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F
from train_cases import Block, ModelOutput


def lm_loss(outputs: object, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the logits (a tensor, or a ModelOutput's ``logits``) in their own precision."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs["logits"]  # type: ignore[index]
    return token_loss(logits, targets)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the models' ``forward`` computes from ``labels``, as Hugging Face's ``CrossEntropyLoss`` over the flattened tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def as_written(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` as its codebase writes it: without the ``pipeline_blocks()`` added here (same name, same modules)."""
    return type(cls.__name__, (cls,), {"pipeline_blocks": None, "__module__": cls.__module__})


# -- GPT-2 (transformers.models.gpt2) -----------------------------------------------------------


class Conv1D(nn.Module):
    """Hugging Face's ``Conv1D``: a linear layer whose weight is stored ``(in, out)``: ``y = x @ W + b``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], self.nf)


class GPT2Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = n_embd, n_head, n_embd // n_head
        self.split_size = n_embd
        self.c_attn = Conv1D(3 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, n_embd)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, _ = hidden.shape
        q, k, v = self.c_attn(hidden).split(self.split_size, dim=2)
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(b, t, -1))


class GPT2MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * n_embd, n_embd)
        self.c_proj = Conv1D(n_embd, 4 * n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = GPT2Attention(n_embd, n_head)
        self.mlp = GPT2MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab: int, positions: int, n_embd: int, n_head: int, n_layer: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(positions, n_embd)
        self.h = nn.ModuleList(GPT2Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)


class _Embeddings(nn.Module):
    """Stage 0's first block: token plus position embeddings (shares the model's modules)."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding) -> None:
        super().__init__()
        self.wte, self.wpe = wte, wpe

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))


class _Head(nn.Module):
    """The last block: final norm and the LM head (returns the logits)."""

    def __init__(self, ln_f: nn.LayerNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.ln_f, self.lm_head = ln_f, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT2LMHeadModel(nn.Module):
    """``transformer.{wte, wpe, h, ln_f}`` and ``lm_head`` tied to ``wte``; ``forward(input_ids, labels=None) -> ModelOutput``."""

    def __init__(
        self, vocab: int = 32, positions: int = 8, n_embd: int = 16, n_head: int = 4, n_layer: int = 2, tie: bool = True
    ) -> None:
        super().__init__()
        self.transformer = GPT2Model(vocab, positions, n_embd, n_head, n_layer)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.transformer.wte.weight

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in t.h:
            x = block(x)
        logits = self.lm_head(t.ln_f(x))
        loss = token_loss(logits, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=logits)

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        t = self.transformer
        blocks: list[tuple[str, nn.Module]] = [("embed", _Embeddings(t.wte, t.wpe))]
        blocks += [(f"h.{i}", block) for i, block in enumerate(t.h)]
        return blocks + [("head", _Head(t.ln_f, self.lm_head))]


def gpt2(tie: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(tie=tie)


# -- nanoGPT (karpathy/nanoGPT, model.py) -- defined outside the test modules, whose asserts pytest rewrites


class NanoGPT(nn.Module):
    """nanoGPT's ``GPT`` as its model.py writes it: a ModuleDict ``transformer``, ``idx.size()``, the length assert,
    and without targets only the last position's logits."""

    def __init__(self, vocab: int = 32, block_size: int = 8, n_embd: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, n_embd), "wpe": nn.Embedding(block_size, n_embd), "drop": nn.Dropout(0.1),
            "h": nn.ModuleList(Block(n_embd, 2, block_size) for _ in range(n_layer)), "ln_f": nn.LayerNorm(n_embd),
        })  # fmt: skip
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}, block size is only {self.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


# -- Llama (transformers.models.llama) ------------------------------------------------------------


class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``(B, heads, T, head_dim)``."""
    t, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=x.dtype, device=x.device) / dim))
    freqs = torch.outer(torch.arange(t, dtype=x.dtype, device=x.device), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return x * emb.cos() + _rotate_half(x) * emb.sin()


class LlamaAttention(nn.Module):
    """Separate q/k/v/o projections, grouped-query attention (fewer key/value heads)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.num_heads, self.num_key_value_heads = heads, kv_heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rotary(q), rotary(k)
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf")).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(b, t, -1))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, intermediate: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = LlamaRMSNorm(hidden), LlamaRMSNorm(hidden)
        self.self_attn = LlamaAttention(hidden, heads, kv_heads)
        self.mlp = LlamaMLP(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hidden, heads, kv_heads, intermediate) for _ in range(layers))
        self.norm = LlamaRMSNorm(hidden)


class _LlamaHead(nn.Module):
    def __init__(self, norm: LlamaRMSNorm, lm_head: nn.Linear) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


class LlamaForCausalLM(nn.Module):
    """``model.{embed_tokens, layers, norm}`` and an untied ``lm_head``; ``forward(input_ids, labels=None) -> ModelOutput``."""

    def __init__(
        self,
        vocab: int = 32,
        hidden: int = 16,
        heads: int = 4,
        kv_heads: int = 2,
        intermediate: int = 24,
        layers: int = 2,
    ) -> None:
        super().__init__()
        self.model = LlamaModel(vocab, hidden, heads, kv_heads, intermediate, layers)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        logits = self.lm_head(self.model.norm(x))
        return ModelOutput(loss=token_loss(logits, labels) if labels is not None else None, logits=logits)

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        blocks: list[tuple[str, nn.Module]] = [("embed_tokens", self.model.embed_tokens)]
        blocks += [(f"layers.{i}", layer) for i, layer in enumerate(self.model.layers)]
        return blocks + [("head", _LlamaHead(self.model.norm, self.lm_head))]


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM()


# -- BERT (transformers.models.bert) ---------------------------------------------------------------


class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, positions: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(positions, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    """query / key / value with the heads' context as output (the output projection is the sibling ``BertSelfOutput``)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, hidden // heads
        self.all_head_size = heads * self.attention_head_size
        self.query, self.key, self.value = (
            nn.Linear(hidden, self.all_head_size),
            nn.Linear(hidden, self.all_head_size),
            nn.Linear(hidden, self.all_head_size),
        )

    def transpose_for_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(*x.shape[:-1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
        q, k, v = (self.transpose_for_scores(p(hidden_states)) for p in (self.query, self.key, self.value))
        probs = ((q @ k.transpose(-1, -2)) / math.sqrt(self.attention_head_size)).softmax(-1)
        context = (probs @ v).permute(0, 2, 1, 3).contiguous()
        return (context.view(*context.shape[:-2], self.all_head_size),)  # a tuple, as Hugging Face's


class BertSelfOutput(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(hidden, hidden), nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.self, self.output = BertSelfAttention(hidden, heads), BertSelfOutput(hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden_states)[0], hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(BertSelfOutput):
    def __init__(self, intermediate: int, hidden: int) -> None:
        nn.Module.__init__(self)
        self.dense, self.LayerNorm = nn.Linear(intermediate, hidden), nn.LayerNorm(hidden, eps=1e-12)


class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        self.attention = BertAttention(hidden, heads)
        self.intermediate, self.output = BertIntermediate(hidden, intermediate), BertOutput(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attended = self.attention(x)
        return self.output(self.intermediate(attended), attended)


class BertPooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    def __init__(self, vocab: int, positions: int, hidden: int, heads: int, intermediate: int, layers: int) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, positions, hidden)
        self.encoder = nn.ModuleDict(
            {"layer": nn.ModuleList(BertLayer(hidden, heads, intermediate) for _ in range(layers))}
        )
        self.pooler = BertPooler(hidden)


class _BertClassifierHead(nn.Module):
    def __init__(self, classifier: nn.Linear) -> None:
        super().__init__()
        self.classifier = classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x)


class BertForTokenClassification(nn.Module):
    """``bert.{embeddings, encoder.layer, pooler}`` and a token ``classifier``; ``forward(input_ids, labels=None) -> ModelOutput``.

    The pooler's output is returned but no loss reads it: its parameters never get a
    gradient (Hugging Face's ``BertModel`` always computes it).
    """

    def __init__(
        self,
        vocab: int = 32,
        positions: int = 8,
        hidden: int = 16,
        heads: int = 4,
        intermediate: int = 32,
        layers: int = 2,
        labels: int = 32,
    ) -> None:
        super().__init__()
        self.bert = BertModel(vocab, positions, hidden, heads, intermediate, layers)
        self.classifier = nn.Linear(hidden, labels)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        x = self.bert.embeddings(input_ids)
        for layer in self.bert.encoder["layer"]:
            x = layer(x)
        pooled = self.bert.pooler(x)
        logits = self.classifier(x)
        return ModelOutput(
            loss=token_loss(logits, labels) if labels is not None else None, logits=logits, pooler_output=pooled
        )

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        blocks: list[tuple[str, nn.Module]] = [("embeddings", self.bert.embeddings)]
        blocks += [(f"layer.{i}", layer) for i, layer in enumerate(self.bert.encoder["layer"])]
        return blocks + [("head", _BertClassifierHead(self.classifier))]


def bert() -> BertForTokenClassification:
    torch.manual_seed(0)
    return BertForTokenClassification()
