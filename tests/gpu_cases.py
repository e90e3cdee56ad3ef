"""Rank-side code of tests/test_gpu.py: the Communicator and the GradientSynchronizer on CUDA tensors.

Two ranks share one GPU (the GPU machine has one): every algorithm but ``nccl`` stages
CUDA tensors through host memory (the bundled MPICH is not CUDA-aware), and ``nccl``,
which needs a GPU per rank, must refuse with a clear error there. Each check is recorded
rather than asserted at once, so one run reports every failing algorithm; rank 0 prints
one JSON line with them.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from rapydli.comm import Communicator, GradientSynchronizer
from rapydli.errors import ConfigError

WORLD = MPI.COMM_WORLD
ALGORITHMS = ("mpi", "ring", "shm", "gloo", "auto")
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


class Checks:
    """Named checks; an exception or a false condition is a failure with its message, and the run goes on."""

    def __init__(self) -> None:
        self.passed: list[str] = []
        self.failed: dict[str, str] = {}

    def run(self, name: str, check: Callable[[], Any]) -> None:
        try:
            check()
        except Exception:  # noqa: BLE001 - every failure is reported, the next check still runs
            self.failed[name] = traceback.format_exc()[-1500:]
        else:
            self.passed.append(name)

    def report(self) -> None:
        """Rank 0 prints the checks of every rank as one JSON line."""
        everyone = WORLD.gather({"passed": self.passed, "failed": self.failed}, root=0)
        if WORLD.Get_rank() == 0:
            merged = {
                "passed": sorted({n for r in everyone for n in r["passed"]}),
                "failed": {f"rank {i}: {n}": m for i, r in enumerate(everyone) for n, m in r["failed"].items()},
            }
            print(json.dumps(merged), flush=True)


def communicator(device: str) -> None:
    """Every algorithm on ``device`` tensors of every dtype and op, blocking and not; ``nccl``'s refusal on a shared GPU."""
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    checks = Checks()
    for algorithm in ALGORITHMS:

        def every_dtype(algorithm: str = algorithm) -> None:
            comm = Communicator(algorithm=algorithm)
            try:
                for dtype in DTYPES:
                    for size in (1, 1001, 300_007):
                        x = torch.arange(size, dtype=torch.float64, device=device).remainder(7).to(dtype)
                        for op, want in (("sum", x.double() * n), ("avg", x.double()), ("max", x.double() + n - 1)):
                            t = x + rank if op == "max" else x.clone()
                            assert comm.allreduce_(t, op=op) is t and t.device.type == device and t.dtype == dtype
                            tol = 1e-2 if dtype == torch.bfloat16 else 1e-12
                            assert torch.allclose(t.double(), want, rtol=tol, atol=tol), (dtype, size, op)
                    t = torch.full((4099,), float(rank + 1), dtype=dtype, device=device)
                    handle = comm.iallreduce_(t, op="sum")
                    assert handle.wait() is t and torch.all(t == n * (n + 1) / 2), (dtype, "iallreduce_")
            finally:
                comm.close()

        checks.run(f"allreduce {algorithm}", every_dtype)

    def nccl_refused_or_used() -> None:
        shared = torch.cuda.is_available() and n > torch.cuda.device_count()
        try:
            comm = Communicator(algorithm="nccl")
        except ConfigError as exc:
            assert shared and "a GPU of its own for every rank" in str(exc), exc
            return
        t = torch.ones(10, device="cuda")
        comm.allreduce_(t)
        assert torch.all(t == n)
        comm.close()

    if device == "cuda":
        checks.run("nccl on a shared GPU refused, else used", nccl_refused_or_used)

        def auto_not_nccl() -> None:
            comm = Communicator(algorithm="auto")
            t = torch.ones(10, device="cuda")
            handle = comm.iallreduce_(t)
            handle.wait()
            shared = n > torch.cuda.device_count()
            assert handle.algorithm != "nccl" or not shared, handle.algorithm
            assert torch.all(t == n)
            comm.close()

        checks.run("auto stages through the host when ranks share a GPU", auto_not_nccl)
    checks.report()


class Net(nn.Module):
    """A small CNN with BatchNorm, as the synchronizer's CPU test uses."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 8 * 8, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.norm(self.conv(x)))
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def synchronizer(device: str) -> None:
    """GradientSynchronizer == torch DDP (gloo, on the same device) after 4 SGD steps, per algorithm, with and without overlap."""
    from rapydli.comm.torchdist import process_group

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # the comparison is of float32 sums
    rank, n = WORLD.Get_rank(), WORLD.Get_size()
    steps, batch = 4, 8
    g = torch.Generator().manual_seed(42)
    xs = torch.randn(steps, n * batch, 1, 8, 8, generator=g).to(device)
    ys = torch.randint(0, 10, (steps, n * batch), generator=g).to(device)
    mine = slice(rank * batch, (rank + 1) * batch)

    def model(seed: int = 0) -> Net:
        torch.manual_seed(seed)
        return Net().to(device)

    def train(net: nn.Module, after_backward: Callable[[], Any] = lambda: None) -> torch.Tensor:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for s in range(steps):
            opt.zero_grad()
            F.cross_entropy(net(xs[s][mine]), ys[s][mine]).backward()
            after_backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in net.parameters()]).cpu()

    checks = Checks()
    process_group(WORLD, "gloo")
    ddp = nn.parallel.DistributedDataParallel(model(), broadcast_buffers=False)
    reference = train(ddp)
    checks.run("ddp trained on " + device, lambda: None if next(ddp.parameters()).device.type == device else 1 / 0)
    for algorithm in ("mpi", "ring", "auto"):
        for overlap in (True, False):

            def equal(algorithm: str = algorithm, overlap: bool = overlap) -> None:
                comm = Communicator(algorithm=algorithm)
                try:
                    net = model(seed=rank)  # different on each rank until broadcast
                    sync = GradientSynchronizer(net, comm, bucket_mb=0.01, overlap=overlap)
                    sync.broadcast_parameters()
                    got = train(net, sync.wait)
                    assert all(p.grad.device.type == device for p in net.parameters())
                    worst = float((got - reference).abs().max())
                    assert worst < 1e-5, worst
                finally:
                    comm.close()

            checks.run(f"synchronizer {algorithm} overlap={overlap} == DDP", equal)
    checks.report()
