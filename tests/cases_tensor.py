"""Rank-side code of tests/test_parallel_tensor.py (run by ``mpiexec`` on every rank)."""

from __future__ import annotations

import copy

import torch
from mpi4py import MPI
from torch import nn

from rapydli.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorGroup,
    VocabParallelEmbedding,
    parallelize,
    plan_for,
)
from rapydli.zoo.models import LlamaDecoderLayer, TransformerBlock, tiny_lm

torch.set_default_dtype(torch.float64)


def _shard_of(
    dense: torch.Tensor, local: nn.Parameter, module: nn.Module, name: str, group: TensorGroup
) -> torch.Tensor:
    """The slice of a dense tensor that ``local`` (a parameter of ``module``) holds on this rank."""
    if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
        chunks = module.chunks
        rows = local.shape[0] // chunks
        block = dense.shape[0] // chunks
        index = torch.cat(
            [torch.arange(c * block + group.rank * rows, c * block + (group.rank + 1) * rows) for c in range(chunks)]
        )
        return dense[index]
    if isinstance(module, RowParallelLinear) and name == "weight":
        columns = local.shape[1]
        return dense[:, group.rank * columns : (group.rank + 1) * columns]
    return dense


def compare(dense: nn.Module, parallel: nn.Module, group: TensorGroup, grads: bool, tol: float) -> float:
    """Largest difference between parallel's parameters (or grads) and their slices of dense's."""
    worst = 0.0
    dense_params = dict(dense.named_parameters())
    owners = {
        f"{m_name}.{p_name}" if m_name else p_name: (m, p_name)
        for m_name, m in parallel.named_modules()
        for p_name, _ in m.named_parameters(recurse=False)
    }
    for name, local in parallel.named_parameters():
        module, short = owners[name]
        reference = dense_params[name].grad if grads else dense_params[name].detach()
        mine = local.grad if grads else local.detach()
        worst = max(worst, float((_shard_of(reference, local, module, short, group) - mine).abs().max()))
    assert worst < tol, worst
    return worst


def block_equivalence() -> None:
    """An MLP block, an attention block and a Llama layer (separate q/k/v with GQA, SwiGLU): outputs and gradients equal the
    dense ones; one allreduce per block per direction, however many column layers read the block's input."""
    group = TensorGroup(MPI.COMM_WORLD)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    block = TransformerBlock(dim=16, heads=4)
    llama = LlamaDecoderLayer(
        hidden=16, heads=4, kv_heads=2, intermediate=32
    )  # q, k, v (and gate, up) read one input: one f each
    for dense, plan, width, counts in (
        (mlp, {"0": "column", "2": "row"}, 8, 1),
        (block, {"attn": "heads", "mlp.0": "column", "mlp.2": "row"}, 16, 2),
        (
            llama,
            {"self_attn": "heads", "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"},
            16,
            2,
        ),
    ):
        torch.manual_seed(1)
        x = torch.randn(3, 5, width)
        upstream = torch.randn(3, 5, width)
        parallel = parallelize(copy.deepcopy(dense), plan, group)
        group.allreduces = {"forward": 0, "backward": 0}
        x_dense, x_parallel = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_dense, y_parallel = dense(x_dense), parallel(x_parallel)
        assert float((y_dense - y_parallel).abs().max()) < 1e-10
        assert group.allreduces == {"forward": counts, "backward": 0}, group.allreduces
        (y_dense * upstream).sum().backward()
        (y_parallel * upstream).sum().backward()
        assert group.allreduces == {"forward": counts, "backward": counts}, group.allreduces
        assert float((x_dense.grad - x_parallel.grad).abs().max()) < 1e-10
        compare(dense, parallel, group, grads=True, tol=1e-10)
    print("OK blocks", group.rank)


def training_equivalence(steps: int = 4) -> None:
    """k SGD steps of tiny_lm with tensor_parallel=size equal single-process training."""
    group = TensorGroup(MPI.COMM_WORLD)
    torch.manual_seed(0)
    dense = tiny_lm(vocab_size=32, block_size=8, dim=16, layers=2, heads=4)
    parallel = parallelize(copy.deepcopy(dense), plan_for(dense), group)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (dense, parallel)]
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens = torch.randint(0, 32, (4, 9), generator=generator)
        for model, optimizer in zip((dense, parallel), optimizers):
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    compare(dense, parallel, group, grads=False, tol=1e-10)
    print("OK training", group.rank)


def vocabulary_equivalence() -> None:
    """A tied embedding and head split by vocabulary rows (with a padding token): logits, loss and gradients equal the dense ones."""
    from rapydli.objective import cross_entropy
    from rapydli.parallel.tensor import VocabParallelEmbedding, VocabParallelHead

    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 6, padding_idx=7)
            self.mix = nn.Linear(6, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mix(self.emb(ids))))

    dense = Tied()
    group = TensorGroup(MPI.COMM_WORLD)
    parallel = parallelize(copy.deepcopy(dense), {"emb": "vocab", "head": "vocab"}, group)
    assert isinstance(parallel.emb, VocabParallelEmbedding) and isinstance(parallel.head, VocabParallelHead)
    assert parallel.emb.weight is parallel.head.weight  # still one parameter
    ids = torch.tensor([[0, 7, 9, 4], [5, 1, 7, 2]])
    targets = torch.tensor([[1, 2, 3, 4], [9, 8, -100, 6]])  # -100 is ignored, as F.cross_entropy ignores it
    for score in ("the model's own loss code", "the default loss"):
        outputs = []
        for model in (dense, parallel):
            model.zero_grad()
            logits = model(ids)
            if score == "the default loss":  # vocabulary-parallel on the split head's logits
                loss = cross_entropy(logits, targets)
                assert (getattr(logits, "vocab_parallel", None) is not None) == (model is parallel)
            else:
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1))
            loss.backward()
            outputs.append((logits.detach(), loss.detach()))
        assert (outputs[0][0] - outputs[1][0]).abs().max() < 1e-12 and abs(
            float(outputs[0][1] - outputs[1][1])
        ) < 1e-12, score
        compare(dense, parallel, group, grads=False, tol=1e-12)
        compare(dense, parallel, group, grads=True, tol=1e-12)
    logits = parallel(ids)
    logits.mul_(2.0)  # changed in place after the head: the default loss must score what it holds now
    assert (
        abs(
            float(
                cross_entropy(logits, targets)
                - torch.nn.functional.cross_entropy(logits.reshape(-1, 10), targets.reshape(-1))
            )
        )
        < 1e-12
    )
    print("OK vocabulary", group.rank)
