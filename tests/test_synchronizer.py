"""rapydli.comm.GradientSynchronizer on 2 real ranks: == DDP (gloo), == one process on the whole batch."""

from __future__ import annotations

import pytest
import torch

from rapydli.errors import ConfigError

SYNC = r"""
import copy
import torch
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI
from rapydli.comm import Communicator, GradientSynchronizer
from rapydli.comm.torchdist import process_group

torch.set_num_threads(1)
world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
STEPS, BATCH = 4, 8


class Net(nn.Module):
    def __init__(self, extra=False):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 8 * 8, 32)
        self.fc2 = nn.Linear(32, 10)
        # used only when asked: an unused parameter otherwise
        self.extra = nn.Linear(10, 10) if extra else None

    def forward(self, x, use_extra=False):
        h = F.relu(self.norm(self.conv(x)))
        out = self.fc2(F.relu(self.fc1(h.flatten(1))))
        return self.extra(out) if use_extra else out


def make_model(seed=0, extra=False):
    torch.manual_seed(seed)
    return Net(extra)

g = torch.Generator().manual_seed(42)
X = torch.randn(STEPS, n * BATCH, 1, 8, 8, generator=g)
Y = torch.randint(0, 10, (STEPS, n * BATCH), generator=g)
mine = slice(rank * BATCH, (rank + 1) * BATCH)

def train(model, step_fn, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        step_fn(model, opt, s)
    return model

def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

def close(a, b, what):
    assert torch.allclose(params(a), params(b), rtol=1e-4, atol=1e-5), (what, (params(a) - params(b)).abs().max())

# BatchNorm statistics differ per shard (as in DDP), so compare with DDP, and compare with
# one process on the whole batch using a model without batch-dependent layers.
def plain_step(model, opt, s):
    opt.zero_grad()
    F.cross_entropy(model(X[s]), Y[s]).backward()
    opt.step()

# -- reference 1: torch DDP with gloo, same shards --------------------------------------
process_group(world, "gloo")   # default process group from the MPI communicator
ddp = nn.parallel.DistributedDataParallel(make_model(), broadcast_buffers=False)
def ddp_step(model, opt, s):
    opt.zero_grad()
    F.cross_entropy(model(X[s][mine]), Y[s][mine]).backward()
    opt.step()
train(ddp, ddp_step)

checked = 0
for algorithm in ("mpi", "ring", "auto"):
    comm = Communicator(algorithm=algorithm)
    for overlap in (True, False):
        model = make_model(seed=rank)            # different init per rank ...
        sync = GradientSynchronizer(model, comm, bucket_mb=0.002, overlap=overlap)
        sync.broadcast_parameters()              # ... made equal by broadcast_parameters
        assert len(sync.buckets) > 2 and sync.buckets[0][0] is model.fc2.bias  # reverse order
        # bucket buffers live in memory the two ranks share (auto reduces them there)
        assert all(comm._shared.views(bucket.buffer) is not None for bucket in sync._buckets)
        buffers = {id(p): v.data_ptr() for bucket in sync._buckets for p, v in zip(bucket.params, bucket.views)}
        def step(model, opt, s):
            opt.zero_grad()                      # set_to_none=True: the hook re-points .grad
            F.cross_entropy(model(X[s][mine]), Y[s][mine]).backward()
            stats = sync.wait()
            assert stats.step == s + 1 and stats.buckets == len(sync.buckets)
            assert stats.launched_in_backward == (len(sync.buckets) if overlap else 0)
            assert stats.comm_time > 0 and 0.0 <= stats.hidden_fraction <= 1.0
            assert stats.wait_time >= 0 and stats.bytes == 4 * sum(p.numel() + 1 for p in model.parameters())  # + a used flag each
            opt.step()
        train(model, step)
        assert {id(p): p.grad.data_ptr() for p in model.parameters()} == buffers  # grads are the bucket views
        close(model, ddp.module, (algorithm, overlap, "vs DDP"))
        checked += 1
    comm.close()

# -- reference 2: one process on the concatenated batch (no BatchNorm: eval-mode norm) ----
comm = Communicator(algorithm="ring")
def no_norm(seed=0, extra=False):
    model = make_model(seed, extra)
    model.norm.eval()
    return model
single = train(no_norm(), plain_step)
model = no_norm(seed=rank)
sync = GradientSynchronizer(model, comm, bucket_mb=0.01)
sync.broadcast_parameters()
def dist_step(model, opt, s):
    sync.zero_grad()
    # cleared, not zeroed: the hook copies the next gradients over last step's bucket values
    assert all(p.grad is None for p in model.parameters())
    F.cross_entropy(model(X[s][mine]), Y[s][mine]).backward()
    sync.wait()
    opt.step()
train(model, dist_step)
close(model, single, "vs single process on the whole batch")
checked += 1

# -- no_sync: two micro-batches accumulated == one step on both halves, whole batch -------
single = no_norm()
opt = torch.optim.SGD(single.parameters(), lr=0.1)
for s in range(2):
    opt.zero_grad()
    for micro in range(2):
        (F.cross_entropy(single(X[s][micro::2]), Y[s][micro::2]) / 2).backward()
    opt.step()
model = no_norm(seed=rank)
sync = GradientSynchronizer(model, comm, bucket_mb=0.01)
sync.broadcast_parameters()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for s in range(2):
    sync.zero_grad()
    for micro in range(2):
        rows = torch.arange(n * BATCH)[micro::2]
        rows = rows[rank * len(rows) // n:(rank + 1) * len(rows) // n]
        if micro == 0:
            with sync.no_sync():
                (F.cross_entropy(model(X[s][rows]), Y[s][rows]) / 2).backward()
            assert sync.stats.step == s          # nothing reduced inside no_sync
        else:
            (F.cross_entropy(model(X[s][rows]), Y[s][rows]) / 2).backward()
    sync.wait()
    opt.step()
close(model, single, "no_sync accumulation")
checked += 1

# -- a parameter used on one rank only: no deadlock, counted as zero on the other --------
model = no_norm(extra=True)
sync = GradientSynchronizer(model, comm, bucket_mb=0.002)
for s in range(3):
    sync.zero_grad()
    F.cross_entropy(model(X[s][mine], use_extra=(rank == 0)), Y[s][mine]).backward()
    sync.wait()
    alone = no_norm(extra=True)
    alone.load_state_dict(model.state_dict())
    if rank == 0:
        F.cross_entropy(alone(X[s][mine], use_extra=True), Y[s][mine]).backward()
        expected = alone.extra.weight.grad / n
    else:
        expected = torch.zeros_like(model.extra.weight)
    expected = torch.from_numpy(world.bcast(expected.numpy(), root=0))
    assert torch.allclose(model.extra.weight.grad, expected, atol=1e-6), "unused parameter gradient"
checked += 1

# broadcast_parameters copies buffers too
model = make_model(seed=rank)
model.norm.running_mean.fill_(rank + 5.0)
GradientSynchronizer(model, comm).broadcast_parameters()
assert torch.all(model.norm.running_mean == 5.0)
sums = world.allgather(float(params(model).sum()))
assert len(set(sums)) == 1
comm.close()
print(f"SYNC OK rank {rank} checked {checked}", flush=True)
"""


@pytest.mark.mpi
def test_synchronizer_equals_ddp_and_single_process(run_mpi) -> None:
    result = run_mpi(SYNC, n=2, timeout=180)
    assert result.stdout.count("SYNC OK rank") == 2, result.stdout + result.stderr


def test_bucket_mb_and_comm_are_validated() -> None:
    from rapydli.comm.synchronizer import GradientSynchronizer

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="bucket_mb=0"):
        GradientSynchronizer(model, comm=None, bucket_mb=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="Communicator"):
        GradientSynchronizer(model, comm=object())  # type: ignore[arg-type]
