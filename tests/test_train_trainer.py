"""Trainer on real ranks: the same parameters as one process on the concatenated batch and as
torch DDP; gradient accumulation; metrics; the clairvoyant loader matching the default one."""

from __future__ import annotations

import pytest

from rapydli.errors import ConfigError

COMMON = """
import os, socket
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn
from torch.nn import functional as F
from rapydli.comm import Communicator
from rapydli.data.sampler import rank_indices
from rapydli.trainer import Trainer, TrainConfig
from rapydli.zoo import datasets

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
train, val = datasets.synthetic_features(num_samples=80, in_features=16, num_classes=4)  # 64 train samples

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

def shard_batch(r, epoch, step, batch):
    idx = rank_indices(len(train), r, size, seed=0, epoch=epoch)[step * batch:(step + 1) * batch]
    return train.tensors[0][idx], train.tensors[1][idx]

def close(a, b, tol=1e-5):
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=tol, rtol=0), (p - q).abs().max().item()
"""


@pytest.mark.mpi
def test_two_ranks_match_single_process_and_ddp(run_mpi) -> None:
    code = (
        COMMON
        + """
cfg = TrainConfig(epochs=2, batch_size=8, lr=0.05, optimizer="sgd", momentum=0.9, allreduce="ring", bucket_mb=0.001)
seen = []
class Keep:
    def on_step_end(self, m): seen.append(m)
    def on_epoch_end(self, m): seen.append(("epoch", m))
trainer = Trainer(model(), None, train, val, cfg, comm=Communicator(algorithm="ring"), callbacks=[Keep()])
history = trainer.fit()
steps_per_epoch = len(train) // size // 8
assert trainer.total_steps == 2 * steps_per_epoch

# one process, the ranks' batches concatenated
ref = model()
opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for step in range(steps_per_epoch):
        xs, ys = zip(*(shard_batch(r, epoch, step, 8) for r in range(size)))
        opt.zero_grad()
        F.cross_entropy(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
close(trainer.model, ref)

# torch DDP with gloo on the same shards
port = world.bcast(socket.create_server(("127.0.0.1", 0)).getsockname()[1] if rank == 0 else None)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
ddp = nn.parallel.DistributedDataParallel(model())
opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
for epoch in range(2):
    for step in range(steps_per_epoch):
        x, y = shard_batch(rank, epoch, step, 8)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
close(trainer.model, ddp.module)
del ddp, opt  # DDP before its group: its Reducer's destructor, freeing the group last, can hang (see train_cases.ddp_state)
dist.destroy_process_group()

# metrics: every key, sane values; eval averaged over ranks (identical on both)
train_rows = [m for m in seen if isinstance(m, dict)]
assert [m["step"] for m in train_rows] == list(range(1, 2 * steps_per_epoch + 1))
for m in train_rows:
    assert m["kind"] == "train" and m["lr"] == 0.05 and m["step_time_s"] > 0 and m["samples_per_s"] > 0
    assert m["comm_time_s"] >= 0 and m["comm_wait_s"] >= 0 and m["world_size"] == size
assert sum(m["comm_time_s"] for m in train_rows) > 0
epochs = [m for tag, m in (s for s in seen if isinstance(s, tuple))]
assert [e["epoch"] for e in epochs] == [0, 1] and "val_accuracy" in epochs[-1]
evals = world.allgather([(r["val_loss"], r["val_accuracy"]) for r in history if r["kind"] == "eval"])
assert evals[0] == evals[-1] and len(evals[0]) == 2
trainer.close()
print("OK")
"""
    )
    assert run_mpi(code, n=2, timeout=180).stdout.count("OK") == 2


@pytest.mark.mpi
def test_grad_accum_equals_larger_batch_and_three_ranks(run_mpi) -> None:
    code = (
        COMMON
        + """
train, val = datasets.synthetic_features(num_samples=60, in_features=16, num_classes=4)  # 48 = 3 ranks x 2 x 8
big = Trainer(model(), None, train, val, TrainConfig(epochs=1, batch_size=8, lr=0.01, allreduce="mpi"))
big.fit()
accum = Trainer(model(), None, train, val, TrainConfig(epochs=1, batch_size=4, grad_accum=2, lr=0.01, allreduce="mpi", overlap=False))
accum.fit()
assert accum.total_steps == big.total_steps
close(big.model, accum.model)
capped = Trainer(model(), None, train, val, TrainConfig(epochs=5, max_steps=3, batch_size=4, lr=0.01, precision="bf16", grad_clip=0.5))
rows = [r for r in capped.fit() if r["kind"] == "train"]
assert len(rows) == 3 and all(r["grad_norm"] is not None for r in rows)
for t in (big, accum, capped):
    t.close()
print("OK")
"""
    )
    assert run_mpi(code, n=3, timeout=180).stdout.count("OK") == 3


@pytest.mark.mpi
def test_clairvoyant_loader_reaches_default_loader_params(run_mpi, tmp_path) -> None:
    code = (
        COMMON
        + """
params = {}
for kind in ("default", "clairvoyant"):
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.01, loader=kind, cache_ram_mb=0.01)
    trainer = Trainer(model(), None, train, val, cfg)
    trainer.fit()
    params[kind] = trainer.model
    trainer.close()
close(params["default"], params["clairvoyant"], tol=0)
print("OK")
"""
    )
    assert run_mpi(code, n=2, timeout=180).stdout.count("OK") == 2


def test_grad_accum_larger_than_epoch_is_a_config_error() -> None:
    import torch

    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.zoo import datasets, models

    train, val = datasets.synthetic_features(num_samples=20, in_features=8)
    with pytest.raises(ConfigError, match="grad_accum=8"):
        Trainer(models.mlp(in_features=8), None, train, val, TrainConfig(batch_size=4, grad_accum=8))
    with pytest.raises(ConfigError, match="TrainConfig"):
        Trainer(torch.nn.Linear(2, 2), None, train, val, {"lr": 0.1})  # type: ignore[arg-type]


@pytest.mark.mpi
def test_autotune_plan_is_made_once_and_applied_on_every_rank(run_mpi) -> None:
    code = (
        COMMON
        + """
from rapydli.zoo import models
from rapydli.autotune import TunedConv2d
train, val = datasets.digits()
torch.manual_seed(0)
model = models.resnet_mini(in_channels=1, width=4, blocks=(1,))
cfg = TrainConfig(epochs=1, max_steps=3, batch_size=8, lr=0.01, autotune=True)
trainer = Trainer(model, None, train, val, cfg)
tuned = sorted(name for name, m in trainer.model.named_modules() if isinstance(m, TunedConv2d))
planned = trainer.autotune_plan.layers
assert len(planned) == 3 and tuned == sorted(n for n, c in planned.items() if not c.is_library_default), tuned  # library: plain
plans = world.allgather(trainer.autotune_plan.layers)
assert plans[0] == plans[1]
rows = [r for r in trainer.fit() if r["kind"] == "train"]
assert len(rows) == 3 and all(r["loss"] == r["loss"] for r in rows)
weights = world.allgather([p.detach().clone() for p in trainer.model.parameters()])
assert all(torch.equal(a, b) for a, b in zip(*weights))
trainer.close()
print("OK")
"""
    )
    assert run_mpi(code, n=2, timeout=300).stdout.count("OK") == 2
