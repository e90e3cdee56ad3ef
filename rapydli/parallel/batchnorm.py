"""BatchNorm over the global batch: the statistics one process would compute, in every data-parallel layout.

One process normalises a batch with the mean and variance of the whole (global) batch.
Data parallelism gives each replica a share of it; a BatchNorm left alone normalises each
share with its own statistics (what DDP does without ``SyncBatchNorm``), so the activations,
the gradients and the running statistics all differ from one process's, and the trained
model is not the one process trains. :func:`global_batch_norm` makes every ``_BatchNorm``
of a rank's model part compute its batch statistics across the data group in training:

* forward: per channel, the sum and count of the replica's share, summed over the group
  (mean), then the sum of squared deviations from that mean, summed (biased variance);
* backward: the gradients reaching the mean and the variance are summed over the group
  before they flow into each replica's inputs, as the same statistics would carry them in
  one process;
* running statistics: updated from the global mean and the unbiased global variance
  (``N / (N - 1)``), equal on every replica.

In evaluation (``model.eval()``) and with one replica a norm runs as PyTorch's does.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

#: Where a norm keeps the data group's communicator (in its ``__dict__``: not a submodule, not a buffer).
GROUP = "_rapydli_data_group"


class _GlobalMoments(torch.autograd.Function):
    """Per-channel mean and biased variance of ``x`` (channels on dimension 1) over every replica's share."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.tensor([x.numel() / x.shape[1]], dtype=x.dtype, device=x.device)
        sums = comm.allreduce_(torch.cat([x.sum(dims), count]), op="sum")
        total = sums[-1]
        mean = sums[:-1] / total
        shape = [1, -1] + [1] * (x.dim() - 2)
        var = comm.allreduce_((x - mean.view(shape)).square().sum(dims), op="sum") / total
        ctx.save_for_backward(x, mean)
        ctx.comm, ctx.total, ctx.shape = comm, total, shape
        return mean, var

    @staticmethod
    def backward(ctx: Any, grad_mean: torch.Tensor, grad_var: torch.Tensor) -> tuple[torch.Tensor, None]:
        x, mean = ctx.saved_tensors
        grads = ctx.comm.allreduce_(
            torch.cat([grad_mean, grad_var]), op="sum"
        )  # every replica's loss reaches the shared statistics
        channels = mean.numel()
        summed_mean, summed_var = grads[:channels].view(ctx.shape), grads[channels:].view(ctx.shape)
        grad_x = (summed_mean + 2.0 * summed_var * (x - mean.view(ctx.shape))) / ctx.total
        return grad_x, None


class _DataGroup:
    """The data group's communicator as a norm holds it; a copy of the model drops it (its norms normalise alone), and so does a pickle of it.

    A copy runs where the other replicas do not follow it (the autotuner times one on rank
    0 only): a collective there would wait for ever.
    """

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def __deepcopy__(self, memo: dict[int, Any]) -> _DataGroup:
        return _DataGroup(None)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_DataGroup, (None,))


def _global_forward(self: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    group = self.__dict__.get(GROUP)
    comm: Any = group.comm if group is not None else None
    if not self.training or comm is None:
        return type(self).forward(self, x)
    mean, var = _GlobalMoments.apply(x, comm)
    if self.track_running_stats and self.running_mean is not None and self.running_var is not None:
        with torch.no_grad():
            count = x.numel() / x.shape[1] * comm.world_size
            self.num_batches_tracked.add_(1)  # type: ignore[union-attr]
            momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum  # type: ignore[arg-type]
            unbiased = var * (count / max(count - 1, 1))
            self.running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            self.running_var.mul_(1 - momentum).add_(unbiased.detach(), alpha=momentum)
    shape = [1, -1] + [1] * (x.dim() - 2)
    out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
    if self.affine:
        out = out * self.weight.view(shape) + self.bias.view(shape)
    return out


def global_batch_norm(model: nn.Module, comm: Any) -> list[str]:
    """Make every BatchNorm of ``model`` normalise over the data group ``comm`` in training (see the module); their names.

    ``comm``: a :class:`~rapydli.comm.Communicator` over the replicas (``None`` or one rank:
    nothing to do). Idempotent.
    """
    if comm is None or comm.world_size <= 1:
        return []
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and not isinstance(module, nn.SyncBatchNorm):
            module.__dict__[GROUP] = _DataGroup(comm)
            if getattr(module.forward, "__func__", None) is not _global_forward:
                module.forward = types.MethodType(_global_forward, module)  # type: ignore[method-assign]
            names.append(name)
    return names
