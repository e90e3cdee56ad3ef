"""BatchNorm over the global batch (rapydli.parallel.batchnorm): replicas' shares normalise as one process's whole batch."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from rapydli.parallel.batchnorm import GROUP, global_batch_norm

RANKS_CODE = """
import copy
import torch
from mpi4py import MPI
from torch import nn
from rapydli.comm import Communicator
from rapydli.parallel.batchnorm import global_batch_norm

torch.set_default_dtype(torch.float64)
world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 5 * 5, 4),
                         nn.BatchNorm1d(4, momentum=None))

torch.manual_seed(1)
x, y = torch.randn(8, 2, 5, 5), torch.randn(8, 4)
one = model()
mine = model()
comm = Communicator(world, algorithm="mpi")
assert global_batch_norm(mine, comm) == ["1", "5"]
share = slice(rank * 8 // size, (rank + 1) * 8 // size)
for _ in range(2):  # twice: the running statistics' update (momentum and cumulative) too
    one.zero_grad(); mine.zero_grad()
    ((one(x) - y) ** 2).mean().backward()
    ((mine(x[share]) - y[share]) ** 2).mean().backward()
    for p, q in zip(one.parameters(), mine.parameters()):
        grad = q.grad.clone()
        comm.allreduce_(grad, op="avg")  # what data parallelism averages
        assert torch.allclose(grad, p.grad, rtol=0, atol=1e-12), (p.shape, (grad - p.grad).abs().max())
for a, b in zip(one.buffers(), mine.buffers()):
    assert torch.allclose(a.double(), b.double(), rtol=0, atol=1e-12), (a, b)
mine.eval(); one.eval()
assert torch.allclose(mine(x[share]), one(x[share]), rtol=0, atol=1e-12)  # evaluation: the running statistics, no collective
lone = copy.deepcopy(mine).train()
lone(x[share])  # a copy normalises alone: rank 0 alone would wait for ever in a collective
comm.close()
print("OK")
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_replicas_shares_normalise_as_one_process_normalises_the_whole_batch(run_mpi, ranks: int) -> None:
    assert run_mpi(RANKS_CODE, n=ranks, timeout=180).stdout.count("OK") == ranks


def test_one_replica_or_no_group_leaves_batchnorm_as_it_is_and_a_copy_drops_the_group() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    assert global_batch_norm(model, None) == []

    class OneRank:
        world_size = 1

    assert global_batch_norm(model, OneRank()) == []

    class Two:
        world_size = 2

    assert global_batch_norm(model, Two()) == ["1"]
    copied = copy.deepcopy(model)
    assert copied[1].__dict__[GROUP].comm is None
    copied(torch.randn(4, 3))  # runs as PyTorch's BatchNorm, no collective
    assert pickle.loads(pickle.dumps(model[1].__dict__[GROUP])).comm is None
