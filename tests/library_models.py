"""The models users bring, from the libraries they come from: one table of architectures for the conformance matrix.

Each :class:`Architecture` builds an unchanged class of ``transformers`` (from its config
class, tiny, random init: no download) or of PyTorch itself (``nn.Transformer``,
``nn.TransformerEncoder``, ``nn.MultiheadAttention``), the way ``transformers``' own
``ModelTester`` sizes them (vocabulary 99, width 32, 2 layers, 4 heads), and says what it
is trained on. ``model_fn`` builds it as users do in float64 tests: ``Model(cfg).double()``
or ``.to(torch.float64)`` (alternating by architecture), so ``post_init`` re-initialises
the weights and the conversion ends construction.

Losses: a causal or masked LM and a classifier get ``exact_loss`` (cross-entropy in the
logits' own precision: transformers' ``ForCausalLMLoss`` computes in float32); an
encoder-decoder computes its own loss from ``labels`` (its forward shifts them into the
decoder's inputs), in float64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

VOCAB, WIDTH, LAYERS, HEADS, FFN, SEQ = 99, 32, 2, 4, 64, 8  # FFN divisible: tensor parallelism splits the MLPs too
SAMPLES = 24


def exact_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a tensor, or a ModelOutput's ``logits``) in their own precision."""
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tokens(
    samples: int = SAMPLES, seq: int = SEQ, vocab: int = VOCAB, low: int = 2
) -> tuple[TensorDataset, TensorDataset]:
    """Token sequences and their next tokens (a shifted copy), from a fixed generator."""
    generator = torch.Generator().manual_seed(1234)
    data = torch.randint(low, vocab, (samples + 4, seq + 1), generator=generator)
    train, val = data[:samples], data[samples:]
    return TensorDataset(train[:, :-1], train[:, 1:]), TensorDataset(val[:, :-1], val[:, 1:])


def images(
    samples: int = SAMPLES, channels: int = 3, size: int = 8, classes: int = 3
) -> tuple[TensorDataset, TensorDataset]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples + 4, channels, size, size, generator=generator)
    y = torch.randint(0, classes, (samples + 4,), generator=generator)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def audio(
    samples: int = SAMPLES, mels: int = 8, frames: int = 16, seq: int = SEQ
) -> tuple[TensorDataset, TensorDataset]:
    """Log-mel-like features and the token labels a speech model is trained to emit."""
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(samples + 4, mels, frames, generator=generator)
    y = torch.randint(2, VOCAB, (samples + 4, seq), generator=generator)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


# -- PyTorch's own modules, as their tutorials put them together ------------------------------------


class TorchEncoderLM(nn.Module):
    """A causal LM on ``nn.TransformerEncoder`` (PyTorch's language-modelling tutorial): learned positions, untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Parameter(torch.zeros(1, SEQ, WIDTH))
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.positions[:, : idx.shape[1]]
        return self.head(self.encoder(x, mask=self.mask[: idx.shape[1], : idx.shape[1]].to(x.dtype), is_causal=True))


class TorchSeq2Seq(nn.Module):
    """``nn.Transformer`` (encoder and decoder) on tokens, the decoder reading the sequence shifted right; a tied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, HEADS, LAYERS, LAYERS, FFN, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shifted = torch.cat([torch.zeros_like(idx[:, :1]), idx[:, :-1]], dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(
            idx.shape[1], dtype=self.embed.weight.dtype, device=idx.device
        )
        return self.head(self.transformer(self.embed(idx), self.embed(shifted), tgt_mask=mask, tgt_is_causal=True))


class MHABlock(nn.Module):
    """A pre-norm block on ``nn.MultiheadAttention`` and an MLP in an ``nn.Sequential``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class MHAClassifier(nn.Module):
    """Token classification with blocks of ``nn.MultiheadAttention`` (non-causal)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(MHABlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# -- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Architecture:
    """One model of the matrix: how to build it (float32, as its library builds it), its data and its loss."""

    name: str
    library: str  # "transformers" or "torch"
    kind: str  # what it is, for the README's table
    build: Callable[[], nn.Module]
    data: Callable[[], tuple[TensorDataset, TensorDataset]]
    loss: Callable[..., torch.Tensor] | None = exact_loss  # None: the model's own loss from labels
    conversion: str = (
        "double"  # how model_fn makes it float64: "double" (Model(cfg).double()) or "to" (.to(torch.float64))
    )

    def model_fn(self) -> nn.Module:
        torch.manual_seed(0)
        model = self.build()
        return model.double() if self.conversion == "double" else model.to(torch.float64)


def _hf(cls_name: str, config_name: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))

    build.__qualname__ = f"{cls_name}({config_name})"
    return build


_DEC = dict(
    vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN
)
_NO_DROP = dict(hidden_dropout=0.0, attention_dropout=0.0)

ARCHITECTURES = [
    Architecture("gpt2", "transformers", "decoder: learned positions, tied head, fused Conv1D q/k/v",
                 _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS, n_positions=16,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0), tokens),
    Architecture("llama", "transformers", "decoder: rotary, GQA, SwiGLU, untied head",
                 _hf("LlamaForCausalLM", "LlamaConfig", **_DEC, num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False),
                 tokens, conversion="to"),
    Architecture("gpt_neox", "transformers", "decoder: partial rotary, parallel residual, fused head-wise q/k/v",
                 _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_DEC, max_position_embeddings=16, use_parallel_residual=True, rotary_pct=0.5,
                     **_NO_DROP), tokens),
    Architecture("bloom", "transformers", "decoder: ALiBi, fused head-wise q/k/v, tied head",
                 _hf("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=WIDTH, n_layer=LAYERS, n_head=HEADS, **_NO_DROP),
                 tokens, conversion="to"),
    Architecture("opt", "transformers", "decoder: learned offset positions, tied head",
                 _hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     ffn_dim=FFN, max_position_embeddings=16, word_embed_proj_dim=WIDTH, dropout=0.0, attention_dropout=0.0), tokens),
    Architecture("mixtral", "transformers", "decoder: mixture of experts (4 experts, top 2), GQA",
                 _hf("MixtralForCausalLM", "MixtralConfig", **_DEC, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                     max_position_embeddings=16, experts_implementation="eager"), tokens, conversion="to"),  # torch's grouped_mm takes no float64
    Architecture("qwen2", "transformers", "decoder: rotary, GQA, q/k/v bias",
                 _hf("Qwen2ForCausalLM", "Qwen2Config", **_DEC, num_key_value_heads=2, max_position_embeddings=16), tokens),
    Architecture("phi", "transformers", "decoder: parallel attention and MLP, partial rotary",
                 _hf("PhiForCausalLM", "PhiConfig", **_DEC, max_position_embeddings=16, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0,
                     attention_dropout=0.0), tokens, conversion="to"),
    Architecture("falcon", "transformers", "decoder: ALiBi, multi-query, parallel attention",
                 _hf("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                     alibi=True, new_decoder_architecture=False, multi_query=True, parallel_attn=True, bias=False, **_NO_DROP), tokens),
    Architecture("bert", "transformers", "encoder: masked LM, learned positions, tied head",
                 _hf("BertForMaskedLM", "BertConfig", **_DEC, max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                 tokens, conversion="to"),
    Architecture("distilbert", "transformers", "encoder: masked LM, q_lin/k_lin/v_lin",
                 _hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN,
                     max_position_embeddings=16, dropout=0.0, attention_dropout=0.0), tokens),
    Architecture("roberta", "transformers", "encoder: masked LM, padding-offset positions",
                 _hf("RobertaForMaskedLM", "RobertaConfig", **_DEC, max_position_embeddings=20, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0), tokens, conversion="to"),
    Architecture("t5", "transformers", "encoder-decoder: relative position buckets, tied embeddings",
                 _hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=WIDTH, d_kv=8, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS,
                     dropout_rate=0.0, decoder_start_token_id=0), tokens, loss=None),
    Architecture("bart", "transformers", "encoder-decoder: learned positions",
                 _hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=WIDTH, encoder_layers=LAYERS, decoder_layers=LAYERS,
                     encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                     max_position_embeddings=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0), tokens, loss=None, conversion="to"),
    Architecture("whisper", "transformers", "audio encoder-decoder: convolutional front end",
                 _hf("WhisperForConditionalGeneration", "WhisperConfig", vocab_size=VOCAB, num_mel_bins=8, d_model=WIDTH, encoder_layers=LAYERS,
                     decoder_layers=LAYERS, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN,
                     max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                     decoder_start_token_id=0, pad_token_id=0), audio, loss=None),
    Architecture("vit", "transformers", "vision transformer: patches, class token",
                 _hf("ViTForImageClassification", "ViTConfig", image_size=8, patch_size=4, num_channels=3, **_DEC, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=3), images, conversion="to"),
    Architecture("resnet", "transformers", "CNN: residual stages, BatchNorm",
                 _hf("ResNetForImageClassification", "ResNetConfig", num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                     layer_type="basic", num_labels=3), images),
    Architecture("torch_encoder_lm", "torch", "nn.TransformerEncoder causal LM", TorchEncoderLM, tokens, conversion="to"),
    Architecture("torch_transformer", "torch", "nn.Transformer encoder-decoder, tied head", TorchSeq2Seq, tokens),
    Architecture("torch_mha", "torch", "nn.MultiheadAttention blocks in a ModuleList", MHAClassifier, tokens, conversion="to"),
]  # fmt: skip

MODELS = {a.name: a for a in ARCHITECTURES}
