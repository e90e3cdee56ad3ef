"""Code the hang-detection tests run on real engines (pickled by reference, imported there)."""

from __future__ import annotations

import os
import time

import torch

from rapydli.cluster.engine import context
from rapydli.comm import Communicator


def mismatched() -> None:
    """One allreduce on both ranks, then rank 0 allreduces while rank 1 broadcasts: both wait for ever."""
    comm = Communicator(context().comm, algorithm="mpi")
    t = torch.ones(1 << 20)  # 4 MiB of float32
    comm.allreduce_(t)
    if context().rank == 0:
        comm.allreduce_(t)
    else:
        comm.broadcast_(t, root=0)


def late(flag: str) -> int:
    """Rank 1 sleeps in user code until ``flag`` exists; rank 0 waits for it in an allreduce."""
    comm = Communicator(context().comm, algorithm="mpi")
    if context().rank == 1:
        while not os.path.exists(flag):
            time.sleep(0.05)
    comm.allreduce_(torch.ones(4))
    return context().rank


def receive_both() -> None:
    """Each of 2 pipeline stages waits for the other's activation: a send/receive deadlock."""
    from rapydli.parallel import wire

    ctx = context()
    wire.recv(ctx.comm, 1 - ctx.rank, "activation", 0, torch.device("cpu"))


class LateRank(torch.nn.Module):
    """``models.mlp()`` whose third forward on rank 1 sleeps ten minutes: rank 0 then waits for it in the gradient allreduce."""

    def __init__(self) -> None:
        from rapydli.zoo import models

        super().__init__()
        self.net = models.mlp()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3 and context().rank == 1:
            time.sleep(600)
        return self.net(x)


class _SleepsOnStage0(torch.nn.Module):
    """A linear layer whose fifth call on rank 0 (pipeline stage 0) sleeps ten minutes (the first calls check the split)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 5 and context().rank == 0:
            if os.environ.get("RAPYDLI_TEST_STALLED"):  # when the stall began, for the test's clock
                with open(os.environ["RAPYDLI_TEST_STALLED"], "w") as stamp:
                    stamp.write(repr(time.time()))
            time.sleep(600)
        return self.linear(x)


def late_stage() -> torch.nn.Module:
    """An MLP for the digits pipelined over 2 stages: stage 1 waits for an activation stage 0 does not send."""
    return torch.nn.Sequential(
        torch.nn.Flatten(),
        _SleepsOnStage0(),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )
