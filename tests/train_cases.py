"""Researchers' own models, losses and optimizers, and the references they must match.

Imported by the rank-side code of ``tests/test_train_outputs.py`` (under ``mpiexec``) and by
its engine tests. Each :class:`Case` is a model, data, a loss and an optimizer as a user
would write them; :func:`check_case` runs on every rank: ``k`` steps of the
:class:`~rapydli.trainer.Trainer` must give the same parameters as torch DDP (gloo,
``find_unused_parameters=True``) on the same shards and as one process on the
concatenated batch (:func:`single_process`). :func:`ddp_state` runs that DDP reference on
the engines of a cluster, for models defined in a notebook.
"""

from __future__ import annotations

import math
import socket
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from rapydli.data.sampler import rank_indices
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.schedule import lr_at

SAMPLES = 32
TOL = 2e-5


# -- models as researchers write them -------------------------------------------------------


class SmallCNN(nn.Module):
    """Returns logits; cross-entropy by default."""

    def __init__(self, classes: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).flatten(1))


class RegressionMLP(nn.Module):
    """Returns one number per sample; trained with ``loss_fn=nn.MSELoss()``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("mask", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.shape[-1])
        att = F.softmax(att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape: ``forward(idx, targets=None) -> (logits, loss)``, input and output embeddings tied."""

    def __init__(
        self, vocab: int = 16, block_size: int = 8, n_embd: int = 16, n_head: int = 2, n_layer: int = 1
    ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, block_size) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
        return logits, loss


class ModelOutput(OrderedDict):
    """A stand-in for ``transformers.utils.ModelOutput``: an OrderedDict with attribute access."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class PooledClassifier(nn.Module):
    """BERT-like: a [CLS] head on the first token; the pooler is computed for the output but never trained."""

    def __init__(self, features: int = 8, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(features, hidden), nn.GELU())
        self.pooler = nn.Linear(hidden, hidden)
        self.classifier = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> ModelOutput:
        hidden = self.encoder(x)  # (B, T, H)
        cls = hidden[:, 0]
        logits = self.classifier(cls)
        with torch.no_grad():
            pooled = torch.tanh(self.pooler(cls))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ModelOutput(loss=loss, logits=logits, pooler_output=pooled)


class NormedMLP(nn.Module):
    """For an optimizer with two parameter groups (no decay on norms and biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.norm(self.fc1(x))))


class FrozenFirst(NormedMLP):
    """The first layer is frozen (``requires_grad=False``): no rank ever has its gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1.requires_grad_(False)


class RankZeroBranch(NormedMLP):
    """An extra branch used only where ``use_branch`` is set (rank 0): its gradient exists on one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.branch = nn.Linear(8, 4)
        self.use_branch = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.branch(x) if self.use_branch else out


@dataclass
class Features:
    """Something a model may return that holds neither logits nor a loss."""

    hidden: torch.Tensor


class Unreadable(NormedMLP):
    def forward(self, x: torch.Tensor) -> Features:
        return Features(super().forward(x))


class SlowOnRank1(NormedMLP):
    """A NormedMLP whose forward takes 40 ms longer on rank 1: a straggler (a slow core or node) made deterministic."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        from rapydli.cluster import engine

        if engine.context().rank == 1:
            time.sleep(0.04)
        return super().forward(x)


class BusyOnPinnedCores(NormedMLP):
    """A NormedMLP whose forward also burns ~20 ms of matrix products, with each rank's threads pinned to a core of its own.

    Rank r runs on the r-th core of the engine's CPU set (:func:`pinned_core`); a process
    spinning on rank 1's core then makes rank 1 a straggler, as a busy core does.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        from rapydli.cluster import engine

        core = pinned_core(engine.context().rank)
        if os.sched_getaffinity(0) != {core}:
            for thread in os.listdir("/proc/self/task"):  # every thread of the engine: torch's, MPI's, ipyparallel's
                os.sched_setaffinity(int(thread), {core})
        with torch.no_grad():
            a = torch.ones(256, 256)
            for _ in range(60):
                a = torch.mm(a, a) * (1 / 256)
        return super().forward(x)


def pinned_core(rank: int) -> int:
    """The core :class:`BusyOnPinnedCores` pins ``rank`` to: the rank-th of this process's CPU set."""
    import os

    cores = sorted(os.sched_getaffinity(0))
    return cores[rank % len(cores)]


def per_sample_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A mistake: the loss of every sample where the batch's scalar loss is expected."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


class Failing(NormedMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("this layer is broken")


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, and a smaller rate for the no-decay group."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.005}], lr=0.02
    )


def adamw_decay(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01, weight_decay=0.1)


def half_rate_sgd(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """SGD at half of ``config.lr`` (which a sweep varies): a run logs that rate, so it shows this optimizer was used."""
    return torch.optim.SGD(model.parameters(), lr=config.lr / 2)


#: What the sweep, scaling-study and panel tests pass through to their runs (with :class:`RegressionMLP`, :func:`regression`).
PASSED = {"loss_fn": nn.MSELoss(), "optimizer_fn": half_rate_sgd, "metrics": ["mse", "mae"]}


def passed_through(final: dict[str, float], lr: float) -> None:
    """Assert that a run's final metrics show :data:`PASSED` was used (its config's ``lr`` given).

    The validation loss is the mean squared error (the default cross-entropy on one output
    is 0), both metrics were measured, and the logged rate is ``half_rate_sgd``'s.
    """
    assert final["val_mse"] > 0 and math.isclose(final["val_loss"], final["val_mse"], rel_tol=1e-5), final
    assert final["val_mae"] > 0 and "val_accuracy" not in final, final
    assert math.isclose(final["lr"], lr / 2, rel_tol=1e-9), final


# -- data -------------------------------------------------------------------------------------


def images() -> tuple[TensorDataset, None]:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(SAMPLES, 1, 6, 6, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)), None


def regression() -> tuple[TensorDataset, TensorDataset]:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(SAMPLES + 8, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(SAMPLES + 8, 1, generator=g)
    return TensorDataset(x[:SAMPLES], y[:SAMPLES]), TensorDataset(x[SAMPLES:], y[SAMPLES:])


def tokens() -> tuple[TensorDataset, None]:
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 16, (SAMPLES, 9), generator=g)
    return TensorDataset(seq[:, :-1], seq[:, 1:]), None


def sequences() -> tuple[TensorDataset, None]:
    g = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(SAMPLES, 5, 8, generator=g), torch.randint(0, 3, (SAMPLES,), generator=g)), None


def features() -> tuple[TensorDataset, None]:
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g)), None


def features_only() -> TensorDataset:
    """A mistake: one dataset where ``(train, val)`` is expected."""
    return features()[0]


# -- cases ------------------------------------------------------------------------------------


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


@dataclass
class Case:
    """A model, its data, loss and optimizer as given to ``rd.train``, and its reference loss."""

    model_fn: Callable[[], nn.Module]
    data_fn: Callable[[], Any]
    reference_loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    config: dict[str, Any] = field(default_factory=dict)
    loss_fn: Any = None
    optimizer_fn: Any = None
    unchanged: tuple[str, ...] = ()  # parameters no rank trains: they must not move at all
    steps: int = 3


CASES: dict[str, Case] = {
    "cnn": Case(SmallCNN, images, _ce, {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9}),
    "mlp_mse": Case(RegressionMLP, regression, lambda m, x, y: F.mse_loss(m(x), y), {"lr": 0.01}, loss_fn=nn.MSELoss()),
    # SGD: Adam turns the key bias's gradient, zero but for rounding (softmax ignores it), into full steps
    "gpt": Case(TinyGPT, tokens, lambda m, x, y: m(x, targets=y)[1], {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.1}),
    "model_output": Case(PooledClassifier, sequences, lambda m, x, y: m(x, labels=y)["loss"], {"lr": 0.01, "weight_decay": 0.1},
                         unchanged=("pooler.weight", "pooler.bias")),
    "two_groups": Case(NormedMLP, features, _ce, {"lr": 0.02, "lr_schedule": "cosine", "warmup_steps": 1},
                       optimizer_fn=two_groups, steps=4),
    "frozen": Case(FrozenFirst, features, _ce, {}, optimizer_fn=adamw_decay, unchanged=("fc1.weight", "fc1.bias")),
    "rank0_branch": Case(RankZeroBranch, features, _ce, {}, optimizer_fn=adamw_decay),
    # the same three under ZeRO-2 (config.optimizer: AdamW, lr 0.01, weight decay 0.1), the branch with two micro-steps a step
    "model_output_zero2": Case(PooledClassifier, sequences, lambda m, x, y: m(x, labels=y)["loss"], {"lr": 0.01, "weight_decay": 0.1, "zero": 2},
                               unchanged=("pooler.weight", "pooler.bias")),
    "frozen_zero2": Case(FrozenFirst, features, _ce, {"lr": 0.01, "weight_decay": 0.1, "zero": 2}, unchanged=("fc1.weight", "fc1.bias")),
    "rank0_branch_zero2": Case(RankZeroBranch, features, _ce, {"lr": 0.01, "weight_decay": 0.1, "zero": 2, "batch_size": 2, "grad_accum": 2}),
}  # fmt: skip


def config_of(case: Case, **changes: Any) -> TrainConfig:
    return TrainConfig(
        **{"batch_size": 4, "max_steps": case.steps, "seed": 0, "bucket_mb": 0.001, **case.config, **changes}
    )


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return case.model_fn()


def optimizer_for(case: Case, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    from rapydli.trainer.optim import make_optimizer

    return make_optimizer(model, cfg, case.optimizer_fn)


def shard(train: TensorDataset, rank: int, size: int, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = rank_indices(len(train), rank, size, seed=0, epoch=0)[step * batch : (step + 1) * batch]
    return train.tensors[0][idx], train.tensors[1][idx]


def _set_lr(optimizer: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr_at(cfg.lr_schedule, step, cfg.max_steps, group["initial_lr"], cfg.warmup_steps)


def single_process(name: str, size: int) -> nn.Module:
    """One process, the ranks' batches concatenated, the same optimizer and schedule."""
    case = CASES[name]
    cfg = config_of(case)
    train, _ = case.data_fn()
    model = build(case)
    optimizer = optimizer_for(case, model, cfg)
    for step in range(case.steps):
        _set_lr(optimizer, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        parts = [shard(train, r, size, step, cfg.batch_size * cfg.grad_accum) for r in range(size)]
        if isinstance(model, RankZeroBranch):  # the branch sees rank 0's samples only
            outs = []
            for r, (x, _) in enumerate(parts):
                model.use_branch = r == 0
                outs.append(model(x))
            loss = F.cross_entropy(torch.cat(outs), torch.cat([y for _, y in parts]))
        else:
            loss = case.reference_loss(model, torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))
        loss.backward()
        optimizer.step()
    return model


def check_metrics_averaged() -> None:
    """On every rank: the validation loss and metrics of the ranks' shards, averaged, equal one process's on the whole set.

    11 validation samples: shards of 6 and 5, batches of 4 with a short last one, so a
    mean of per-rank (or per-batch) means would differ; loss MSE, metrics by name and a
    callable (a batch mean).
    """
    from mpi4py import MPI

    from rapydli.trainer import Trainer

    world = MPI.COMM_WORLD
    train, _ = regression()
    g = torch.Generator().manual_seed(7)
    val = TensorDataset(torch.randn(11, 8, generator=g), torch.randn(11, 1, generator=g))
    metrics = {"mse": "mse", "mae": "mae", "cubed": lambda out, y: ((out - y) ** 3).mean()}

    def evaluation(comm: Any) -> dict[str, Any]:
        torch.manual_seed(0)
        trainer = Trainer(
            RegressionMLP(),
            None,
            train,
            val,
            TrainConfig(batch_size=4, max_steps=1),
            comm=comm,
            loss_fn=nn.MSELoss(),
            metrics=metrics,
        )
        row = trainer.evaluate()
        trainer.close()
        return row

    averaged, single = evaluation(world), evaluation(MPI.COMM_SELF)
    assert averaged["world_size"] == world.Get_size() and single["world_size"] == 1
    torch.manual_seed(0)
    with torch.no_grad():
        error = RegressionMLP()(val.tensors[0]) - val.tensors[1]
    expected = {
        "val_loss": (error**2).mean(),
        "val_mse": (error**2).mean(),
        "val_mae": error.abs().mean(),
        "val_cubed": (error**3).mean(),
    }
    for name, value in expected.items():
        assert math.isclose(single[name], float(value), rel_tol=1e-5, abs_tol=1e-7), (name, single[name], float(value))
        assert math.isclose(averaged[name], single[name], rel_tol=1e-6, abs_tol=1e-8), (
            name,
            averaged[name],
            single[name],
        )
    if world.Get_rank() == 0:
        print("metrics averaged: ok")


def ddp_state(
    model_fn: Callable[[], nn.Module],
    data_fn: Callable[[], Any],
    loss_fn: Callable[..., torch.Tensor],
    optimizer_fn: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int,
    batch_size: int,
) -> dict[str, torch.Tensor]:
    """In a task on every rank of a cluster: ``steps`` steps of torch DDP (gloo, ``find_unused_parameters=True``).

    The model is ``model_fn()`` after ``torch.manual_seed(0)``, each rank steps on its shards
    of ``data_fn()``'s training set (as the Trainer's sampler cuts them); returns the
    parameters and buffers it ends with.
    """
    import torch.distributed as dist

    from rapydli.cluster.engine import context

    ctx = context()
    rank, size = ctx.rank, ctx.world_size
    port = ctx.comm.bcast(socket.create_server(("127.0.0.1", 0)).getsockname()[1] if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(model_fn(), find_unused_parameters=True)
        optimizer = optimizer_fn(ddp.module)
        train, _ = data_fn()
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = shard(train, rank, size, step, batch_size)
            loss_fn(ddp(inputs), targets).backward()
            optimizer.step()
        state = {key: value.detach().clone() for key, value in ddp.module.state_dict().items()}
        dist.barrier()  # no gloo work left whose callback needs the GIL
        # DDP goes while the group is still registered: freed last, its Reducer's destructor
        # joins gloo's threads while holding the GIL, and one of them waits for the GIL (a hang)
        del ddp, optimizer
    finally:
        dist.destroy_process_group()
    return state


def check_case(name: str) -> None:
    """On every rank: Trainer == DDP (gloo, find_unused_parameters) == one process, to float tolerance."""
    import torch.distributed as dist
    from mpi4py import MPI

    from rapydli.comm import Communicator
    from rapydli.trainer import Trainer

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    case = CASES[name]
    cfg = config_of(case)
    train, val = case.data_fn()
    model = build(case)
    if isinstance(model, RankZeroBranch):
        model.use_branch = rank == 0
    trainer = Trainer(
        model,
        None,
        train,
        val,
        cfg,
        comm=Communicator(algorithm="mpi"),
        loss_fn=case.loss_fn,
        optimizer_fn=case.optimizer_fn,
    )
    trainer.fit()
    trainer.close()
    assert trainer.step == case.steps

    port = world.bcast(socket.create_server(("127.0.0.1", 0)).getsockname()[1] if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    ref = build(case)
    if isinstance(ref, RankZeroBranch):
        ref.use_branch = rank == 0
    ddp = nn.parallel.DistributedDataParallel(ref, find_unused_parameters=True)
    optimizer = optimizer_for(case, ref, cfg)
    for step in range(case.steps):
        _set_lr(optimizer, cfg, step)
        optimizer.zero_grad(set_to_none=True)
        case.reference_loss(ddp, *shard(train, rank, size, step, cfg.batch_size * cfg.grad_accum)).backward()
        optimizer.step()
    reference = list(ddp.module.parameters())
    del ddp, optimizer  # before the group: see ddp_state
    dist.destroy_process_group()

    single = single_process(name, size)
    initial = dict(build(case).named_parameters())
    for (key, mine), theirs, one in zip(trainer.model.named_parameters(), reference, single.parameters()):
        assert torch.allclose(mine, theirs, atol=TOL, rtol=0), (
            f"{name} {key} vs DDP: {(mine - theirs).abs().max().item()}"
        )
        assert torch.allclose(mine, one, atol=TOL, rtol=0), (
            f"{name} {key} vs one process: {(mine - one).abs().max().item()}"
        )
        assert not torch.equal(mine, initial[key]) or key in case.unchanged, f"{name} {key} did not train"
    for key in case.unchanged:
        param = dict(trainer.model.named_parameters())[key]
        assert torch.equal(param, initial[key]), f"{name} {key} moved by {(param - initial[key]).abs().max().item()}"
        assert param.grad is None, f"{name} {key} has a gradient"
    if rank == 0:
        print(f"{name}: ok")
