"""Tensor parallelism, Megatron style: linear layers split across the ranks of a group.

A :class:`ColumnParallelLinear` keeps ``out_features / size`` rows of the weight: its
input passes through ``f`` (identity forward, allreduce of the input gradient backward)
and its output stays split along the last dimension. A :class:`RowParallelLinear` keeps
``in_features / size`` columns: it takes the split input, and ``g`` (allreduce forward,
identity backward) sums the partial outputs before the bias. A column layer followed by a
row layer (an MLP, or attention's fused ``qkv`` and output projection with the heads
split) costs one allreduce forward and one backward.

:func:`parallelize` swaps the layers of a dense model in place, in the spirit of torch's
``parallelize_module``: a plan maps module names (glob patterns) to ``"column"``,
``"row"``, ``"heads"`` or ``"vocab"``. A linear layer is an ``nn.Linear`` or Hugging Face's ``Conv1D``
(weight stored ``(in, out)``; :func:`linear_weight`). ``"heads"`` splits an attention
module into whole heads per rank: a fused ``qkv``/``c_attn`` projection per head (q, k
and v blocks each), or separate ``q_proj``/``k_proj``/``v_proj`` with grouped-query
attention (each rank keeps ``heads / size`` query heads and the ``kv_heads / size``
key/value heads they read), the output projection row-parallel, and the module's head
counts (and ``split_size``) divided. ``"vocab"`` splits the vocabulary: an ``nn.Embedding``
(:class:`VocabParallelEmbedding`: each rank looks up the tokens of its rows, the partial
embeddings are summed) or the LM head (:class:`VocabParallelHead`: each rank computes the
logits of its rows, gathered whole for the loss). An embedding and a head that share
one weight (tied) stay one parameter when both are ``"vocab"``: each rank keeps the same
rows of it. Each rank keeps its slice of the dense weights, so a
parallelized model computes what the dense one does. Built-in plans by model structure
and the shape-only check of a plan are in :mod:`rapydli.parallel.tensor_plans`.

Examples
--------
On every rank of a 2-rank group::

    group = TensorGroup(MPI.COMM_WORLD)
    block = parallelize(nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)), {"0": "column", "2": "row"}, group)
    y = block(x)                      # equals the dense block's output on every rank

Training reaches this through ``TrainConfig(tensor_parallel=2, tensor_plan=...)``: the
Trainer calls :func:`shard_model` with the tensor-parallel communicator of its
:class:`~rapydli.parallel.grid.ProcessGrid`.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F

from rapydli.errors import ConfigError
from rapydli.parallel.attention import find_attention
from rapydli.parallel.config import TENSOR_STYLES as STYLES
from rapydli.parallel.mha import HeadParallelMultiheadAttention, split_multihead_attention


class TensorGroup:
    """The ranks that share one layer's weights, over an mpi4py communicator.

    Attributes
    ----------
    rank, size
        This rank in the group and the group's size.
    allreduces
        ``{"forward": n, "backward": n}``: the allreduces done so far in each direction.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.allreduces = {"forward": 0, "backward": 0}
        self._entered: tuple[Any, ...] | None = None  # the column layers' shared input (:func:`_entering`)

    def allreduce(self, tensor: torch.Tensor, direction: str) -> torch.Tensor:
        """The sum of ``tensor`` over the group (a new tensor), counted under ``direction``."""
        return self._reduce(tensor, direction, MPI.SUM)

    def maximum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``tensor`` over the group (a new tensor), counted as forward."""
        return self._reduce(tensor, "forward", MPI.MAX)

    def _reduce(self, tensor: torch.Tensor, direction: str, op: Any) -> torch.Tensor:
        self.allreduces[direction] += 1
        if self.size == 1:
            return tensor
        # float16/bfloat16 (autocast's activations) have no MPI type: reduced in float32, then rounded once
        wide = tensor.dtype in (torch.float16, torch.bfloat16)
        host = tensor.detach().contiguous().to("cpu", torch.float32 if wide else tensor.dtype, copy=True)
        self.comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=op)
        return host.to(tensor.device, tensor.dtype)

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dimension, in rank order (a new tensor), counted as forward."""
        self.allreduces["forward"] += 1
        if self.size == 1:
            return tensor
        local = tensor.detach().contiguous().cpu()
        gathered = torch.empty((self.size, *local.shape), dtype=local.dtype)
        self.comm.Allgather(
            [_bytes(local), MPI.BYTE], [_bytes(gathered), MPI.BYTE]
        )  # as bytes: any dtype, bfloat16 too
        return torch.cat(gathered.unbind(0), dim=-1).to(tensor.device)


def _bytes(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor as a numpy array sharing its memory."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


class _CopyToGroup(torch.autograd.Function):
    """``f``: identity forward; the input gradient is summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.group.allreduce(grad, "backward"), None


def _entering(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` entering column-parallel layers (``f``), once per input: layers that read the same tensor share one copy.

    q, k and v projections (and SwiGLU's gate and up) all read the same ``x``: with one
    ``f`` each, backward would allreduce each one's partial input gradient; sharing one,
    autograd sums the three first and ``f`` allreduces once, as Megatron-LM's single ``f``
    before a fused projection does. The copy is reused only for the same tensor object at
    the same version and gradient mode, and forgotten when a row-parallel layer runs (the
    end of the attention or MLP that read it).
    """
    last = getattr(group, "_entered", None)
    if last is not None and last[0]() is x and last[1] == (x._version, torch.is_grad_enabled()):
        return last[2]
    copied = _CopyToGroup.apply(x, group)
    group._entered = (weakref.ref(x), (x._version, torch.is_grad_enabled()), copied)
    return copied


class _ReduceFromGroup(torch.autograd.Function):
    """``g``: the partial outputs are summed over the group forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        return group.allreduce(x, "forward")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _split(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ConfigError(
            f"{what}={size} does not split over tensor_parallel={parts}: it must be a multiple of {parts}"
        )
    return size // parts


def linear_weight(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(weight as (out, in), bias)`` of a linear layer, or ``None`` if ``module`` is not one.

    A linear layer is an ``nn.Linear`` or Hugging Face's ``Conv1D`` (GPT-2), which stores
    its weight transposed, ``(in, out)``, and computes ``x @ W + b``.
    """
    if isinstance(module, nn.Linear):
        return module.weight, module.bias
    weight = getattr(module, "weight", None)
    if (
        type(module).__name__ == "Conv1D"
        and isinstance(weight, torch.Tensor)
        and weight.ndim == 2
        and getattr(module, "nf", None) == weight.shape[1]
    ):
        return weight.t(), getattr(module, "bias", None)
    return None


class ColumnParallelLinear(nn.Module):
    """``y[..., shard] = x @ W[shard].T + b[shard]``: this rank's slice of the output features.

    ``chunks`` > 1 splits each of that many equal blocks of the output features (a fused
    ``qkv`` projection: every rank keeps its heads of q, of k and of v). The weight is
    kept ``(out, in)`` whatever the dense layer stored; ``dense_transposed`` says the dense
    layer stored it ``(in, out)`` (a ``Conv1D``), which checkpoints keep.
    """

    #: The dense layer stored its weight ``(in, out)`` (Hugging Face's ``Conv1D``).
    dense_transposed = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TensorGroup, chunks: int = 1) -> None:
        super().__init__()
        self.group, self.chunks = group, chunks
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Module, group: TensorGroup, chunks: int = 1, name: str = "") -> ColumnParallelLinear:
        """This rank's rows of ``linear``'s weight (and bias); ``linear`` as :func:`linear_weight` reads it."""
        weight, bias = _dense(linear, name, "column")
        block = _split(weight.shape[0], chunks, f"{name or 'the layer'}: out_features / chunks")
        rows = _split(block, group.size, f"{name or 'the layer'}: out_features")
        index = torch.cat(
            [torch.arange(c * block + group.rank * rows, c * block + (group.rank + 1) * rows) for c in range(chunks)]
        )
        kept = bias.detach()[index].clone() if bias is not None else None
        split = cls(weight.detach()[index].clone(), kept, group, chunks)
        split.dense_transposed = not isinstance(linear, nn.Linear)
        return split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_entering(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x[..., shard] @ W[:, shard].T``, plus the (whole) bias once; ``dense_transposed`` as for a column layer."""

    #: The dense layer stored its weight ``(in, out)`` (Hugging Face's ``Conv1D``).
    dense_transposed = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TensorGroup) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight)
        self.bias = nn.Parameter(bias) if bias is not None else None

    @classmethod
    def from_dense(cls, linear: nn.Module, group: TensorGroup, name: str = "") -> RowParallelLinear:
        """This rank's columns of ``linear``'s weight; the bias is kept whole."""
        weight, bias = _dense(linear, name, "row")
        columns = _split(weight.shape[1], group.size, f"{name or 'the layer'}: in_features")
        kept = weight.detach()[:, group.rank * columns : (group.rank + 1) * columns].clone()
        split = cls(kept, bias.detach().clone() if bias is not None else None, group)
        split.dense_transposed = not isinstance(linear, nn.Linear)
        return split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.group._entered = None  # the column layers' shared input is behind us (:func:`_entering`)
        y = _ReduceFromGroup.apply(F.linear(x, self.weight), self.group)
        return y + self.bias if self.bias is not None else y


class _GatherFromGroup(torch.autograd.Function):
    """The ranks' slices concatenated along the last dimension forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: TensorGroup) -> torch.Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        return group.gather_last(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        start = ctx.group.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def _vocabulary_rows(vocab: int, group: TensorGroup, name: str) -> tuple[int, int]:
    """``(first, end)``: the vocabulary rows this rank keeps."""
    rows = _split(vocab, group.size, f"{name or 'the layer'}: vocabulary size")
    return group.rank * rows, (group.rank + 1) * rows


def _kept_rows(weight: torch.Tensor, first: int, end: int, kept: dict[int, nn.Parameter] | None) -> nn.Parameter:
    """This rank's rows of ``weight`` as a parameter; one parameter per dense weight (``kept`` remembers it, so tied modules share it)."""
    if kept is not None and id(weight) in kept:
        return kept[id(weight)]
    sliced = nn.Parameter(weight.detach()[first:end].clone(), requires_grad=weight.requires_grad)
    if kept is not None:
        kept[id(weight)] = sliced
    return sliced


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary rows; each rank holds ``(N, rows)`` of them, from row ``first``.

    Forward: the row maximum over the group, then the sum of exponentials and the target's
    logit summed over it (two allreduces, of ``N`` and ``2N`` numbers); backward: this rank's
    rows of ``softmax - onehot``, without communication. Targets equal to ``-100`` are
    ignored, as ``F.cross_entropy`` ignores them.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, targets: torch.Tensor, group: TensorGroup, first: int) -> torch.Tensor:
        rows = local.shape[-1]
        peak = group.maximum(local.detach().amax(-1))
        shifted = local.detach() - peak.unsqueeze(-1)
        exp = shifted.exp()
        mine = (targets >= first) & (targets < first + rows)
        picked = shifted.gather(-1, (targets - first).clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1) * mine
        both = group.allreduce(torch.stack([exp.sum(-1), picked]), "forward")
        valid = targets != -100
        count = int(valid.sum())
        losses = (both[0].log() - both[1]) * valid
        ctx.save_for_backward(exp / both[0].unsqueeze(-1), targets, mine, valid)
        ctx.first, ctx.count = first, count
        return losses.sum() / max(count, 1) if count else losses.sum() * float("nan")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        softmax, targets, mine, valid = ctx.saved_tensors
        rows = softmax.shape[-1]
        local = softmax.clone()
        index = (targets - ctx.first).clamp(0, rows - 1).unsqueeze(-1)
        local.scatter_add_(-1, index, -mine.to(local.dtype).unsqueeze(-1))
        return local * (valid.to(local.dtype).unsqueeze(-1) * grad / max(ctx.count, 1)), None, None, None


class VocabShard:
    """What a :class:`VocabParallelHead`'s gathered logits carry (as ``logits.vocab_parallel``): this rank's logits and rows.

    :meth:`cross_entropy` is the mean cross-entropy of the whole logits, computed from
    this rank's rows (:class:`_VocabParallelCrossEntropy`): the default loss of
    :mod:`rapydli.objective` uses it when the model returns the head's logits unchanged.
    """

    def __init__(self, local: torch.Tensor, gathered: torch.Tensor, group: TensorGroup, first: int) -> None:
        self.local, self.group, self.first = local, group, first
        self._version = gathered._version

    def unchanged(self, logits: torch.Tensor) -> bool:
        """Whether ``logits`` (the gathered tensor carrying this) was not modified in place since the head made it."""
        return logits._version == self._version

    def cross_entropy(self, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every position of the whole logits for ``targets`` (collective over the group)."""
        local = self.local if self.local.dtype in (torch.float32, torch.float64) else self.local.float()
        flat = local.reshape(-1, local.shape[-1])
        return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1).to(flat.device), self.group, self.first)


class VocabParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` whose vocabulary rows are split: this rank keeps rows ``[first, end)``.

    Forward, each rank looks up the tokens in its rows (zero for the others) and the
    group sums the partial embeddings (one allreduce); backward, each rank's rows get
    their gradient without communication. ``chunks`` is 1: the weight keeps one block of
    rows, as a :class:`ColumnParallelLinear`'s does.
    """

    chunks = 1

    def __init__(
        self, weight: nn.Parameter, first: int, vocab: int, group: TensorGroup, padding_idx: int | None = None
    ) -> None:
        super().__init__()
        self.group, self.first, self.vocab = group, first, vocab
        self.weight = weight
        self.padding_idx = padding_idx

    @classmethod
    def from_dense(
        cls, embedding: nn.Module, group: TensorGroup, name: str = "", kept: dict[int, nn.Parameter] | None = None
    ) -> VocabParallelEmbedding:
        """This rank's rows of ``embedding``'s weight (an ``nn.Embedding`` without ``max_norm``)."""
        if not isinstance(embedding, nn.Embedding):
            raise ConfigError(
                f"tensor plan {name!r}: 'vocab' cannot split a {type(embedding).__name__}; allowed: {ALLOWED}"
            )
        if embedding.max_norm is not None or embedding.sparse:
            raise ConfigError(
                f"tensor plan {name!r}: 'vocab' cannot split an nn.Embedding with max_norm or sparse=True (it renormalises or "
                "updates rows in place); leave it out of the plan (dense)"
            )
        vocab = embedding.weight.shape[0]
        first, end = _vocabulary_rows(vocab, group, name)
        padding = embedding.padding_idx
        local_padding = padding - first if padding is not None and first <= padding < end else None
        return cls(_kept_rows(embedding.weight, first, end, kept), first, vocab, group, local_padding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.shape[0]
        local = ids - self.first
        outside = (local < 0) | (local >= rows)
        looked_up = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        return _ReduceFromGroup.apply(looked_up.masked_fill(outside.unsqueeze(-1), 0.0), self.group)

    def extra_repr(self) -> str:
        return f"rows {self.first}..{self.first + self.weight.shape[0]} of {self.vocab}, {self.weight.shape[1]} wide"


class VocabParallelHead(ColumnParallelLinear):
    """An LM head (a linear layer onto the vocabulary) whose rows are split: the logits of this rank's rows, gathered whole.

    The head's input passes through ``f`` (its gradient summed over the group backward);
    each rank computes the logits of its vocabulary rows, and the group gathers them
    along the last dimension (one allgather forward; backward, each rank takes its
    slice of the gradient), so the model's own loss code sees the whole logits. The
    gathered logits carry a :class:`VocabShard` (``logits.vocab_parallel``): when the model
    returns them unchanged and the run's loss is the default cross-entropy, the loss is
    computed from each rank's rows (vocabulary-parallel) and nothing flows back through
    the gather.
    """

    first = 0

    @classmethod
    def from_vocabulary(
        cls, linear: nn.Module, group: TensorGroup, name: str = "", kept: dict[int, nn.Parameter] | None = None
    ) -> VocabParallelHead:
        """This rank's rows of ``linear``'s weight (and bias); a weight tied to a split embedding stays that one parameter."""
        weight, bias = _dense(linear, name, "vocab")
        first, end = _vocabulary_rows(weight.shape[0], group, name)
        if isinstance(linear, nn.Linear):
            sliced = _kept_rows(linear.weight, first, end, kept)
        else:  # Conv1D keeps (in, out): its rows are a copy, never tied
            sliced = nn.Parameter(weight.detach()[first:end].clone())
        head = cls(sliced.detach(), None, group)
        head.weight, head.dense_transposed = sliced, not isinstance(linear, nn.Linear)
        head.bias = nn.Parameter(bias.detach()[first:end].clone()) if bias is not None else None
        head.first = first
        return head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        gathered = _GatherFromGroup.apply(local, self.group)
        gathered.vocab_parallel = VocabShard(local, gathered, self.group, self.first)
        return gathered


#: Modules whose parameters keep one block of rows per chunk on each rank (``module.chunks`` blocks; the bias too).
ROW_BLOCKS = (ColumnParallelLinear, VocabParallelEmbedding, HeadParallelMultiheadAttention)


#: What each style splits, for messages.
ALLOWED = (
    "'column' / 'row' for a linear layer (nn.Linear, Hugging Face's Conv1D); 'heads' for an attention module with a "
    "fused qkv / c_attn / query_key_value and its output projection, or separate q, k, v and output projections (q_proj... "
    "o_proj / out_proj / dense, q k v o, q_lin... out_lin, wq... wo), or BERT's query, key, value (its attention.output.dense "
    "then 'row'), and a head count (an attribute, the module's config, or a head width and the projections' shapes); "
    "'vocab' for an nn.Embedding or an LM head (a linear layer onto the vocabulary)"
)


def _dense(module: nn.Module, name: str, style: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    found = linear_weight(module)
    if found is None:
        weight = getattr(module, "weight", None)
        shape = f" (weight {tuple(weight.shape)})" if isinstance(weight, torch.Tensor) else ""
        raise ConfigError(
            f"tensor plan {name!r}: {style!r} cannot split a {type(module).__name__}{shape}; allowed: {ALLOWED}"
        )
    return found


def _is_linear(module: Any) -> bool:
    return isinstance(module, nn.Module) and linear_weight(module) is not None


def attention_layout(module: nn.Module) -> tuple[tuple[str, ...], str | None] | None:
    """``((q/k/v projection names...), output projection name)`` of an attention module ``heads`` can split, else ``None``.

    Recognised by structure (:func:`rapydli.parallel.attention.find_attention`). The output
    projection is ``None`` for a module that returns the heads' context: its output stays
    split, for a row-parallel layer after it.
    """
    found = find_attention(module)
    return None if found is None else (found.projections, found.output)


def _split_attention(module: nn.Module, group: TensorGroup, name: str) -> None:
    """Whole heads across ranks: q/k/v projections column-parallel per head, the output projection row-parallel."""
    found = find_attention(module)
    if found is None:
        raise ConfigError(
            f"tensor plan {name!r}: 'heads' cannot split a {type(module).__name__}, which is not an attention module; allowed: {ALLOWED}"
        )
    projections, proj, heads, kv_heads = found.projections, found.output, found.heads, found.kv_heads
    first = getattr(module, projections[0])
    what = f"{name!r} ({type(module).__name__}: {heads} query heads, {kv_heads} key/value heads, {projections[0]} weight {tuple(first.weight.shape)})"
    for count, kind in ((heads, "query"), (kv_heads, "key/value")):
        if count % group.size:
            raise ConfigError(
                f"tensor plan {what}: {count} {kind} heads do not split over tensor_parallel={group.size} into whole heads; "
                f"use a tensor_parallel that divides {count}, or leave {name!r} out of the plan (dense)"
            )
    if len(projections) == 1:
        outputs = linear_weight(first)[0].shape[0]  # type: ignore[index]
        if outputs % (3 * heads) or kv_heads != heads:
            raise ConfigError(
                f"tensor plan {what}: a fused projection of {outputs} outputs is not q, k and v of {heads} heads each"
            )
        chunks = 3 if found.fused == "blockwise" else 1  # head after head: each rank's heads are one run of rows
        setattr(
            module,
            projections[0],
            ColumnParallelLinear.from_dense(first, group, chunks=chunks, name=f"{name}.{projections[0]}"),
        )
    else:
        for projection in projections:
            setattr(
                module,
                projection,
                ColumnParallelLinear.from_dense(getattr(module, projection), group, name=f"{name}.{projection}"),
            )
    if proj is not None:  # else the module returns its heads' context, split: a row-parallel layer after it sums it
        setattr(module, proj, RowParallelLinear.from_dense(getattr(module, proj), group, name=f"{name}.{proj}"))
    for attr in found.counts:
        setattr(module, attr, getattr(module, attr) // group.size)


def parallelize(model: nn.Module, plan: Mapping[str, str], group: TensorGroup) -> nn.Module:
    """Split the layers ``plan`` names across ``group`` (in place); returns ``model``.

    Parameters
    ----------
    model
        A dense model; every rank of the group passes the same weights.
    plan
        ``{module name or glob: "column" | "row" | "heads" | "vocab"}``; a ``"column"`` or ``"row"``
        module must be a linear layer (:func:`linear_weight`), a ``"heads"`` module an
        attention module (:func:`attention_layout`), a ``"vocab"`` module an
        ``nn.Embedding`` or a linear LM head.
    group
        The tensor-parallel group.

    Raises
    ------
    ConfigError
        An unknown style, a pattern that names no module, a module of the wrong kind, or
        features or heads that do not divide by the group size; the message names the
        module, its shape and the allowed styles.
    """
    modules = dict(model.named_modules())
    kept: dict[int, nn.Parameter] = {}  # dense weight -> this rank's rows: a tied embedding and head keep one parameter
    planned: dict[str, tuple[str, str]] = {}  # module name -> (the pattern that split it, its style)
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(f"tensor plan {pattern!r}: {style!r} is not a style; allowed: {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            linears = [n for n, m in modules.items() if _is_linear(m)]
            raise ConfigError(
                f"tensor plan {pattern!r} names no module of the model; its linear layers are {', '.join(linears)}"
            )
        for name in names:
            if name in planned:  # named again by a broader glob: once is enough, twice differently is a mistake
                if planned[name][1] != style:
                    raise ConfigError(
                        f"tensor plan {pattern!r} gives {name!r} {style!r}, but {planned[name][0]!r} gives it {planned[name][1]!r}"
                    )
                continue
            planned[name] = (pattern, style)
            module = modules[name]
            if style == "heads" and isinstance(
                module, nn.MultiheadAttention
            ):  # PyTorch's own: replaced by its heads' part
                replacement: nn.Module = split_multihead_attention(module, group, name)
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
                continue
            if style == "heads":
                _split_attention(module, group, name)
                continue
            if style == "vocab" and isinstance(module, nn.Embedding):
                replacement = VocabParallelEmbedding.from_dense(module, group, name=name, kept=kept)
            elif style == "vocab":
                replacement = VocabParallelHead.from_vocabulary(module, group, name=name, kept=kept)
            elif style == "column":
                replacement = ColumnParallelLinear.from_dense(module, group, name=name)
            else:
                replacement = RowParallelLinear.from_dense(module, group, name=name)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    _without_fused_path(model, planned)
    return model


def _without_fused_path(model: nn.Module, planned: Mapping[str, Any]) -> None:
    """PyTorch's ``nn.TransformerEncoderLayer`` holding a split module never takes its fused inference kernel.

    In evaluation (``eval()``, no gradients) that layer calls one fused kernel with its
    attention's and MLP's weights instead of its modules, which would compute with this
    rank's slices as if they were whole. The layer checks ``activation_relu_or_gelu`` for
    nothing but that choice; it is turned off, so the layer runs its modules.
    """
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer) and any(
            p == name or p.startswith(f"{name}.") for p in planned if name
        ):
            module.activation_relu_or_gelu = False


def sharded_parameters(model: nn.Module) -> set[int]:
    """``id``s of the parameters that hold a different slice on each tensor rank (the others are replicated)."""
    ids: set[int] = set()
    for module in model.modules():
        if isinstance(module, ROW_BLOCKS):
            ids.update(id(p) for p in module.parameters(recurse=False))
        elif isinstance(module, RowParallelLinear):
            ids.add(id(module.weight))
    return ids


def shard_model(model: nn.Module, plan: Mapping[str, str] | None, comm: Any) -> nn.Module:
    """Split ``model`` over the tensor-parallel communicator ``comm`` (in place); returns it.

    The dense parameters and buffers of the group's rank 0 are broadcast first, so every
    rank cuts its slice from the same weights (a model recorded on the meta device has
    none to send: each rank's slices are computed from the recording, the same everywhere). ``plan`` ``None``: :func:`plan_for`. The
    plan is first tried on a shape-only copy (:func:`~rapydli.parallel.tensor_plans.check_plan`),
    so a module it cannot split is refused before any weight moves.
    """
    from rapydli.parallel.tensor_plans import check_plan

    size = comm.Get_size()
    plan = plan_for(model, size) if plan is None else plan
    check_plan(model, plan, size)
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if (
                tensor.is_meta
            ):  # recorded, never built whole: every rank computes the same values (rapydli.parallel.deferred)
                continue
            host = tensor.detach().cpu().contiguous()
            comm.Bcast(host.numpy(), root=0)
            tensor.copy_(host)
    return parallelize(model, plan, TensorGroup(comm))


def plan_for(model: nn.Module, size: int = 2) -> dict[str, str]:
    """The built-in plan of ``model`` for ``size`` tensor ranks (:func:`rapydli.parallel.tensor_plans.plan_for`)."""
    from rapydli.parallel.tensor_plans import plan_for as built_in

    return built_in(model, size)
