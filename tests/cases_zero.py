"""Rank-side code of tests/test_parallel_zero.py (run by ``mpiexec`` on every rank)."""

from __future__ import annotations

import copy
import json
import sys

import torch
from mpi4py import MPI
from torch import nn

from rapydli.parallel.zero import ShardedOptimizer

torch.set_default_dtype(torch.float64)
WORLD = MPI.COMM_WORLD


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.Tanh(), nn.Linear(96, 40), nn.LayerNorm(40), nn.Linear(40, 5))


def adamw(params: list) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def sgd(params: list) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + WORLD.Get_rank())  # each rank its own data
    return torch.randn(8, 40, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def average_grads(net: nn.Module) -> None:
    """What the GradientSynchronizer does: the mean of the ranks' gradients."""
    for p in net.parameters():
        WORLD.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        p.grad /= WORLD.Get_size()


def train(net: nn.Module, optimizer: object, stage: int, steps: range) -> None:
    for step in steps:
        x, y = batch(step)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if stage != 2:  # stage 2 reduce-scatters from its gradient hooks
            average_grads(net)
        optimizer.step()  # type: ignore[attr-defined]
        optimizer.zero_grad()  # type: ignore[attr-defined]


def equivalence(out: str) -> None:
    """AdamW and SGD-momentum steps with ZeRO-1 and ZeRO-2 equal plain data parallel; state bytes ~ full / N; a sharded resume."""
    result: dict = {}
    for name, build in OPTIMIZERS.items():
        reference = model()
        train(reference, build(list(reference.parameters())), 0, range(6))
        probe = model()  # the unsharded state of the same model, for the bytes per rank
        nn.functional.cross_entropy(probe(batch(0)[0]), batch(0)[1]).backward()
        full_state = build(list(probe.parameters()))
        full_state.step()
        result[f"{name}_full_bytes"] = sum(
            v.numel() * v.element_size()
            for s in full_state.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        for stage in (1, 2):
            net = model()
            optimizer = ShardedOptimizer(net.parameters(), build, WORLD, stage=stage, bucket_mb=0.01)
            train(net, optimizer, stage, range(3))
            shard = copy.deepcopy(optimizer.state_dict())
            saved = copy.deepcopy(net.state_dict())
            torch.save(shard, f"{out}/{name}-zero{stage}-rank{WORLD.Get_rank()}.pt")
            train(net, optimizer, stage, range(3, 6))
            worst = max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), net.parameters()))
            assert worst < 1e-12, (name, stage, worst)
            result[f"{name}_zero{stage}_bytes"] = optimizer.state_bytes()
            optimizer.close()
            # resume from the sharded checkpoint written after step 3: the same parameters after step 6
            resumed = model()
            resumed.load_state_dict(saved)
            again = ShardedOptimizer(resumed.parameters(), build, WORLD, stage=stage, bucket_mb=0.01)
            again.load_state_dict(shard)
            train(resumed, again, stage, range(3, 6))
            again.close()
            worst = max(float((a - b).abs().max()) for a, b in zip(reference.parameters(), resumed.parameters()))
            assert worst < 1e-12, ("resumed", name, stage, worst)
    gathered = WORLD.gather(result, root=0)
    if WORLD.Get_rank() == 0:
        with open(f"{out}/zero.json", "w") as stream:
            json.dump(gathered, stream)
    print("OK zero", WORLD.Get_rank(), file=sys.stderr)


class Branches(nn.Module):
    """A trunk every rank uses, a pooler no rank uses, a branch only rank 0 uses and one only the first micro-step uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.pooler, self.rank0, self.first = (
            nn.Linear(40, 5),
            nn.Linear(40, 40),
            nn.Linear(40, 5),
            nn.Linear(40, 5),
        )

    def forward(self, x: torch.Tensor, micro: int) -> torch.Tensor:
        out = self.trunk(x)
        if WORLD.Get_rank() == 0:
            out = out + self.rank0(x)
        if micro == 0:
            out = out + self.first(x)
        return out


def ddp_average(net: nn.Module) -> None:
    """What DDP does with ``find_unused_parameters=True``: no rank used it, ``grad=None``; some did, averaged with zeros."""
    for p in net.parameters():
        if WORLD.allreduce(p.grad is not None, op=MPI.LOR):
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            WORLD.Allreduce(MPI.IN_PLACE, grad.numpy(), op=MPI.SUM)
            p.grad = grad / WORLD.Get_size()


def unused() -> None:
    """ZeRO-2 with two micro-steps a step equals DDP's unused-parameter rules under AdamW(weight_decay=0.1); the pooler stays put."""
    reference, net = Branches(), Branches()
    reference_optimizer = adamw(list(reference.parameters()))
    optimizer = ShardedOptimizer(net.parameters(), adamw, WORLD, stage=2, bucket_mb=0.01)
    for step in range(3):
        for model in (reference, net):
            for micro in range(2):
                x, y = batch(2 * step + micro)
                (nn.functional.cross_entropy(model(x, micro), y) / 2).backward()
        ddp_average(reference)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
    optimizer.close()
    for (name, mine), theirs, initial in zip(net.named_parameters(), reference.parameters(), Branches().parameters()):
        assert float((mine - theirs).abs().max()) < 1e-12, (name, float((mine - theirs).abs().max()))
        moved = not torch.equal(mine, initial)
        assert moved != name.startswith("pooler"), f"{name} {'moved' if moved else 'did not train'}"
    print("OK unused", WORLD.Get_rank(), file=sys.stderr)
